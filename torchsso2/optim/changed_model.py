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
from torch import nn

from curvature.sharded import sharded_since, sharding_of
from torchsso2.distributed.faults import CollectiveTimeoutError

from .skips import NonFiniteError
from .misuse import NO_BACKWARD

__all__ = ["explains_changed_model", "sharded_failure"]

F = TypeVar("F", bound=Callable[..., Any])

#: errors a training loop catches by their type (a batch-size finder, an iterator, the non-finite policy, a
#: lost rank): never re-labelled
PASS_THROUGH = (MemoryError, torch.OutOfMemoryError, StopIteration, NonFiniteError, CollectiveTimeoutError)


def _failure(err: BaseException, who: str, how: str) -> ValueError:
    return ValueError(f"{who}.step failed ({type(err).__name__}) because {how}")


def sharded_failure(err: BaseException, model: Optional[nn.Module], who: str) -> Optional[ValueError]:
    """The ``ValueError`` to raise instead of ``err``, a step's error, when ``model`` is sharded now (None:
    raise ``err``): not for an error a loop catches by type (:data:`PASS_THROUGH`), nor for one that says
    so already."""
    if not isinstance(err, Exception) or isinstance(err, PASS_THROUGH) or model is None \
            or "is sharded across processes now" in str(err):
        return None
    how = sharding_of(model)
    return None if how is None else _failure(err, who, sharded_since(how, who))


def _replaced_failure(opt: Any, err: BaseException) -> Optional[ValueError]:
    """Behind "the closure did not call backward()": the ``ValueError`` naming the param groups' parameters that
    were the model's at construction and are not any more (None: none)."""
    if not (isinstance(err, RuntimeError) and NO_BACKWARD in str(err)):
        return None
    born = opt.__dict__.get("_params_in_model", set())
    own = {id(p) for p in opt.model.parameters()}
    gone = [p for g in opt.param_groups for p in g["params"] if id(p) in born and id(p) not in own]
    if not gone:
        return None
    who = type(opt).__name__
    return _failure(err, who, f"{len(gone)} of the parameters {who} was built with are no longer the model's "
                    f"(shapes {[tuple(p.shape) for p in gone[:4]]}{' ...' if len(gone) > 4 else ''}): they were "
                    "replaced after it was built (load_state_dict(..., assign=True), model.to_empty(...), a "
                    "wrapper or a layer swap that re-creates parameters), so the optimizer holds parameters the "
                    "model no longer uses. Build the optimizer after loading, materializing or wrapping the model")


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
            try:  # (the diagnosis must never hide the original error)
                failure = sharded_failure(err, self.model, type(self).__name__) or _replaced_failure(self, err)
            except Exception:
                failure = None
            if failure is None:
                raise
            raise failure from err
    return wrapper  # type: ignore[return-value]
