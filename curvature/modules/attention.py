"""nn.MultiheadAttention: its in-projection as one Linear-like block, its ``out_proj`` as a Linear.

``nn.MultiheadAttention`` computes with ``in_proj_weight [3E, E]`` / ``in_proj_bias [3E]`` and with
``out_proj``'s parameters inside ``F.multi_head_attention_forward``, without calling ``out_proj``, so
no layer output exists to take gradients of. While a :class:`~curvature.capture.Capture` records,
a forward hook (:func:`attention_hook`) therefore *recomputes* the attention from the same
parameters and returns that as the module's output (the module's own forward result is dropped;
the recorded forward costs one more attention):

* ``z = x W_inᵀ + b_in`` (``[N, T, 3E]``, batch-first) is recorded as this module's output, with
  ``x`` as its input: the in-projection is one Linear over ``vec([W_in | b_in])`` (Q, K and V rows
  in one block, so their cross terms are kept in full blocks);
* the heads attend (``softmax(q kᵀ/√d + masks)``, dropout in training) and ``module.out_proj`` is
  *called* on the batch-first result, so ``out_proj`` is recorded like any Linear.

Cross-attention (query, key, value not one tensor): ``x`` is the query, key and value positions one
after the other (``[N, T + 2S, E]``), ``z = x W_inᵀ + b_in`` is computed at all of them and only the Q
columns at query positions, K columns at key positions and V columns at value positions are used; the
unused entries get zero gradients, so per-example gradients (diag/full) stay exact, at three times the
projection's cost in a recorded forward.

Normal form: ``a = x [N, P, E]``, ``g [K, N, P, 3E]`` (``P = T`` positions, ``T + 2S`` for
cross-attention): the Linear family's math with the in-projection's parameters. K-FAC follows the
expand convention over the ``P`` positions (as for any Linear applied at several positions).
Supported: batched ``[N, T, E]`` (``batch_first``), ``[T, N, E]`` or unbatched ``[T, E]`` inputs,
``attn_mask``, ``key_padding_mask``, ``is_causal``, ``need_weights``/``average_attn_weights``,
dropout. Not supported (ValueError at selection): separate ``kdim``/``vdim``, ``add_bias_kv``,
``add_zero_attn``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..hook_marks import attached_owners, capture_hook, hidden_from, in_func_transform
from .linear import LinearFamily

_NAMES = {"in_proj_weight": "weight", "in_proj_bias": "bias"}
_BACK = {v: k for k, v in _NAMES.items()}


class _InProjection:
    """The in-projection seen as a Linear (``.weight``, ``.bias``) by the Linear family's math."""

    def __init__(self, module: nn.MultiheadAttention) -> None:
        self.weight = module.in_proj_weight
        self.bias = module.in_proj_bias


def _proj(module: Any) -> Any:
    return module if isinstance(module, _InProjection) else _InProjection(module)


def _names(names: Sequence[str]) -> Tuple[str, ...]:
    return tuple(_NAMES.get(n, n) for n in names)


class MultiheadAttentionFamily(LinearFamily):
    """The in-projection of ``nn.MultiheadAttention`` (parameters ``in_proj_weight``, ``in_proj_bias``)."""

    module_types = (nn.MultiheadAttention,)

    def validate(self, module: nn.Module) -> None:
        bad = [what for what, on in (("kdim/vdim other than embed_dim", not module._qkv_same_embed_dim),
                                     ("add_bias_kv=True", module.bias_k is not None),
                                     ("add_zero_attn=True", module.add_zero_attn)) if on]
        if bad:
            raise ValueError(f"nn.MultiheadAttention with {', '.join(bad)} is not supported by the curvature "
                             "engine; skip it with skip_modules=[nn.MultiheadAttention]")

    def weight_matrix_shape(self, module: Any) -> Tuple[int, int]:
        return super().weight_matrix_shape(_proj(module))

    def per_example_grads(self, module: Any, a: Tensor, g: Tensor, names: Sequence[str]) -> Dict[str, Tensor]:
        out = super().per_example_grads(_proj(module), a, g, _names(names))
        return {_BACK[k]: v for k, v in out.items()}

    def diag_sum(self, module: Any, a: Tensor, g: Tensor, names: Sequence[str]) -> Optional[Tensor]:
        return super().diag_sum(_proj(module), a, g, _names(names))

    def kfac_factors(self, module: Any, a: Tensor, g: Tensor, names: Sequence[str]) -> Tuple[Tensor, Tensor]:
        return super().kfac_factors(_proj(module), a, g, _names(names))

    def kfac_output_factor(self, module: Any, a: Optional[Tensor], g: Tensor, names: Sequence[str]) -> Tensor:
        return super().kfac_output_factor(_proj(module), a, g, _names(names))

    def matrix_columns(self, module: Any, names: Sequence[str]) -> Optional[List[Tuple[int, int]]]:
        return super().matrix_columns(_proj(module), _names(names))

    def to_matrix(self, module: Any, tensors: Sequence[Tensor], names: Sequence[str]) -> Tensor:
        return super().to_matrix(_proj(module), tensors, _names(names))

    def to_matrix_into(self, module: Any, tensors: Sequence[Tensor], names: Sequence[str], out: Tensor) -> None:
        super().to_matrix_into(_proj(module), tensors, _names(names), out)

    def from_matrix(self, module: Any, matrix: Tensor, names: Sequence[str]) -> List[Tensor]:
        return super().from_matrix(_proj(module), matrix, _names(names))


