"""BatchNorm1d/2d/3d, LayerNorm, GroupNorm, InstanceNorm1d/2d/3d and RMSNorm: elementwise affine parameters on a
normalized input.

Normal form: ``a = x̂ [N, T, C]`` (the normalized input before the affine map), ``g [K, N, T, C]``.
Per-example gradients: ``∂ℓ/∂γ = Σ_t g_t ⊙ x̂_t``, ``∂ℓ/∂β = Σ_t g_t``.

BatchNorm in training mode: the batch statistics are treated as constants (the usual
convention of K-FAC/Fisher libraries), so the block is that of the affine map applied to
the observed ``x̂``; in eval mode the running statistics are used and this is exact (a BatchNorm with
``track_running_stats=False`` normalizes with batch statistics in eval mode too: constants there as well). The
engine's backward passes also cross the BatchNorm with its statistics frozen, so layers
before it get frozen-statistics blocks too (:mod:`curvature.frozen_norm`). LayerNorm, GroupNorm,
InstanceNorm and RMSNorm normalize each example by its own statistics (an InstanceNorm in eval mode with
``track_running_stats=True`` by the running ones): their blocks, and those of the layers before them, are
exact.
Shapes: ``full`` and ``diag`` (no K-FAC).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .base import LayerFamily, channels_last_grad


class _AffineNormFamily(LayerFamily):
    supports_kfac = False

    def per_example_grads(self, module: nn.Module, a: Tensor, g: Tensor,
                          names: Sequence[str]) -> Dict[str, Tensor]:
        out: Dict[str, Tensor] = {}
        shape = self.param_shape(module)
        if "weight" in names:
            out["weight"] = (g * a.to(g.dtype).unsqueeze(0)).sum(dim=2).reshape(g.shape[:2] + shape)
        if "bias" in names:
            out["bias"] = g.sum(dim=2).reshape(g.shape[:2] + shape)
        return out

    def param_shape(self, module: nn.Module) -> Tuple[int, ...]:
        return tuple(module.weight.shape)


def _wide(x: Tensor) -> Tensor:
    """``x`` in float32 where it is float16 or bfloat16 (torch normalizes those in float32; so do the
    statistics here)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _channels_last(x: Tensor) -> Tensor:
    """``[N, C, *positions]`` -> ``[N, T, C]``."""
    return x.reshape(x.shape[0], x.shape[1], -1).transpose(1, 2)


