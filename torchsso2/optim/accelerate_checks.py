"""Hugging Face ``accelerate``'s gradient accumulation, seen from the optimizers (without importing it).

``Accelerator(gradient_accumulation_steps=k)`` wraps the optimizer so that ``step()`` does nothing on
k − 1 of every k batches and divides each loss by k in ``accelerator.backward``. A closure-based
step (:class:`~torchsso2.SecondOrderOptimizer`, :class:`~torchsso2.VIOptimizer`) then never runs
the skipped batches at all (their closure is not called) and takes a 1/k-scaled gradient: a
UserWarning at the first step names the recipe (accumulate inside the closure). A
:class:`~torchsso2.kfac.KFACPreconditioner` stepped on every micro-batch (before the wrapper's
no-op ``step()``) preconditions a partial gradient that the next backward adds to: a UserWarning
names the ``accelerator.sync_gradients`` guard. Read from accelerate's ``GradientState`` only when
accelerate is already imported and an ``Accelerator`` exists; that state is process-wide (an Accelerator
made for another model, a notebook cell stopped mid-accumulation leave it set), so the optimizers' warning
needs the step to come from accelerate's ``AcceleratedOptimizer.step``, and the preconditioner's an
accumulation of more than one batch.
"""
from __future__ import annotations

import sys
import warnings
from types import FrameType
from typing import Any, Optional

from curvature.stacklevel import caller_stacklevel


__all__ = ["warn_if_accelerate_accumulates", "warn_if_not_sync_step"]


def _gradient_state() -> Optional[Any]:
    """accelerate's ``GradientState`` singleton when an Accelerator set it up, else None."""
    module = sys.modules.get("accelerate.state")
    cls = getattr(module, "GradientState", None) if module is not None else None
    if cls is None or not getattr(cls, "_shared_state", None):
        return None
    try:
        return cls()
    except Exception:  # another accelerate version: nothing to say
        return None


def _called_by_accelerate() -> bool:
    """Whether an ``accelerate.optimizer`` frame (``AcceleratedOptimizer.step``) is among the callers, at any
    depth (a wrapper optimizer may sit between it and ours; this runs once, at the first step)."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "accelerate.optimizer":
            return True
        frame = frame.f_back
    return False


def warn_if_accelerate_accumulates(face: str) -> None:
    """UserWarning when accelerate's optimizer wrapper calls the step and accumulates gradients over k > 1
    batches (call at the first step)."""
    if "accelerate.optimizer" not in sys.modules or not _called_by_accelerate():
        return
    state = _gradient_state()
    steps = getattr(state, "num_steps", 1) if state is not None else 1
    if isinstance(steps, int) and steps > 1:
        warnings.warn(
            f"{face} under accelerate's gradient accumulation (gradient_accumulation_steps={steps}): inside "
            f"accelerator.accumulate(), accelerate skips step() on {steps - 1} of every {steps} batches, so their "
            f"closure never runs (those batches are not trained on), and accelerator.backward divides each loss by "
            f"{steps} (outside it too). Build the Accelerator without "
            "gradient_accumulation_steps and run the micro-batches inside the closure (each loss weighted by its "
            "share of the batch; docs/guide.md, 'Hugging Face accelerate and Trainer')",
            UserWarning, stacklevel=caller_stacklevel())


def warn_if_not_sync_step() -> bool:
    """UserWarning (returns True) when ``KFACPreconditioner.step()`` runs on a micro-batch on which accelerate
    does not synchronize (and will not step the optimizer)."""
    state = _gradient_state()
    if state is None or getattr(state, "sync_gradients", True) is not False:
        return False
    steps = getattr(state, "num_steps", 1)  # (a stale False after a stopped loop: a new Accelerator resets this)
    if not isinstance(steps, int) or steps <= 1:
        return False
    warnings.warn(
        "KFACPreconditioner.step() on a micro-batch of accelerate's gradient accumulation that does not step the "
        "optimizer (accelerator.sync_gradients is False): it preconditions the partial gradient in place, and the "
        "next backward adds raw gradient to it. Guard it with `if accelerator.sync_gradients: precond.step()` and "
        "build the preconditioner with accumulation_steps=gradient_accumulation_steps",
        UserWarning, stacklevel=caller_stacklevel())
    return True
