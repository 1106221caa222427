"""The marks on the hooks this library registers on modules, and the wrapper that keeps them off copies.

:meth:`curvature.capture.Capture.foreign_hooks` tells a user's hooks from the captures' own by the
capture mark (several captures may be active at once: the optimizer's and the low-rank solver's
recorder); a lasting hook (a ``KFACPreconditioner``'s) carries a weak reference to its owner, so a
new optimizer sees one still attached (:func:`warn_if_attached`), and the curvature's own passes are hidden
from it (:func:`register_owner`, :class:`HiddenPasses`). :class:`LocalHook` gives a copy or a pickle of a
module a hook that does nothing in place of ours.
"""
from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from typing import AbstractSet, Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional, Set, Tuple, TypeVar

import torch
from torch import nn

from .stacklevel import caller_stacklevel

#: the attribute set on a capture's hook functions
CAPTURE_HOOK = "_curvature_capture_hook"
#: the attribute holding a weak reference to the owner of a lasting hook (a KFACPreconditioner's)
OWNER_MARK = "_curvature_hook_owner"
#: the owner's count of the :class:`HiddenPasses` contexts open on it: its hooks ignore what runs then
HIDDEN_PASSES = "_hidden_passes"
#: the live owners of lasting hooks (:func:`register_owner`), held weakly: the one registry of this package,
#: so that the curvature's own passes are hidden from them (:class:`HiddenPasses`) at no cost where there
#: are none, and without a walk over the model's modules at every curvature step (~1% of a step on small
#: models: docs/architecture.md)
_LIVE_OWNERS: "weakref.WeakSet[Any]" = weakref.WeakSet()

F = TypeVar("F", bound=Callable[..., Any])


def capture_hook(fn: F) -> F:
    """Mark ``fn`` as a capture's hook; returns it."""
    setattr(fn, CAPTURE_HOOK, True)
    return fn


def in_func_transform() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``: per-sample gradients of
    ``functional_call(model, ...)`` in a closure, for logging) is running: a forward inside one is not
    the batch's forward, and its tensors live only inside the transform, so the hooks leave it alone.
    False while torch.compile traces (its tracing runs under an interpreter of its own)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None


def is_owned(fn: Any) -> bool:
    """Whether ``fn`` is a lasting hook of an owner (a ``KFACPreconditioner``'s, marked with :data:`OWNER_MARK`)."""
    return getattr(fn, OWNER_MARK, None) is not None


def is_marked(fn: Any) -> bool:
    """Whether ``fn`` was marked by :func:`capture_hook`."""
    return bool(getattr(fn, CAPTURE_HOOK, False))


def _inert_hook(*_args: Any, **_kwargs: Any) -> None:
    """What a copied :class:`LocalHook` becomes: does nothing (a forward hook or pre-hook returning None)."""
    return None


setattr(_inert_hook, CAPTURE_HOOK, True)
_inert_hook.observes_only = True  # type: ignore[attr-defined]  # (curvature.uses_static.observer_hook's mark)


def _inert() -> Callable[..., None]:
    return _inert_hook


def is_inert(fn: Any) -> bool:
    """Whether ``fn`` is the do-nothing hook a copied or unpickled :class:`LocalHook` became."""
    return fn is _inert_hook


