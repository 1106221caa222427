"""A step that fails on a model changed under its optimizer: say so, instead of torch's or a misleading error.

A model sharded after the optimizer was built (FSDP, ``fully_shard``, tensor parallelism) or whose
parameters were replaced (``load_state_dict(..., assign=True)``, ``to_empty()``, a wrapper that
re-creates them) makes the step fail far from the cause: "the closure did not call backward()" (the
optimizer's parameters get no gradient), "got mixed torch.Tensor and DTensor" inside torch, or a
reparametrization message. Only when the step raises, :func:`explains_changed_model` looks at the
model: sharded now (:func:`curvature.sharded.sharding_of`), or, behind "the closure did not call
backward()", parameters of the param groups that were the model's at construction and are not any
more. Then the step raises a ``ValueError`` that names it and the fix (build the optimizer after
changing the model), chained to the original error. A step that succeeds costs nothing.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, TypeVar

import torch

from curvature.sharded import sharded_since, sharding_of
from torchsso2.distributed.faults import CollectiveTimeoutError

from .skips import NonFiniteError
from .misuse import NO_BACKWARD

__all__ = ["explains_changed_model", "model_change"]

F = TypeVar("F", bound=Callable[..., Any])

#: errors a training loop catches by their type (a batch-size finder, an iterator, the non-finite policy, a
#: lost rank): never re-labelled
PASS_THROUGH = (MemoryError, torch.OutOfMemoryError, StopIteration, NonFiniteError, CollectiveTimeoutError)


def model_change(opt: Any, replaced: bool = True) -> Optional[str]:
    """How ``opt``'s model changed since ``opt`` was built in a way its step cannot follow, in words, or None
    (``replaced=False``: only whether it is sharded now)."""
    model = getattr(opt, "model", None)
    if model is None:
        return None
    how = sharding_of(model)
    if how is not None:
        return sharded_since(how, type(opt).__name__)
    if not replaced:
        return None
    born = opt.__dict__.get("_params_in_model", set())
    own = {id(p) for p in model.parameters()}
    gone = [p for g in opt.param_groups for p in g["params"] if id(p) in born and id(p) not in own]
    if gone:
        return (f"{len(gone)} of the parameters {type(opt).__name__} was built with are no longer the model's "
                f"(shapes {[tuple(p.shape) for p in gone[:4]]}{' ...' if len(gone) > 4 else ''}): they were replaced "
                "after it was built (load_state_dict(..., assign=True), model.to_empty(...), a wrapper or a "
                "layer swap that re-creates parameters), so the optimizer holds parameters the model no longer "
                "uses. Build the optimizer after loading, materializing or wrapping the model")
    return None


def explains_changed_model(step: F) -> F:
    """Decorate an optimizer's ``step``: an error it raises on a model changed as described in the module
    docstring becomes a ``ValueError`` naming the change, the original chained. Only the symptoms of such a
    change are re-labelled: on a model sharded now, any error but those a training loop handles by type
    (:data:`PASS_THROUGH`: out of memory, ``StopIteration``, a non-finite step, a collective timeout); with
    parameters replaced, only the library's "the closure did not call backward()" (the optimizer's
    parameters got no gradient)."""
    @functools.wraps(step)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return step(self, *args, **kwargs)
        except Exception as err:
            if isinstance(err, PASS_THROUGH):
                raise
            try:  # (the diagnosis must never hide the original error)
                how = model_change(self, replaced=isinstance(err, RuntimeError) and NO_BACKWARD in str(err))
            except Exception:
                how = None
            if how is None:
                raise
            raise ValueError(f"{type(self).__name__}.step failed ({type(err).__name__}) because {how}") from err
    return wrapper  # type: ignore[return-value]
