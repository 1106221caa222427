"""Whether a step's gradients were already averaged by a ``DistributedDataParallel`` wrapper.

An optimizer built on the bare model averages the gradients over the ranks itself (one all-reduce
of every gradient per step). When the model runs inside a ``DistributedDataParallel`` wrapper
anyway (``model = DDP(model)`` after building the optimizer on it, PyTorch Lightning's DDP
strategies, accelerate), DDP has averaged them already in the backward, and the optimizer's
all-reduce of equal values is a second, redundant one.

:class:`DDPSync` watches each closure call: a forward pre-hook on the model reads which DDP
wrapper is running (``DistributedDataParallel._get_active_ddp_module()``, set during its forward)
at the model's first call with gradients enabled, and whether that wrapper holds the model, syncs
this backward (``require_backward_grad_sync``: not under ``no_sync()``) and spans as many processes
as the optimizer's communicator. Only then may the step skip its gradient all-reduce, and only
after a check: :func:`fingerprint` of every rank's gradients rides in the step's small flag
all-reduce (one slot per rank), and the gradients' all-reduce is skipped only if every rank's
fingerprint is the same (else it runs as before). So a closure that bypassed the wrapper, a
backward DDP did not sync, or anything else that leaves the ranks with different gradients falls
back to the averaging; equal gradients averaged again would only be themselves.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from curvature.eager import eager

from curvature.hook_marks import LocalHook

__all__ = ["DDPSync", "fingerprint"]


def _active_ddp() -> Optional[nn.Module]:
    """The ``DistributedDataParallel`` whose forward is running, or None (also on a torch without the API)."""
    get = getattr(nn.parallel.DistributedDataParallel, "_get_active_ddp_module", None)
    return get() if get is not None else None


class DDPSync:
    """Per step: whether every closure call ran the model inside a DDP wrapper that averages its
    gradients over all ``world_size`` ranks (:attr:`synced`; None before any call this step)."""

    def __init__(self, model: nn.Module, world_size: int, recheck_on_change_only: bool = False) -> None:
        self.model = model
        self.world_size = world_size
        #: an optimizer built on the DDP wrapper: the fingerprints are compared at the first step and again
        #: whenever the set of parameters with gradients changes (what DDP syncs is fixed when it is built;
        #: a parameter it does not hold shows up as a new member of that set), not at every step
        self.recheck_on_change_only = recheck_on_change_only
        self._verified: Optional[Tuple[int, ...]] = None
        #: this step's verdict over its closure calls (read and reset by :meth:`take`)
        self.synced: Optional[bool] = None
        self._call: Optional[bool] = None
        #: the process groups (their global ranks; None where torch cannot say) of the DDP wrappers that hold the
        #: model and synced a forward with gradients of the current closure call, over more than one process
        #: (reset by :meth:`watch`): some of the call's gradients were averaged over those ranks (VIOptimizer's
        #: sample groups refuse an average across groups)
        self.call_averaged: List[Optional[Tuple[int, ...]]] = []
        #: id(DDP wrapper) -> (whether it holds our model, its process group's size, and global ranks)
        self._owners: Dict[int, Tuple[bool, Optional[int], Optional[Tuple[int, ...]]]] = {}
        #: the fixed random vectors of :func:`fingerprint`, by length and device
        self.projection = _Projection()

    def trusts(self, signature: Tuple[int, ...]) -> bool:
        """Whether this step may skip the fingerprint: built on the wrapper, with the same parameters
        having gradients (``signature``: their ids) as at the last step whose fingerprints agreed."""
        return self.recheck_on_change_only and signature == self._verified

    def verified(self, signature: Tuple[int, ...]) -> None:
        """Every rank's fingerprint agreed (or was trusted) for these parameters."""
        self._verified = signature

    def take(self) -> bool:
        """This step's verdict (False without any watched call), and a fresh start for the next step."""
        synced, self.synced = bool(self.synced), None
        return synced

    def begin_step(self) -> None:
        """A step begins: no verdict yet (one left by a step that ended early, e.g. a closure that raised on
        this rank only, must not decide this one: the ranks would take different collectives)."""
        self.synced = None

    def watch(self) -> RemovableHandle:
        """Register the pre-hook for one closure call (the caller removes it, then calls :meth:`end_call`)."""
        self._call = None
        self.call_averaged = []
        return self.model.register_forward_pre_hook(LocalHook(self._pre))

    def end_call(self, completed: bool = True) -> None:
        """One closure call ended (``completed``: it returned; a call that raised leaves no verdict)."""
        seen = bool(self._call) and completed
        self.synced = seen if self.synced is None else (self.synced and seen)

    @eager  # torch.compiler.disable, lazily (curvature/eager.py)
    def _pre(self, module: nn.Module, args: Any) -> None:
        # every call with gradients counts: a second pass of the bare model in the same closure (outside the
        # wrapper) adds gradients DDP never averaged (the nested calls of a wrapper's redirect are inside it)
        if not torch.is_grad_enabled():
            return
        ddp = _active_ddp()
        holds, size, ranks = self._owns(ddp) if ddp is not None and getattr(ddp, "require_backward_grad_sync", False) \
            else (False, None, None)
        synced = holds and size == self.world_size
        self._call = synced if self._call is None else (self._call and synced)
        if holds and size != 1:
            self.call_averaged.append(ranks)

    def _owns(self, ddp: nn.Module) -> Tuple[bool, Optional[int], Optional[Tuple[int, ...]]]:
        """Whether ``ddp`` wraps the model (it or a module containing it), over how many processes, and which
        (global ranks; None where torch cannot say)."""
        key = id(ddp)
        if key not in self._owners:
            inner = getattr(ddp, "module", None)
            group = getattr(ddp, "process_group", None)
            size = group.size() if group is not None and hasattr(group, "size") else None
            try:
                ranks: Optional[Tuple[int, ...]] = tuple(torch.distributed.get_process_group_ranks(group))
            except Exception:  # (no such API, or not a torch.distributed group)
                ranks = None
            holds = isinstance(inner, nn.Module) and any(m is self.model for m in inner.modules())
            self._owners[key] = (holds, size, ranks)
        return self._owners[key]