class LocalHook:
    """A module hook that belongs to the module it was registered on: ``copy.deepcopy`` and pickling of
    the module (a "best model" snapshot taken inside the closure, ``torch.save(model)``) give the copy a
    hook that does nothing in its place.

    torch copies a module's hook dictionaries with it, and a handle removes its hook from the original
    only: a copied capture hook would go on recording the copy's forwards into the capture it belongs to
    (and hold it, and its activations), and a hook that is a local function cannot be pickled. Attributes
    (the marks :func:`capture_hook` and ``observer_hook`` set, a bound method's ``__self__``) are read
    from the wrapped function."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "fn":  # not set yet (during construction by copy or pickle): no recursion
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __deepcopy__(self, memo: Dict[int, Any]) -> Callable[..., None]:
        return _inert_hook

    def __reduce__(self) -> Tuple[Callable[[], Callable[..., None]], Tuple[()]]:
        return _inert, ()


def _nobody() -> None:
    return None


def attached_owners(module: nn.Module) -> List[Any]:
    """The live owners whose hooks (marked with :data:`OWNER_MARK`, e.g. by
    ``torchsso2.kfac.hooks.attach_forward_hooks``) are on ``module``."""
    owners = [getattr(h, OWNER_MARK, _nobody)() for h in module._forward_hooks.values()]
    return [o for o in owners if o is not None]


def register_owner(owner: Any) -> None:
    """Count ``owner`` (a ``KFACPreconditioner`` attaching its hooks; it has ``hooked_modules()``) among the
    live owners of lasting hooks, weakly: :class:`HiddenPasses` reaches it without walking a model."""
    _LIVE_OWNERS.add(owner)


def _concerns(owner: Any, model: nn.Module, inside: AbstractSet[int]) -> bool:
    """Whether ``owner``'s hooks are on ``model``'s modules (``inside``: their ids) or on a module holding
    ``model`` (a preconditioner built on the whole network, an optimizer on its backbone)."""
    hooked = owner.hooked_modules()
    return any(id(m) in inside for m in hooked) or any(x is model for m in hooked for x in m.modules())


class HiddenPasses:
    """``with passes():`` (an instance called) hides the forwards and backwards run inside from the live owners
    of lasting hooks that concern ``model`` (a ``KFACPreconditioner`` on its layers, or on a network holding it): the
    curvature's own passes (Monte-Carlo or exact Fisher backward passes, the Hessian's, adaptive mode's
    products and the LM rule's loss evaluation) are not a training batch, and a preconditioner's factors
    take the user's forwards and backwards only. The passes over the model are hidden from the owners that
    concern it (another model's preconditioner, another thread's training, is left alone); a call of the
    user's closure (``everywhere=True``: the LM rule's evaluation), which may run any module, from every live
    owner. Which owners concern the model is worked out when the set of live owners changes (a walk over the
    model's modules), not at every step. The owners count the open contexts (:data:`HIDDEN_PASSES`)
    rather than reading a flag of the running code: the gradient hooks of a CUDA backward run in autograd's
    own threads."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._live: Optional[Set[Any]] = None  # weak references to the live owners when _owners was worked out
        self._owners: List[Any] = []  # weak references to those that concern the model

    def __getstate__(self) -> Dict[str, Any]:  # (weak references neither copy nor pickle: worked out again)
        return {"model": self.model}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["model"])  # type: ignore[misc]

    def owners(self) -> List[Any]:
        """The live owners concerning the model, worked out again when the live set changes (not when the model
        changes: a preconditioner built on a standalone module assigned into the model afterwards, ``model.head =
        head``, is found at the next change of the live set; walking the modules at every pass while another
        model's preconditioner lives, a GAN's discriminator, cost 20-30% of a small generator's step)."""
        if not _LIVE_OWNERS:
            return []
        live = {weakref.ref(o) for o in _LIVE_OWNERS}
        if live != self._live:
            inside = {id(m) for m in self.model.modules()}
            self._owners = [ref for ref in live if (o := ref()) is not None and _concerns(o, self.model, inside)]
            self._live = live
        return [o for o in (ref() for ref in self._owners) if o is not None]

    def __call__(self, everywhere: bool = False) -> ContextManager[None]:
        """``everywhere``: from every live owner (a call of the user's closure, which may run any module: the
        LM rule's evaluation; another thread's training meanwhile is not recorded either)."""
        return hidden_from(list(_LIVE_OWNERS) if everywhere else self.owners())


@contextmanager
def hidden_from(owners: Iterable[Any]) -> Iterator[None]:
    """Hide what runs inside from ``owners`` (their :data:`HIDDEN_PASSES` counters, closed on the way out)."""
    hidden: List[Any] = []
    try:
        for owner in owners:
            setattr(owner, HIDDEN_PASSES, getattr(owner, HIDDEN_PASSES, 0) + 1)
            hidden.append(owner)
        yield
    finally:
        for owner in hidden:
            setattr(owner, HIDDEN_PASSES, getattr(owner, HIDDEN_PASSES) - 1)


def warn_if_attached(layers: Iterable[Any], stepping: Any) -> None:
    """UserWarning when the hooks of a live preconditioner other than ``stepping`` (the optimizer or
    preconditioner taking its first step) are on the ``module`` of any of ``layers`` (objects with ``name``
    and ``module``), naming them. Checked at the first step, not at construction: ``pre =
    KFACPreconditioner(model)`` run twice frees the first one only when the second is bound to ``pre``."""
    layers = list(layers)
    others = [[o for o in attached_owners(layer.module) if o is not stepping] for layer in layers]
    held = {id(o) for found in others for o in found}
    if not held:
        return
    names = [layer.name for layer, found in zip(layers, others) if found]
    warnings.warn(f"{type(stepping).__name__}: {len(held)} other KFACPreconditioner(s) attached to layers "
                  f"{names[:5]}{' ...' if len(names) > 5 else ''} of this model record every forward and backward "
                  "of the training batches through them into their factors, and stepping it as well preconditions "
                  "their gradients more than once: call remove_hooks() on the one you no longer use, or drop every "
                  "reference to it",
                  UserWarning, stacklevel=caller_stacklevel())
