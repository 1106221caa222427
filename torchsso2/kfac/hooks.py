"""The preconditioner's module hooks, which do not keep it alive.

The forward hook registered on each layer holds only a weak reference to the preconditioner,
and a :func:`weakref.finalize` removes the hooks when the preconditioner is garbage-collected:
dropping a ``KFACPreconditioner`` without :meth:`~KFACPreconditioner.remove_hooks` leaves the
model as it was before it (no hook, no cost in forward/backward). The tensor hook a forward
registers on a layer output for the backward pass holds a weak reference too. A deep copy (or a
pickle) of the model taken while the hooks are attached carries a hook that does nothing in their
place (:class:`curvature.hook_marks.LocalHook`): the copy's forwards leave the preconditioner alone,
and the copy can be saved whole.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Sequence, Tuple

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from curvature.hook_marks import OWNER_MARK, LocalHook
from curvature.uses_static import observer_hook

__all__ = ["attach_forward_hooks", "weak_grad_hook"]


def _remove(handles: List[RemovableHandle]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def attach_forward_hooks(owner: Any, modules: Sequence[nn.Module], method: str) -> List[RemovableHandle]:
    """Register ``owner.<method>(module, inputs, output)`` as a forward hook of every module (what it
    returns replaces the module's output, as a forward hook's return value does).

    Returns the handles (a list the owner keeps; removing and clearing it detaches the hooks).
    When ``owner`` is garbage-collected the hooks are removed.
    """
    ref = weakref.ref(owner)
    # copy.deepcopy(model) copies the hooks: a copy's forwards call this same function, and are ignored
    registered = weakref.WeakSet(modules)

    def hook(module: nn.Module, inputs: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> Any:
        target = ref()
        if target is not None and module in registered:  # a layer called as lin(input=x) passes it in kwargs
            return getattr(target, method)(module, inputs if inputs else tuple(kwargs.values()), output)
        return None

    setattr(hook, OWNER_MARK, ref)  # (curvature.hook_marks.attached_owners)
    # it records, and computes nothing from the parameters (a view output comes back as a clone of the same
    # values): an observer to plain_module, so a native optimizer's hand-written J·v pass and its static check
    # of where parameters are used stay as without it (its passes are hidden from the preconditioner anyway)
    observer_hook(hook)
    # first among the module's forward hooks: G is the gradient of the layer's own output, not of what a
    # user's hook registered earlier (in the model's __init__) makes of it (kfac_pytorch's hook runs last)
    handles = [m.register_forward_hook(LocalHook(hook), with_kwargs=True, prepend=True) for m in modules]
    weakref.finalize(owner, _remove, handles)
    return handles


def weak_grad_hook(owner: Any, method: str, *args: Any) -> Callable[[Tensor], None]:
    """``grad -> owner.<method>(*args, grad)`` through a weak reference to ``owner``."""
    ref = weakref.ref(owner)

    def hook(grad: Tensor) -> None:
        target = ref()
        if target is not None:
            getattr(target, method)(*args, grad)

    return hook
