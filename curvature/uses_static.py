"""When the use check of :mod:`curvature.uses` cannot fail, so a capture may leave it out.

The check finds a covered parameter used in the forward outside the calls of the covered modules
holding it (a functional tied head ``F.linear(h, emb.weight)``). In a model that is a plain
``nn.Sequential`` (nested ones allowed) of torch's own layers, with no forward hooks (other than
observers that only record, :func:`observer_hook`) and no patched ``forward``, every parameter is
used inside the call of the layer that holds it, since those layers' forwards touch only their own
parameters and ``Sequential.forward`` only calls its children. So the check passes whenever every
layer holding a covered parameter is itself covered. Everything else (custom modules, subclasses,
parametrized layers, hooked modules, a covered parameter also held by an uncovered layer) keeps the
check.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

from torch import nn
from torch.nn.modules import module as _module

__all__ = ["observer_hook", "plain_module", "no_global_forward_hooks", "uses_stay_inside"]

#: torch layers whose forward uses only the module's own parameters (exact types)
PLAIN_LAYERS = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU,
    nn.ELU, nn.Softplus, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d, nn.Flatten, nn.Unflatten, nn.Identity, nn.Dropout,
)


def observer_hook(hook: Callable[..., None]) -> Callable[..., None]:
    """Mark a forward (pre-)hook as an observer: it returns None and computes nothing from the
    module's parameters (it only records what it is given), so :func:`plain_module` ignores it."""
    hook.observes_only = True  # type: ignore[attr-defined]
    return hook


def _only_observers(hooks: Dict[int, Callable[..., Any]]) -> bool:
    return all(getattr(h, "observes_only", False) is True for h in hooks.values())


def plain_module(module: nn.Module) -> bool:
    """No forward hooks on ``module`` (other than :func:`observer_hook` ones) and no ``forward`` set
    on the instance: calling it runs its class's ``forward`` and nothing else (with
    :func:`no_global_forward_hooks`)."""
    return "forward" not in module.__dict__ and _only_observers(module._forward_hooks) \
        and _only_observers(module._forward_pre_hooks)


def global_forward_hooks() -> bool:
    """Some forward hook is registered for every module (``register_module_forward_hook``; torch runs
    these before a module's own hooks)."""
    return bool(_module._global_forward_hooks)


def no_global_forward_hooks() -> bool:
    """No forward (pre-)hook registered for every module (``nn.modules.module.register_module_forward_hook``)."""
    return not (_module._global_forward_hooks or _module._global_forward_pre_hooks)


def uses_stay_inside(root: nn.Module, modules: Dict[str, nn.Module]) -> bool:
    """True when ``root``'s forward provably uses every parameter of ``modules`` only inside the call
    of a module of ``modules`` holding it (so :class:`curvature.uses.UseWindows` would never raise);
    False when that is not known. Call it before the capture registers its own hooks."""
    if not no_global_forward_hooks():
        return False
    # a module's own parameters straight from its ``_parameters`` dict (what ``parameters(recurse=False)``
    # yields, less its generator machinery: this runs at every curvature step; digits MLP ~11 -> ~5 µs)
    covered_modules = {id(m) for m in modules.values()}
    covered_params = {id(p) for m in modules.values() for p in m._parameters.values() if p is not None}
    stack = [root]
    while stack:
        m = stack.pop()
        if not plain_module(m):
            return False
        if type(m) is nn.Sequential:
            if any(p is not None for p in m._parameters.values()):
                return False
            stack.extend(c for c in m._modules.values() if c is not None)
            continue
        if type(m) not in PLAIN_LAYERS or m._modules:
            return False
        if id(m) not in covered_modules and any(id(p) in covered_params for p in m._parameters.values()):
            return False  # a covered parameter also used by an uncovered layer: outside every window
    return True