#: the block length of the fingerprint's projection (a fixed random vector of this length is reused)
_BLOCK = 1024


class _Projection:
    """Fixed pseudo-random float64 vectors (seeded, the same on every rank), by length and device."""

    def __init__(self) -> None:
        self._vectors: Dict[Tuple[int, int, str], Tensor] = {}

    def vector(self, which: int, length: int, device: torch.device) -> Tensor:
        key = (which, length, str(device))
        if key not in self._vectors:
            g = torch.Generator().manual_seed(0x5EED + 7919 * which + length)
            self._vectors[key] = torch.randn(length, generator=g, dtype=torch.float64).to(device)
        return self._vectors[key]


def fingerprint(grads: List[Tensor], projection: _Projection) -> Tensor:
    """A number that equal gradient lists give equally on every rank, and different ones (almost
    surely) not: a fixed random projection of all the gradients' entries in float64 (each
    gradient cut into rows of :data:`_BLOCK` entries, each row projected on one random vector and the
    rows' results on another, each gradient weighted by its position), plus the count. A sign flip,
    a permutation or any change of an entry larger than ~1e-13 of the gradients' norm moves it. 0-dim
    float64 on the first gradient's device; non-finite gradients give a non-finite number (NaN compares
    unequal, so the gradients are averaged and the non-finite policy sees them). ``projection``: the
    random vectors (:attr:`DDPSync.projection`, the same on every rank)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    dev = grads[0].device
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for i, g in enumerate(grads):
        flat = g.detach().reshape(-1).to(device=dev, dtype=torch.float64)
        rows, rest = divmod(flat.numel(), _BLOCK)
        part = torch.zeros((), dtype=torch.float64, device=dev)
        if rows:
            per_row = flat[:rows * _BLOCK].view(rows, _BLOCK) @ projection.vector(0, _BLOCK, dev)
            part = part + per_row @ projection.vector(1, rows, dev)
        if rest:
            part = part + flat[rows * _BLOCK:] @ projection.vector(2, rest, dev)
        total = total + (i + 1) * part
    return total + len(grads)
