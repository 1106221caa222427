"""Which forward calls of a root module are the model's own, when a wrapper runs one inside another.

A wrapper may run a module's forward inside a call of that same module: PyTorch Lightning's
strategies (DDP, FSDP, DeepSpeed) set the LightningModule's ``forward`` on the instance to a function
that restores the original and runs ``training_step``, then call the wrapper (DDP), which calls the
module; ``training_step`` calls the module again (``self(x)``). The module's forward hooks then fire
twice per batch: first with the model output (the inner call), then with whatever
``training_step`` returned, the loss (the outer call). Only the inner call is the model's forward.

:class:`NestedCalls` tells them apart: ``enter(module)`` in a forward pre-hook, ``leave()`` in the
forward hook, False for a wrapper's call: one that started with a ``forward`` set on the instance
(the redirection) and inside which a call of the module completed. A module calling itself in its
own forward (no ``forward`` on the instance) and calls one after the other (gradient accumulation's
micro-batches) are the model's calls as before.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, List

from torch import nn
from torch.utils.hooks import RemovableHandle

from .hook_marks import LocalHook
from .uses_static import observer_hook


class NestedCalls:
    """Forward calls of one module, tracked through its pre-hook and hook (module docstring)."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        #: one entry per open call, innermost last: [started redirected, a call completed inside it]
        self._open: List[List[bool]] = []

    def enter(self, module: nn.Module) -> None:
        """A call of ``module`` starts (call from its forward pre-hook)."""
        self._open.append(["forward" in module.__dict__, False])

    def leave(self) -> bool:
        """A call ends: False for a wrapper's call (module docstring), True for the model's. A hook that
        saw no start (registered during the call) counts the call as the model's."""
        redirected, had_inner = self._open.pop() if self._open else (False, False)
        if self._open:
            self._open[-1][1] = True
        return not (redirected and had_inner)

    def register(self, module: nn.Module, hook: Callable[[nn.Module, Any, Any], None]) -> List[RemovableHandle]:
        """Register on ``module`` the pre-hook that calls :meth:`enter` and the forward ``hook``,
        called for the model's calls only (not a wrapper's); ``hook``'s marks (``observer_hook``) are
        kept. Returns both handles (the caller removes them)."""
        @functools.wraps(hook)  # copies its __dict__, the observer mark with it
        def model_calls_only(mod: nn.Module, inputs: Any, output: Any) -> None:
            if self.leave():
                hook(mod, inputs, output)
        return [module.register_forward_pre_hook(LocalHook(observer_hook(lambda mod, _args: self.enter(mod)))),
                module.register_forward_hook(LocalHook(model_calls_only))]
