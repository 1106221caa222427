"""Jacobian–vector products of an ``nn.Sequential`` for several directions in one pass, by hand.

The adaptive step (:mod:`torchsso2.optim.adaptive`) needs ``J vᵢ`` (``J`` the Jacobian of the
model output with respect to the parameters) for two directions at every step. The generic path
runs the model once per direction with ``torch.autograd.forward_ad`` dual numbers: each pass
recomputes the forward, and on small models the dual-number dispatch costs more than the
arithmetic (digits MLP 64-128-10 at batch 128, one thread: ~0.7 ms for two directions against
~0.07 ms for a forward). For an ``nn.Sequential`` built only of the layers below, this module
computes the same products with plain tensor operations: the forward once, and the tangents of
all ``k`` directions stacked along a leading dimension (``[k, N, ...]``), the parameter-tangent
terms of a layer as one matmul / convolution with the ``k`` weight tangents concatenated and the
``k`` bias tangents as its bias (``addmm``, or the convolution's bias), the ReLU tangent by relu's
backward kernel (one fused op) (~0.2 ms on that MLP). Same math as the dual numbers: the results
agree to rounding.

The last layer, when it is a ``Linear`` with fewer than :data:`NARROW` outputs on a 2-d input
(a classifier head), is computed output-major: ``W hᵀ`` ([out, N]) instead of ``h Wᵀ`` ([N, out]).
On CPU BLAS a product with a narrow row-major result runs 2–3x slower than its transpose (digits
MLP head ``[128, 128] @ [128, 10]``: ~15 µs against ~8 µs, the tangents' ``[256, 128] @ [128, 10]``:
~28 µs against ~13 µs); the results are returned as transposed views in the usual shapes.

Supported children (exact types, no hooks): ``Linear``, ``Conv1d``/``Conv2d``, ``ReLU``, ``Tanh``,
``Sigmoid``, ``MaxPool1d``/``MaxPool2d`` (the tangent at the pooled argmax, as forward mode
takes it), ``AvgPool1d``/``AvgPool2d``, ``Flatten``, ``Unflatten``, ``Identity``; none of them
draws random numbers or has buffers. Anything else (a subclass, BatchNorm, Dropout, a
parametrized layer, a module with its own forward hooks) takes the generic path.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curvature.uses_static import no_global_forward_hooks, plain_module

from .sequential_record import Activations

_PARAMETRIC = (nn.Linear, nn.Conv1d, nn.Conv2d)
_ELEMENTWISE = (nn.ReLU, nn.Tanh, nn.Sigmoid)
_MAXPOOL = (nn.MaxPool1d, nn.MaxPool2d)
_LINEAR_MAPS = (nn.AvgPool1d, nn.AvgPool2d, nn.Flatten, nn.Unflatten, nn.Identity)
_SUPPORTED = frozenset(_PARAMETRIC + _ELEMENTWISE + _MAXPOOL + _LINEAR_MAPS)
#: a last ``Linear`` with fewer outputs than this is computed output-major (:func:`_linear_head`): the
#: width below which CPU BLAS (MKL, AVX-512 float32) runs a product with a row-major result 2-3x slower
NARROW = 16


def supports(model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """True when :func:`sequential_jvps` applies to ``model(*args, **kwargs)``: an ``nn.Sequential``
    (exact type, no hooks, no ``forward`` set on an instance, no global forward hooks) of supported
    children called with one tensor."""
    return len(args) == 1 and not kwargs and isinstance(args[0], Tensor) and supports_model(model)


def supports_model(model: nn.Module) -> bool:
    """The part of :func:`supports` that does not depend on the call's arguments."""
    if type(model) is not nn.Sequential or not plain_module(model) or not no_global_forward_hooks():
        return False
    for child in model:
        if type(child) not in _SUPPORTED or not plain_module(child):
            return False
        if isinstance(child, (nn.Conv1d, nn.Conv2d)) and child.padding_mode != "zeros":
            return False
        if isinstance(child, _MAXPOOL) and child.return_indices:
            return False
    return True


