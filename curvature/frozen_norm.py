"""BatchNorm with batch statistics, seen by the curvature's backward passes as frozen.

A BatchNorm that normalizes with the statistics of the current batch (training mode, or no
running statistics) couples the examples: ``∂out_n/∂x_m ≠ 0`` for ``m ≠ n`` through the batch
mean and variance. The convention of K-FAC / Fisher libraries (and of
:mod:`curvature.modules.norm`) treats those statistics as constants, so per-example
quantities stay per-example. The user's own ``backward`` must still see the true gradient.

:func:`route_output` puts one node after such a BatchNorm's output. In normal mode it passes
the gradient to the BatchNorm's own graph (the true gradient, batch-statistics terms
included); while its :class:`FrozenMode` is active — only around the engine's backward passes
of the curvature — it sends ``g · γ/√(σ²_B + ε)`` straight to the BatchNorm's input: the
Jacobian with the batch statistics frozen. Layers *upstream* of the BatchNorm then get the
blocks of the frozen-statistics model (``tests/test_curvature_reference.py``).
"""
from __future__ import annotations

from typing import Any, List, Tuple

import torch
from torch import Tensor, nn
from .eager import eager


class FrozenMode:
    """Whether the routing nodes of one capture send gradients the frozen way (off by default).

    One per :class:`curvature.capture.Capture`, read by its nodes during backward (from any
    thread: autograd may run a device's backward on its own worker thread). ``with mode.on():``
    turns it on for the block (nestable; a plain class, not a generator context manager: it wraps
    every backward pass of the engine)."""

    def __init__(self) -> None:
        self.active = False
        self._outer: List[bool] = []

    def on(self) -> "FrozenMode":
        """Frozen routing for the backward passes run inside the ``with`` block."""
        return self

    def __enter__(self) -> "FrozenMode":
        self._outer.append(self.active)
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = self._outer.pop()


def uses_batch_statistics(module: nn.Module) -> bool:
    """A BatchNorm that normalizes with the current batch's statistics in this call.

    ``nn.SyncBatchNorm`` is left out: across processes it normalizes with the statistics of
    the global batch, which :func:`frozen_input_scale` (this process's batch) would not match;
    layers before it keep the batch-coupled blocks."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm) \
        and (module.training or module.running_mean is None or module.running_var is None)


def frozen_input_scale(module: nn.modules.batchnorm._BatchNorm, x: Tensor) -> Tensor:
    """``γ / √(σ²_B + ε)`` per channel (``1/√(σ²_B + ε)`` without affine), shaped to broadcast
    against ``x [N, C, ...]``: the BatchNorm's Jacobian with its batch statistics frozen. Detached."""
    x = x.detach()
    dims = [d for d in range(x.dim()) if d != 1]
    var = x.var(dim=dims, unbiased=False)  # the biased batch variance the forward normalizes with
    scale = torch.rsqrt(var + module.eps)
    if module.affine and module.weight is not None:
        scale = scale * module.weight.detach()
    return scale.reshape((1, -1) + (1,) * (x.dim() - 2)).to(x.dtype)


class _Route(torch.autograd.Function):
    """``out`` unchanged forward; backward to ``out`` (normal) or to ``x`` through ``scale`` (frozen)."""

    generate_vmap_rule = True  # the exact Fisher backpropagates its K vectors under vmap

    @staticmethod
    def forward(x: Tensor, out: Tensor, scale: Tensor, mode: FrozenMode) -> Tensor:  # type: ignore[override]
        return out.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tensor) -> None:
        _, _, scale, mode = inputs
        ctx.save_for_backward(scale)
        ctx.mode = mode

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tuple[Any, ...]:  # type: ignore[override]
        (scale,) = ctx.saved_tensors
        if ctx.mode.active:
            return (g * scale if ctx.needs_input_grad[0] else None), None, None, None
        return None, g, None, None


@eager  # torch.compiler.disable, lazily (curvature/eager.py): traced by dynamo, the routing node's backward lost its frozen-statistics path
def route_output(module: nn.Module, x: Tensor, out: Tensor, mode: FrozenMode) -> Tensor:
    """``out`` behind a routing node (a fresh tensor equal to ``out``), see the module docstring."""
    return _Route.apply(x, out, frozen_input_scale(module, x), mode)


class KeptStatistics:
    """``with kept:`` leaves the running statistics of the norm layers in training mode as they were on
    entry: the curvature's own backward passes re-run the forward of an activation-checkpointed segment
    (``torch.utils.checkpoint``, ``use_reentrant=False``), and a BatchNorm there would count the batch
    again at every pass (the exact Fisher's first estimate ran it 9 times). The buffers are copied back
    whether or not a pass changed them (the BatchNorm kernel updates them in place without bumping their
    version counters): three small vectors per layer in training mode, twice per estimate."""

    def __init__(self, norms: List[nn.Module]) -> None:
        #: every BatchNorm / InstanceNorm under the model that tracks running statistics
        self.norms = norms
        self._saved: List[List[Tuple[Tensor, Tensor]]] = []  # one entry per open ``with`` (nestable)

    def __enter__(self) -> "KeptStatistics":
        self._saved.append([(b, b.clone()) for m in self.norms if m.training
                            for b in m._buffers.values() if b is not None])
        return self

    def __exit__(self, *exc: object) -> None:
        # through ``.data``: the tensor's version counter stays as it is, for the BatchNorm's backward saved
        # the buffers (the user's backward after an estimate run during the forward checks their versions)
        for b, value in self._saved.pop():
            b.data.copy_(value)


def statistics_norms(model: nn.Module) -> List[nn.Module]:
    """The norm layers under ``model`` whose training-mode forward updates running statistics."""
    return [m for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]