def _additive_mask(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor, or the same view of one tensor taken twice (same memory,
    offset, shape, strides and dtype, made by the same kind of autograd node from the same inputs:
    two calls of ``x.transpose(0, 1)``): the same values on the same gradient path, so the projections
    see one input. A detached copy (another gradient path) or a clone (other memory) is not."""
    if a is b:
        return True
    if a.dtype != b.dtype or a.device != b.device or a.shape != b.shape or a.stride() != b.stride() \
            or a.storage_offset() != b.storage_offset() or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    fa, fb = a.grad_fn, b.grad_fn
    return fa is fb or (fa is not None and fb is not None and type(fa) is type(fb)
                        and fa.next_functions == fb.next_functions)


def recorded_forward(module: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
                     key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                     attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                     is_causal: bool = False) -> Tuple[Tuple[Tensor, Optional[Tensor]], Tensor, Tensor]:
    """``((attn_output, attn_weights), x, z)``: the module's result recomputed from its parameters,
    with the batch-first in-projection input ``x`` and output ``z = x W_inᵀ + b_in`` (``[N, P, 3E]``).

    Self-attention (``query``, ``key`` and ``value`` one tensor, or the same view of one tensor, as two
    calls of ``x.transpose(0, 1)`` give: :func:`_same_values`): ``x`` is the input, ``P = T``. Otherwise ``x`` is the
    query, key and value positions one after the other (``P = T + 2S``) and only the Q columns of ``z``
    at query positions, the K columns at key positions and the V columns at value positions are used
    (the others get zero gradients), so the Linear math on ``(x, ∂z)`` gives the exact per-example
    gradients; K-FAC averages ``A`` over all ``P`` positions (expand convention)."""
    batched = query.dim() == 3

    def batch_first(t: Tensor) -> Tensor:
        if not batched:
            return t.unsqueeze(0)
        return t if module.batch_first else t.transpose(0, 1)

    xq = batch_first(query)
    n, tq, e = xq.shape
    h = module.num_heads
    hd = e // h
    if _same_values(query, key) and _same_values(key, value):
        x = xq
        z = F.linear(x, module.in_proj_weight, module.in_proj_bias)
        zq, zk, zv = z.chunk(3, dim=-1)
    else:
        xk, xv = batch_first(key), batch_first(value)
        x = torch.cat([xq, xk, xv], dim=1)
        z = F.linear(x, module.in_proj_weight, module.in_proj_bias)
        s_len = xk.shape[1]
        zq, zk, zv = z[:, :tq, :e], z[:, tq:tq + s_len, e:2 * e], z[:, tq + s_len:, 2 * e:]
    s = zk.shape[1]
    q, k, v = (p.reshape(n, p.shape[1], h, hd).transpose(1, 2) for p in (zq, zk, zv))  # [N, H, L, hd]
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)  # [N, H, T, S]
    mask = _additive_mask(attn_mask, scores.dtype)
    if mask is not None:
        scores = scores + (mask.reshape(n, h, tq, s) if mask.dim() == 3 else mask)
    elif is_causal:
        causal = torch.ones(tq, s, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
    pad = _additive_mask(key_padding_mask, scores.dtype)
    if pad is not None:
        scores = scores + pad.reshape(n, 1, 1, s)
    weights = torch.softmax(scores, dim=-1)
    attended = F.dropout(weights, p=module.dropout) if module.training and module.dropout > 0 else weights
    o = (attended @ v).transpose(1, 2).reshape(n, tq, e)
    out = module.out_proj(o)  # a real call: out_proj is recorded as a Linear
    if not batched:
        out = out.squeeze(0)
    elif not module.batch_first:
        out = out.transpose(0, 1)
    w: Optional[Tensor] = None
    if need_weights:
        w = weights.mean(dim=1) if average_attn_weights else weights
        if not batched:
            w = w.squeeze(0)
    return (out, w), x, z


_ARG_NAMES = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
              "average_attn_weights", "is_causal")


def _recorded_call(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, Tensor, Tensor]:
    """:func:`recorded_forward` of one call of ``module`` (its hook's ``args``/``kwargs``), hidden from a
    KFACPreconditioner on ``out_proj`` (kfac_pytorch's registration; never called by the attention's own forward,
    it does not see this call, which only curvature steps make)."""
    call = dict(zip(_ARG_NAMES, args))
    call.update(kwargs)
    with hidden_from(attached_owners(module.out_proj)):
        return recorded_forward(module, **call)


def _refuse_out_proj_hooks(capture: Any, module: nn.Module, name: str, leave: str, skipped: str) -> None:
    """ValueError when ``module.out_proj`` has hooks of the user's: only a recorded forward calls it."""
    if capture.foreign_hooks(module.out_proj):
        from ..selection import skip_hint
        raise ValueError(
            f"module {name!r} (MultiheadAttention): its out_proj has hooks of yours; nn.MultiheadAttention's "
            "forward never calls out_proj (it uses its weight directly), but the recorded forward of a curvature "
            "step does, so those hooks would run at curvature steps only. Register them on the attention "
            f"module, or leave {leave} to the plain update with {skip_hint(skipped)}")


def passthrough_hook(capture: Any, name: str) -> Callable[[nn.Module, Tuple[Any, ...], Dict[str, Any], Any], Any]:
    """A ``with_kwargs`` forward hook on an attention ``name`` the capture does not cover (its in-projection
    frozen) whose ``out_proj`` it does: the output recomputed by :func:`recorded_forward`, which calls
    ``out_proj`` (recorded there as a Linear); the attention's own forward only reads its weight."""
    def hook(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> Any:
        if in_func_transform():
            return None
        if not torch.is_grad_enabled():
            capture.called_without_grad.add(f"{name}.out_proj")
            return None
        _refuse_out_proj_hooks(capture, module, name, "out_proj", f"{name}.out_proj")
        return _recorded_call(module, args, kwargs)[0]
    return capture_hook(hook)


def recomputes_out_proj(module: nn.Module) -> bool:
    """Whether :func:`recorded_forward` computes this attention (the options the family supports)."""
    return isinstance(module, nn.MultiheadAttention) and module._qkv_same_embed_dim and module.bias_k is None \
        and not module.add_zero_attn


def attention_hook(capture: Any, name: str) -> Callable[[nn.Module, Tuple[Any, ...], Dict[str, Any], Any], Any]:
    """A ``with_kwargs`` forward hook for :class:`~curvature.capture.Capture`: records ``x``/``z`` of
    the in-projection as the module's :class:`~curvature.capture.ModuleRecord` and returns the
    recomputed output (see the module docstring)."""
    # the capture and the selection import the families, not the other way round
    from ..capture import ModuleRecord, grad_appender, reused_module

    def hook(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> Any:
        if in_func_transform():
            return None
        if not torch.is_grad_enabled():
            capture.called_without_grad.add(name)
            return None
        if capture.recomputing(name):  # the same ops as the recorded call (the saved tensors must match)
            return _recorded_call(module, args, kwargs)[0]
        capture.calls[name] = capture.calls.get(name, 0) + 1
        if name in capture.records:
            if capture.on_reuse == "count":
                return None
            raise ValueError(reused_module(name, module))
        _refuse_out_proj_hooks(capture, module, name, "the attention", name)
        result, x, z = _recorded_call(module, args, kwargs)
        rec = ModuleRecord(inputs=(x.detach(),), output=z)
        capture.records[name] = rec
        if capture.record_backward and z.requires_grad:
            z.register_hook(grad_appender(rec.backward_grads))
        return result
    return capture_hook(hook)