def _bias_view(tb: Tensor, ndim: int, channel_dim: int) -> Tensor:
    """``[k, C]`` bias tangents shaped to broadcast against ``[k, *out]`` (``out`` of ``ndim``
    dims with channels at ``channel_dim``)."""
    shape = [tb.shape[0]] + [1] * ndim
    shape[1 + channel_dim] = tb.shape[1]
    return tb.view(shape)


def _linear(mod: nn.Linear, h: Tensor, t: Optional[Tensor], tangents: Dict[int, Tensor], k: int,
            out: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """``(output, tangent)`` of ``mod`` at ``h``; ``out``: the output the forward computed (else computed)."""
    if out is None:
        out = F.linear(h, mod.weight, mod.bias)
    tw = tangents.get(id(mod.weight))
    tb = tangents.get(id(mod.bias)) if mod.bias is not None else None
    y = None
    if tw is not None:  # h [.., in] @ [k·out, in]ᵀ (+ the k bias tangents [k·out]) -> [.., k·out]
        flat_w = tw.reshape(-1, tw.shape[-1]).t()
        if tb is not None and h.dim() == 2:  # one addmm: the product and the bias tangents together
            y = torch.addmm(tb.reshape(-1), h, flat_w)
            tb = None
        else:
            y = torch.matmul(h, flat_w)
        y = y.unflatten(-1, (k, -1)).movedim(-2, 0)  # [k, .., out] (a view)
    if t is None:
        nt = y
    else:
        nt = torch.matmul(t, mod.weight.t())  # [k, ..., out], a new tensor
        if y is not None:
            nt.add_(y)
    if tb is not None:
        bias = _bias_view(tb, out.dim(), out.dim() - 1)
        nt = bias.expand(k, *out.shape) if nt is None else nt + bias
    return out, nt


def _rows(t: Tensor) -> Tuple[Tensor, bool]:
    """The ``[k, N, in]`` tangent ``t`` as a 2-d matrix of its ``k·N`` rows without a copy when either
    ``[k, N]`` or ``[N, k]`` is its memory order (the second is what ``_linear``'s addmm leaves);
    ``True`` when the rows are in ``[N, k]`` order."""
    nk = t.transpose(0, 1)
    if nk.is_contiguous():
        return nk.reshape(-1, t.shape[-1]), True
    return t.reshape(-1, t.shape[-1]), False


def _linear_head(mod: nn.Linear, h: Tensor, t: Optional[Tensor], tangents: Dict[int, Tensor], k: int,
                 out: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`_linear` of a narrow last layer on a 2-d input ``h`` [N, in], output-major: the output
    ``W hᵀ + b`` ([out, N]) and the tangents ``W tᵢᵀ + Wᵢ hᵀ + bᵢ`` ([k, out, N]), returned as
    transposed views [N, out] and [k, N, out] (the same products as :func:`_linear`, transposed).
    ``out``: the [N, out] output the forward computed (returned as given; else computed)."""
    w, b = mod.weight, mod.bias
    n, ht = h.shape[0], h.t()
    if out is None:
        out = (torch.mm(w, ht) if b is None else torch.addmm(b.unsqueeze(1), w, ht)).t()  # [out, N] seen as [N, out]
    tw = tangents.get(id(w))
    tb = tangents.get(id(b)) if b is not None else None
    nt = None  # [k, out, N]
    if tw is not None:  # the k weight tangents [k·out, in] @ hᵀ (+ the bias tangents as one column each)
        flat_w = tw.reshape(-1, tw.shape[-1])
        nt = (torch.mm(flat_w, ht) if tb is None else torch.addmm(tb.reshape(-1, 1), flat_w, ht)).view(k, -1, n)
        tb = None
    if t is not None:  # W @ (the k·N tangent rows)ᵀ: [out, k·N] in the rows' order
        rows, by_example = _rows(t)
        prop = torch.mm(w, rows.t())
        prop = prop.view(-1, n, k).permute(2, 0, 1) if by_example else prop.view(-1, k, n).transpose(0, 1)
        nt = prop if nt is None else nt.add_(prop)
    if tb is not None:
        bias = tb.unsqueeze(2)  # [k, out, 1]
        nt = bias.expand(k, tb.shape[1], n) if nt is None else nt + bias
    return out, (None if nt is None else nt.transpose(1, 2))


def _conv(mod: nn.Module, h: Tensor, t: Optional[Tensor], tangents: Dict[int, Tensor], k: int,
          out: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """As :func:`_linear` for a convolution."""
    conv = mod._conv_forward  # type: ignore[operator]  # (input, weight, bias), with the module's settings
    if out is None:
        out = conv(h, mod.weight, mod.bias)
    tw = tangents.get(id(mod.weight))
    tb = tangents.get(id(mod.bias)) if mod.bias is not None else None
    y = None
    if tw is not None:
        if mod.groups == 1:  # the k weight tangents (and bias tangents) as k·out output channels of one convolution
            y = conv(h, tw.flatten(0, 1), None if tb is None else tb.reshape(-1)).unflatten(1, (k, -1)).movedim(1, 0)
            tb = None
        else:  # grouped: concatenated channels would cross the groups
            y = torch.stack([conv(h, w, None) for w in tw])
    if t is None:
        nt = y
    else:
        nt = conv(t.flatten(0, 1), mod.weight, None).unflatten(0, (k, -1))  # a new tensor
        if y is not None:
            nt.add_(y)
    if tb is not None:
        bias = _bias_view(tb, out.dim(), 1)
        nt = bias.expand(k, *out.shape) if nt is None else nt + bias
    return out, nt


def _maxpool(mod: nn.Module, h: Tensor, t: Optional[Tensor], k: int,
             recorded: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """``(output, tangent)`` of a max pooling at ``h``: the tangent at the argmax. ``recorded``: the
    output and argmax the forward computed (then ``h`` is not pooled again)."""
    if recorded is not None:
        out, idx = recorded
        return out, None if t is None else _gather_at(t, idx, 2 if isinstance(mod, nn.MaxPool2d) else 1, k)
    if isinstance(mod, nn.MaxPool2d):
        if h.dim() == 4:  # the same values and indices; on CPU the channels-last kernel is ~3x faster here
            h = h.contiguous(memory_format=torch.channels_last)
        pool = F.max_pool2d_with_indices
    else:
        pool = F.max_pool1d_with_indices
    if t is None:  # no tangent yet: the values alone
        plain = F.max_pool2d if isinstance(mod, nn.MaxPool2d) else F.max_pool1d
        return plain(h, mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.ceil_mode).contiguous(), None
    out, idx = pool(h, mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.ceil_mode)
    out, idx = out.contiguous(), idx.contiguous()
    return out, _gather_at(t, idx, 2 if isinstance(mod, nn.MaxPool2d) else 1, k)


def _gather_at(t: Tensor, idx: Tensor, spatial: int, k: int) -> Tensor:
    """The tangents ``t [k, *in]`` at the argmax ``idx`` (``[*out]``, flat indices into the last
    ``spatial`` dims of each channel, contiguous): ``[k, *out]``."""
    flat_t = t.flatten(-spatial)
    flat_i = idx.flatten(-spatial).expand(k, *idx.shape[:-spatial], -1)
    return flat_t.gather(-1, flat_i).view(k, *idx.shape)


def sequential_forward(model: nn.Sequential, x: Tensor) -> Tensor:
    """``model(x)`` without autograd for a model :func:`supports` accepts, by the same layer code as
    :func:`sequential_jvps` (max pooling by the channels-last kernel: the same values; digits CNN at
    batch 128: ~0.45 ms against ~0.75 ms for the model's own forward). ``x``: [N, ...]."""
    h = x
    with torch.no_grad():
        for mod in model:
            h = _maxpool(mod, h, None, 0)[0] if isinstance(mod, _MAXPOOL) else mod(h)
    return h


def _reads_unchanged(model: nn.Sequential, rec: Activations) -> bool:
    """Whether every recorded tensor :func:`sequential_jvps` reads from ``rec`` holds its recorded
    values: the input of each Linear/convolution (and of a max pooling without a recorded argmax),
    the output of each ReLU/Tanh/Sigmoid, and the model output (the others give only their shape)."""
    reads = {len(model) - 1}
    for i, mod in enumerate(model):
        if isinstance(mod, _PARAMETRIC) or (isinstance(mod, _MAXPOOL) and i not in rec.indices):
            reads.add(i - 1)
        elif isinstance(mod, _ELEMENTWISE):
            reads.add(i)
    return all(rec.unchanged(i) for i in reads)


def sequential_jvps(model: nn.Sequential, x: Tensor, tangents: Dict[int, Tensor],
                    recorded: Optional[Activations] = None) -> Tuple[Tensor, Tensor]:
    """``(f(x), [J v_1, …, J v_k])`` for a model :func:`supports` accepts.

    ``x``: the input [N, ...]; ``tangents``: ``{id(parameter): [k, *parameter.shape]}`` for the
    parameters that move (the others are held fixed, as the generic path does). Returns the
    output [N, ...] and the output tangents [k, N, ...] (zeros when no parameter moves); either may
    be a non-contiguous view (a narrow last ``Linear`` is computed output-major, see the module docstring).
    ``recorded``: the activations of the model's own forward on ``x`` at the current parameters
    (:meth:`torchsso2.optim.sequential_record.ActivationRecorder.usable`); the primal values are
    then taken from it instead of computed (ReLU's tangent masked by its output: ``relu(h) > 0``
    exactly where ``h > 0``), unless a tensor it reads was changed in place since it was recorded."""
    if not tangents:
        raise ValueError("sequential_jvps needs at least one parameter tangent")
    if recorded is not None and (recorded.x is not x or not _reads_unchanged(model, recorded)):
        recorded = None
    k = next(iter(tangents.values())).shape[0]
    h, t = x, None
    last = len(model) - 1
    with torch.no_grad():
        for i, mod in enumerate(model):
            out = None if recorded is None else recorded.outputs[i]
            if isinstance(mod, nn.Linear):
                head = i == last and h.dim() == 2 and mod.out_features < NARROW
                h, t = (_linear_head if head else _linear)(mod, h, t, tangents, k, out)
            elif isinstance(mod, (nn.Conv1d, nn.Conv2d)):
                h, t = _conv(mod, h, t, tangents, k, out)
            elif isinstance(mod, _MAXPOOL):
                idx = None if recorded is None else recorded.indices.get(i)
                h, t = _maxpool(mod, h, t, k, None if out is None or idx is None else (out, idx))
            elif isinstance(mod, nn.ReLU):  # t where h > 0, else 0: relu's backward kernel, one fused op
                h = F.relu(h) if out is None else out
                t = None if t is None else torch.ops.aten.threshold_backward(t, h, 0)
            elif isinstance(mod, nn.Tanh):
                h = torch.tanh(h) if out is None else out
                t = None if t is None else t * (1 - h * h)
            elif isinstance(mod, nn.Sigmoid):
                h = torch.sigmoid(h) if out is None else out
                t = None if t is None else t * (h * (1 - h))
            else:  # linear maps of the activation: pooling by averaging, reshapes
                h_new = mod(h) if out is None else out
                if t is not None:
                    t = mod(t.flatten(0, 1)).unflatten(0, (k, -1)) if isinstance(mod, (nn.AvgPool1d, nn.AvgPool2d)) \
                        else t.reshape(k, *h_new.shape)
                h = h_new
    return h, (torch.zeros(k, *h.shape, dtype=h.dtype, device=h.device) if t is None else t)
