"""Which forward calls of a root module are the model's own, when one call runs inside another.

A wrapper may run a module's forward inside a call of that same module: PyTorch Lightning's
strategies (DDP, FSDP, DeepSpeed) patch the LightningModule's ``forward`` to run ``training_step``
and call the wrapper, and ``training_step`` calls the module again (``self(x)``). The module's
forward hooks then fire twice per batch: first with the model output (the inner call), then with
whatever ``training_step`` returned, the loss (the outer call). Only the innermost calls are the
model's forwards; an outer call inside which a call of the same module completed is a wrapper, and
its inputs and output are not the model's.

:class:`NestedCalls` tells them apart: ``enter()`` in a forward pre-hook, ``leave()`` in the
forward hook, True for a call of the model's own (no call of the module completed inside it).
Calls one after the other (gradient accumulation's micro-batches) are each the model's.
"""
from __future__ import annotations

from typing import Any, List


class NestedCalls:
    """Forward calls of one module, tracked through its pre-hook and hook (module docstring)."""

    __slots__ = ("_inner",)

    def __init__(self) -> None:
        #: one entry per open call, innermost last: whether a call completed inside it
        self._inner: List[bool] = []

    def enter(self, *_args: Any) -> None:
        """A call starts (call from a forward pre-hook; returns None, so the hook changes nothing)."""
        self._inner.append(False)

    def leave(self) -> bool:
        """A call ends: True if it is the model's own (no call of the module completed inside it).
        A hook that saw no start (registered during the call) counts the call as the model's."""
        had_inner = self._inner.pop() if self._inner else False
        if self._inner:
            self._inner[-1] = True
        return not had_inner
