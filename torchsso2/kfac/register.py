"""Which modules the preconditioner handles: kfac_pytorch's ``register_modules`` rule.

A module is registered when it is a leaf of ``model.named_modules()``, an ``nn.Linear`` or
``nn.Conv2d`` (subclasses included), all its parameters require grad, and no ``skip_layers``
pattern matches (``re.search``) its name or its class name. Every other module is ignored.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence, Set as AbstractSet
from typing import List, Set, Tuple

from torch import nn
from torch.nn.utils import parametrize

from curvature.modules import family_of
from curvature.modules.base import LayerFamily
from curvature.selection import forward_replaced, refuse_lazy_parameters
from curvature.sharded import refuse_sharded

__all__ = ["SUPPORTED_TYPES", "find_layers"]

SUPPORTED_TYPES: Tuple[type, ...] = (nn.Linear, nn.Conv2d)


def _compile(patterns: Sequence[str]) -> List["re.Pattern[str]"]:
    """The regexes of ``skip_layers``: a sequence or set of strings or compiled patterns (a list, a tuple,
    OmegaConf's ListConfig; as kfac_pytorch, which passes each to ``re.compile``); a bare string is refused
    (kfac_pytorch would take each of its characters as a pattern), and so is a mapping (its keys would be
    taken, whatever their values)."""
    if isinstance(patterns, (str, bytes, Mapping)) or not isinstance(patterns, (Sequence, AbstractSet)):
        raise TypeError(f"skip_layers must be a list of regex strings, got {type(patterns).__name__} {patterns!r}")
    out = []
    for p in patterns:
        if isinstance(p, re.Pattern):
            out.append(p)
            continue
        if not isinstance(p, str):
            raise TypeError(f"skip_layers entries must be regex strings, got {type(p).__name__} {p!r}")
        try:
            out.append(re.compile(p))
        except re.error as exc:
            raise ValueError(f"skip_layers pattern {p!r} is not a valid regex: {exc}") from None
    return out


def find_layers(model: nn.Module, skip_layers: Sequence[str]) -> List[Tuple[str, nn.Module, LayerFamily]]:
    """``(name, module, family)`` of every registered module, in ``named_modules`` order."""
    regexes = _compile(skip_layers)
    refuse_sharded(model, "KFACPreconditioner")
    found = []

    def skipped(name: str, module: nn.Module) -> bool:
        return any(r.search(name) or r.search(type(module).__name__) for r in regexes)

    modules = list(model.named_modules())
    for pattern, r in zip(skip_layers, regexes):  # a typo would leave the layer registered (kfac_pytorch: silently)
        if not any(r.search(name) or r.search(type(module).__name__) for name, module in modules):
            warnings.warn(f"skip_layers entry {pattern!r} matches no module of the model: entries are regexes searched "
                          f"in the names of model.named_modules() (e.g. {[n for n, _ in modules if n][:3]}) and the "
                          "modules' class names; nothing is skipped for it", UserWarning, stacklevel=3)

    for name, module in model.named_modules():
        if isinstance(module, SUPPORTED_TYPES) and parametrize.is_parametrized(module) and not skipped(name, module):
            # not a leaf (its parametrizations are children): kfac_pytorch leaves it out silently
            warnings.warn(f"layer {name!r} ({type(module).__name__}) is parametrized (torch.nn.utils.parametrize: "
                          "orthogonal, spectral_norm, weight_norm): its weight is computed from other parameters, "
                          "which K-FAC's factors do not cover, so it is not preconditioned (its gradient passes "
                          f"through unchanged, as in kfac_pytorch); add {name!r} to skip_layers to silence this",
                          UserWarning, stacklevel=3)
            continue
        if any(True for _ in module.children()) or not isinstance(module, SUPPORTED_TYPES):
            continue
        if skipped(name, module):
            continue
        if not all(p.requires_grad for p in module.parameters()):
            continue
        refuse_lazy_parameters(name, module)
        family = family_of(module)
        if family is None:  # pragma: no cover - Linear/Conv2d always have one
            continue
        try:
            family.validate(module)
            undefined = family.kfac_undefined(module)  # a grouped convolution (kfac_pytorch fails at its first step)
            if undefined is not None:
                raise ValueError(undefined)
        except ValueError as exc:
            raise ValueError(f"module {name!r}: {exc}; K-FAC cannot handle it, add it to skip_layers") from None
        own = dict(module.named_parameters(recurse=False))
        if "weight" not in own:  # kfac_pytorch fails at the first step (a TypeError)
            raise ValueError(f"module {name!r} ({type(module).__name__}) holds parameters {sorted(own)} and no weight "
                             "parameter: a reparametrization (torch.nn.utils.weight_norm / spectral_norm of the old, "
                             "hook-based API, or torch.nn.utils.prune) computes the weight from them, which K-FAC's factors do not cover; add "
                             f"{name!r} to skip_layers, or remove the reparametrization")
        replaced = forward_replaced(module, family)
        if replaced is not None:  # kfac_pytorch registers it silently
            warnings.warn(f"layer {name!r} ({type(module).__name__}): {replaced}; its K-FAC factors and "
                          "preconditioning are those of the plain layer's function (as kfac_pytorch's), which is "
                          f"wrong if its forward computes something else: add {name!r} to skip_layers then",
                          UserWarning, stacklevel=3)
        found.append((name, module, family))
    uncalled = attention_out_projections(model)
    names = [name for name, module, _ in found if id(module) in uncalled]
    if names:
        warnings.warn(f"layers {names} are nn.MultiheadAttention out_proj layers, whose weight the attention uses "
                      "without calling them: K-FAC sees no forward of them, so they stay unpreconditioned "
                      "(kfac_pytorch fails on them); add 'out_proj' to skip_layers to leave them out",
                      UserWarning, stacklevel=3)
    return found


def attention_out_projections(model: nn.Module) -> Set[int]:
    """``id`` of every ``nn.MultiheadAttention``'s ``out_proj`` in ``model``: the attention computes with
    its weight without calling it, so no forward of it is ever seen."""
    return {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
