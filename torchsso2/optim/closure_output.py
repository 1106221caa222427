"""A closure's model output when the closure returns the loss alone (torch.optim's convention).

A closure passed to ``step`` returns ``(loss, output)`` or, as torch.optim's closures do, the loss
alone; ``step`` then returns what the closure returned (the loss, or ``(loss, output)``). The
curvature never needs the returned output: it is captured from the model's forward while the
closure runs. Two uses read the output itself: ``VIOptimizer``'s learned noise variance
(``noise_variance="learned"``: the residuals of each sample) and its check at the first step that the
output is a tensor or selects one (``output_selector``); ``SecondOrderOptimizer``'s adaptive mode
compares the closure's loss with the mean negative log-likelihood of the output; and the
empty-batch check of steps that estimate no curvature reads its shape. For a closure that returns
the loss alone, a forward hook on the model (:class:`OutputTap`) records the output of the closure's
first forward to complete with gradients enabled, the forward the loss of an ordinary closure comes
from, and the closure is read as if it had returned that output too. The hook is registered at the
first call and wherever the previous call returned the loss alone (a loop calls one closure, so its
form at one step is its form at the next); a closure returning the pair pays no hook after the first
call. A closure that changes form between steps gets no output at its first loss-alone call: the
adaptive mode then calls it again for the LM rule, and the learned noise variance is a ValueError
saying to return ``(loss, output)``.

A closure returning ``None`` is a TypeError, PyTorch Lightning's closure for a ``training_step``
that returns ``None`` to skip a batch included: a step that is taken on some ranks and skipped on
others would pair the ranks' collectives with other steps', and Lightning itself does not support
that skip on several devices.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from curvature.hook_marks import LocalHook
from curvature.uses_static import observer_hook

from .validation import unpack_closure_result


class OutputTap:
    """Records the output of ``model``'s first forward with gradients enabled while the ``with`` block
    runs. The first to complete: where a wrapper's call of the module runs the model's call inside it
    (:mod:`curvature.root_calls`), the model's completes first, so no pre-hook is needed on this path,
    which runs at every step of a closure returning the loss alone. (For a module calling itself in its
    own forward, for its body, that is the body's output.)"""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.output: Any = None
        self._handle: Optional[RemovableHandle] = None

    def __enter__(self) -> "OutputTap":
        self._handle = self.model.register_forward_hook(LocalHook(observer_hook(lambda m, i, o: self._record(m, i, o))))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _record(self, _module: nn.Module, _inputs: Any, output: Any) -> None:
        # a no-grad forward in the closure (a metric) is not the loss's
        if self.output is None and torch.is_grad_enabled():
            self.output = output


def call_closure(closure: Callable[[], Any], model: nn.Module, tap_output: bool) -> Tuple[Any, Any, bool]:
    """Call ``closure`` (in the grad mode the caller set): ``(loss, output, loss_only)``, as
    :func:`~torchsso2.optim.validation.unpack_closure_result`; with ``tap_output``, a closure that
    returned the loss alone gets the output of its first forward of ``model`` to complete (None if it
    ran none)."""
    if not tap_output:
        return unpack_closure_result(closure())
    with OutputTap(model) as tap:
        result = closure()
    loss, output, loss_only = unpack_closure_result(result)
    return loss, (tap.output if loss_only else output), loss_only