def _channel_normalized(x: Tensor, mean: Tensor, var: Tensor, eps: float) -> Tensor:
    """``x [N, C, *positions]`` normalized by the per-channel ``mean`` and ``var`` ``[C]``, in ``x``'s own layout
    and moved channels last at the end: ``[N, T, C]``."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return _channels_last((x - mean.reshape(shape)) * torch.rsqrt(var + eps).reshape(shape))


class _ChannelNormFamily(_AffineNormFamily):
    """Per-channel parameters over ``[N, C, *positions]`` (BatchNorm, GroupNorm, InstanceNorm): output gradients
    channels last."""

    def normal_output_grad(self, module: nn.Module, g: Tensor) -> Tensor:
        return channels_last_grad(g)


class _TrailingNormFamily(_AffineNormFamily):
    """Parameters of the trailing ``normalized_shape`` (LayerNorm, RMSNorm): normal forms ``[N, T, d]``, ``d`` its
    number of elements, ``T`` the leading dimensions after the batch."""

    @staticmethod
    def trailing_dims(module: nn.Module, x: Tensor) -> Tuple[int, ...]:
        """The dimensions of ``x`` the layer normalizes over."""
        return tuple(range(x.dim() - len(module.normalized_shape), x.dim()))

    @staticmethod
    def features(module: nn.Module) -> int:
        return int(math.prod(module.normalized_shape))

    def normal_output_grad(self, module: nn.Module, g: Tensor) -> Tensor:
        return g.reshape(g.shape[0], g.shape[1], -1, self.features(module))


class BatchNormFamily(_ChannelNormFamily):
    """``nn.BatchNorm1d/2d/3d`` affine parameters ``weight``, ``bias`` ``[C]`` (diagonal or full blocks; the
    batch statistics as constants for the Fisher kinds)."""

    module_types = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

    def validate(self, module: nn.Module) -> None:
        if not module.affine:
            raise ValueError("BatchNorm without affine parameters has nothing to cover")

    def normal_input(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Tensor:
        x = inputs[0].detach()
        if module.training or module.running_mean is None:  # one pass over x in its own [N, C, *positions] layout
            var, mean = torch.var_mean(x, dim=[0] + list(range(2, x.dim())), correction=0)
        else:
            mean, var = module.running_mean.to(x.dtype), module.running_var.to(x.dtype)
        return _channel_normalized(x, mean, var, module.eps)


class LayerNormFamily(_TrailingNormFamily):
    """``nn.LayerNorm`` affine parameters ``weight``, ``bias`` of the normalized shape (diagonal or full
    blocks)."""

    module_types = (nn.LayerNorm,)

    def validate(self, module: nn.Module) -> None:
        if not module.elementwise_affine:
            raise ValueError("LayerNorm without elementwise_affine has nothing to cover")

    def normal_input(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Tensor:
        x = inputs[0].detach()
        dims = self.trailing_dims(module, x)
        mean = x.mean(dim=dims, keepdim=True)
        var = x.var(dim=dims, unbiased=False, keepdim=True)
        xhat = (x - mean) / torch.sqrt(var + module.eps)
        return xhat.reshape(x.shape[0], -1, self.features(module))


def _group_normalized(x: Tensor, groups: int, eps: float) -> Tensor:
    """``x [N, C, *positions]`` normalized over each example's ``groups`` channel groups (and positions),
    as ``F.group_norm`` without the affine map: ``[N, T, C]``."""
    g = x.reshape(x.shape[0], groups, -1)
    mean = g.mean(dim=2, keepdim=True)
    var = g.var(dim=2, unbiased=False, keepdim=True)
    return _channels_last(((g - mean) / torch.sqrt(var + eps)).reshape(x.shape))


class GroupNormFamily(_ChannelNormFamily):
    """``nn.GroupNorm`` affine parameters ``weight``, ``bias`` ``[C]`` over ``[N, C, *positions]`` (each
    example's groups normalized by their own statistics; diagonal or full blocks)."""

    module_types = (nn.GroupNorm,)

    def validate(self, module: nn.Module) -> None:
        if not module.affine:
            raise ValueError("GroupNorm without affine parameters has nothing to cover")

    def normal_input(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Tensor:
        x = _wide(inputs[0].detach())
        if x.dim() < 2:
            raise ValueError(f"GroupNorm input of shape {list(x.shape)}: expected [N, C, *positions]")
        return _group_normalized(x, module.num_groups, module.eps)


class InstanceNormFamily(GroupNormFamily):
    """``nn.InstanceNorm1d/2d/3d`` affine parameters ``weight``, ``bias`` ``[C]`` over ``[N, C, *positions]``: each
    example's channels normalized by their own statistics (GroupNorm with a group per channel), or by the
    running statistics in eval mode with ``track_running_stats=True``, as torch does (diagonal or full blocks)."""

    module_types = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)

    def validate(self, module: nn.Module) -> None:
        if not module.affine:
            raise ValueError("InstanceNorm without affine parameters has nothing to cover")

    def normal_input(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Tensor:
        x = _wide(inputs[0].detach())
        if module.training or not module.track_running_stats:
            return _group_normalized(x, x.shape[1], module.eps)  # a group per channel
        return _channel_normalized(x, module.running_mean.to(x.dtype), module.running_var.to(x.dtype), module.eps)

    def batched_output_dim(self, module: nn.Module) -> Optional[int]:
        return module._get_no_batch_dim() + 1  # [N, C, L] / [N, C, H, W] / [N, C, D, H, W]: an unbatched call is refused


class RMSNormFamily(_TrailingNormFamily):
    """``nn.RMSNorm``'s ``weight`` of the normalized shape (no bias; ``x̂ = x / √(mean x² + eps)``, ``eps``
    None: the machine epsilon of the input's dtype promoted to float32, as torch, which normalizes float16 and
    bfloat16 inputs in float32; diagonal or full blocks)."""

    module_types = (nn.RMSNorm,)

    def validate(self, module: nn.Module) -> None:
        if not module.elementwise_affine:
            raise ValueError("RMSNorm without elementwise_affine has nothing to cover")

    def normal_input(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Tensor:
        x = _wide(inputs[0].detach())
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        xhat = x * torch.rsqrt(x.pow(2).mean(dim=self.trailing_dims(module, x), keepdim=True) + eps)
        return xhat.reshape(x.shape[0], -1, self.features(module))
