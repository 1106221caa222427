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

from typing import Any, Dict, List, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["DDPSync", "fingerprint"]


def _active_ddp() -> Optional[nn.Module]:
    """The ``DistributedDataParallel`` whose forward is running, or None (also on a torch without the API)."""
    get = getattr(nn.parallel.DistributedDataParallel, "_get_active_ddp_module", None)
    return get() if get is not None else None


class DDPSync:
    """Per step: whether every closure call ran the model inside a DDP wrapper that averages its
    gradients over all ``world_size`` ranks (:attr:`synced`; None before any call this step)."""

    def __init__(self, model: nn.Module, world_size: int) -> None:
        self.model = model
        self.world_size = world_size
        #: this step's verdict over its closure calls (read and reset by :meth:`take`)
        self.synced: Optional[bool] = None
        self._call: Optional[bool] = None
        self._owners: Dict[int, bool] = {}  # id(DDP wrapper) -> whether it averages our model's gradients

    def take(self) -> bool:
        """This step's verdict (False without any watched call), and a fresh start for the next step."""
        synced, self.synced = bool(self.synced), None
        return synced

    def watch(self) -> RemovableHandle:
        """Register the pre-hook for one closure call (the caller removes it, then calls :meth:`end_call`)."""
        self._call = None
        return self.model.register_forward_pre_hook(self._pre)

    def end_call(self) -> None:
        seen = bool(self._call)
        self.synced = seen if self.synced is None else (self.synced and seen)

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self._call is not None or not torch.is_grad_enabled():
            return
        ddp = _active_ddp()
        self._call = ddp is not None and bool(getattr(ddp, "require_backward_grad_sync", False)) and self._owns(ddp)

    def _owns(self, ddp: nn.Module) -> bool:
        """Whether ``ddp`` wraps the model (it or a module containing it) over ``world_size`` processes."""
        key = id(ddp)
        if key not in self._owners:
            inner = getattr(ddp, "module", None)
            group = getattr(ddp, "process_group", None)
            size = group.size() if group is not None and hasattr(group, "size") else None
            self._owners[key] = isinstance(inner, nn.Module) and size == self.world_size \
                and any(m is self.model for m in inner.modules())
        return self._owners[key]


def fingerprint(grads: List[Tensor]) -> Tensor:
    """A number that equal gradient lists give equally on every rank: ``Σ_i (i + 1)·‖g_i‖₂ + count``
    (0-dim float64 on the first gradient's device; different gradients give different numbers but
    for a coincidence of every norm). Non-finite gradients give a non-finite number, which compares
    unequal (NaN) or equal (inf) as the values would."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    dev = grads[0].device
    norms = torch.stack([n.to(device=dev, dtype=torch.float64) for n in torch._foreach_norm(grads)])
    return norms @ torch.arange(1, len(grads) + 1, dtype=torch.float64, device=dev) + len(grads)
