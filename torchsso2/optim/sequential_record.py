"""The activations of a plain ``nn.Sequential``'s own forward, kept for the hand-written J·v pass.

The adaptive step (:mod:`torchsso2.optim.adaptive`) takes ``J vᵢ`` at the parameters and on the
input of the closure's forward. :func:`torchsso2.optim.sequential_jvp.sequential_jvps` runs the
forward again for the primal values it needs: the input of every Linear/convolution (for the
weight-tangent terms), the output of every ReLU/Tanh/Sigmoid (their derivative), the argmax of
every max pooling and the model output. The closure's forward has computed all of them already.
:class:`ActivationRecorder` keeps them: an observer forward hook on every child records its
output (and ``_version``), and a max pooling's argmax as its autograd node saved it (the indices
``max_pool2d_with_indices`` returned; only for a 2-d max pooling run with grad, else the pass
pools again). Digits CNN at batch 128 (one thread): the pass without its forward, ~0.4 ms less.

Nothing is taken that the forward could have changed since: a recorded tensor is used only when
its ``_version`` is the one it had when recorded (an in-place op after the layer, as
``nn.ReLU(inplace=True)`` after a ``Tanh``, bumps it), the model's parameters are the tensors of
the forward (none replaced) with the versions they had then (no in-place update in between), and
every tensor has the input's dtype and device, which the parameters have too (not the
lower-precision activations of an autocast forward, which the pass would compute in full
precision). Otherwise :meth:`ActivationRecorder.usable` gives None and the pass computes the
forward itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from curvature.hook_marks import LocalHook
from curvature.uses_static import observer_hook

#: the autograd node of ``F.max_pool2d`` run with grad, and where it keeps the argmax (``result1``
#: of ``max_pool2d_with_indices``); read only if both are as expected, else the pass pools again
_MAXPOOL_NODE = "MaxPool2DWithIndicesBackward0"
_MAXPOOL_INDICES = "_saved_result1"


@dataclass
class Activations:
    """One forward of the model: its input ``x`` and every child's output (``outputs[i]`` of
    ``model[i]``, shape as the child returned it), the ``_version`` of each at recording time,
    the max-pool argmax by child index (``[N, C, H_out, W_out]`` int64, flat indices into each
    channel's ``H·W``) and the parameters' versions at the forward."""

    x: Tensor
    x_version: int
    param_versions: Tuple[int, ...]
    #: the parameters whose versions ``param_versions`` holds (:func:`pass_params` at the forward)
    params: Tuple[Tensor, ...] = ()
    outputs: List[Tensor] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    indices: Dict[int, Tensor] = field(default_factory=dict)
    #: a child returned something other than a tensor: nothing usable from this call
    broken: bool = False

    def unchanged(self, i: int) -> bool:
        """Whether child ``i``'s output (``i = -1``: the input) still holds the recorded values."""
        if i < 0:
            return self.x._version == self.x_version
        return self.outputs[i]._version == self.versions[i]


def _maxpool_indices(output: Tensor) -> Optional[Tensor]:
    """The argmax ``F.max_pool2d`` saved for its backward, or None (run without grad, another node)."""
    node = output.grad_fn
    if node is None or type(node).__name__ != _MAXPOOL_NODE:
        return None
    idx = getattr(node, _MAXPOOL_INDICES, None)
    if not isinstance(idx, Tensor) or idx.dtype != torch.int64 or idx.shape != output.shape:
        return None
    return idx


def pass_params(model: nn.Module) -> Tuple[Tensor, ...]:
    """The parameters the J·v pass reads of a model it supports: each child's own (``weight``,
    ``bias``; the supported layers have no submodules and read nothing else), in child order. A
    walk of the children's parameter dicts, ~1 µs against ~5 µs for ``tuple(model.parameters())``
    (its generic module traversal); a layer listed twice gives its parameters twice."""
    return tuple(p for child in model._modules.values() if child is not None
                 for p in child._parameters.values() if p is not None)


class ActivationRecorder:
    """Records :class:`Activations` of every forward of a plain ``nn.Sequential`` while attached.

    :meth:`start` (from the caller's forward pre-hook on the model) opens the record of a call; the
    observer hooks on the children fill it. ``records[i]`` belongs to the model's ``i``-th call."""

    def __init__(self) -> None:
        self.records: List[Optional[Activations]] = []
        self._current: Optional[Activations] = None

    def attach(self, model: nn.Sequential) -> List[Any]:
        """Register the children's hooks; returns their handles (the caller removes them)."""
        self.records = []
        self._current = None
        pools = (nn.MaxPool2d,)

        def hook(module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
            rec = self._current
            if rec is None:
                return
            if not isinstance(output, Tensor):
                self._current = None  # not a layer the pass supports: nothing usable from this call
                rec.broken = True
                return
            if isinstance(module, pools):
                idx = _maxpool_indices(output)
                if idx is not None:
                    rec.indices[len(rec.outputs)] = idx
            rec.outputs.append(output)
            rec.versions.append(output._version)

        return [child.register_forward_hook(LocalHook(observer_hook(hook))) for child in model]

    def skip(self) -> None:
        """A forward of the model that is not recorded (under ``torch.no_grad``) begins: its children's
        outputs go to no record."""
        self._current = None

    def start(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Activations]:
        """A forward of ``model`` begins (``args``, ``kwargs`` its arguments): the record its children's
        outputs go to (None: a call the pass cannot use). The caller appends it to :attr:`records` when
        the forward completes, so ``records[i]`` is the ``i``-th completed forward's."""
        if len(args) != 1 or kwargs or not isinstance(args[0], Tensor):
            self._current = None
        else:
            params = pass_params(model)
            self._current = Activations(args[0], args[0]._version, tuple(p._version for p in params), params)
        return self._current

    def usable(self, model: nn.Sequential, call: int) -> Optional[Activations]:
        """The record of the ``call``-th forward where the J·v pass may take its values from it:
        complete, the parameters unchanged since, every tensor of the input's dtype and device
        (the parameters' too); else None. Which recorded tensors the pass reads, and that those
        are unchanged, is :func:`torchsso2.optim.sequential_jvp.sequential_jvps`'s to check."""
        if call >= len(self.records):
            return None
        rec = self.records[call]
        if rec is None or rec.broken or len(rec.outputs) != len(model):
            return None
        params = pass_params(model)  # the same tensors, none written in place since the forward
        if len(params) != len(rec.params) or any(p is not q for p, q in zip(params, rec.params)) \
                or tuple(p._version for p in params) != rec.param_versions:
            return None
        dtype, device = rec.x.dtype, rec.x.device
        if any(p.dtype != dtype or p.device != device for p in params) \
                or any(o.dtype != dtype or o.device != device for o in rec.outputs):
            return None
        return rec
