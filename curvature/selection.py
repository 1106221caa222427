"""Which modules are covered, and in which shape.

``approx`` is a shape name applied to every covered module, or a dict whose keys are
``nn.Module`` types, class names (``"BatchNorm2d"``) or regular expressions searched in
the module name (``"features\\.0"``), checked in insertion order; modules matched by no key
get their family's default (K-FAC for Linear, the convolutions and Embedding, diag for norm layers).
A plain ``"kfac"`` applies to the families where K-FAC is defined; norm layers then use
``"diag"`` (logged once).
"""
from __future__ import annotations

import logging
import re
import warnings
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .blocks import Layout
from .blocks.layout import TiedUse
from .modules import SUPPORTED_LAYERS, LayerFamily, family_of
from .modules.parameters import ParameterFamily
from .modules.base import GradientsDoNotHelp, SkipDoesNotHelp
from .options import Approx, parse
from .sharded import refuse_sharded
from .stacklevel import caller_stacklevel
from .tied import tied_kfac_undefined

logger = logging.getLogger(__name__)

# (keys: types, class names or name regexes; Any, as a Mapping's key type is invariant: a Dict[str, str] or a
# Dict[type, str] built elsewhere must be accepted)
ApproxSpec = Union[str, Approx, Mapping[Any, Union[str, Approx]]]
SkipSpec = Optional[Sequence[Union[str, type]]]


#: name prefixes of module wrappers: DistributedDataParallel / DataParallel (``module.``), torch.compile
#: (``_orig_mod.``)
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def unwrapped_name(name: str) -> str:
    """A module's name in the model without its wrappers (``module._orig_mod.fc`` → ``fc``)."""
    while name.startswith(WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def _is_wrapper(model: nn.Module) -> bool:
    return isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or hasattr(model, "_orig_mod")


def _matches(key: Union[str, type], name: str, module: nn.Module, plain: Optional[str] = None) -> bool:
    """Whether selector ``key`` (a type, a class name or a name regex) picks ``module`` called ``name``
    (``plain``: its name without the wrappers' prefixes, under DDP or torch.compile: a regex written
    for the bare model matches there too)."""
    if isinstance(key, type):
        return isinstance(module, key)
    if not isinstance(key, str):
        raise TypeError(f"selector keys must be module types or strings, got {key!r}")
    return type(module).__name__ == key or re.search(key, name) is not None \
        or (plain is not None and plain != name and re.search(key, plain) is not None)


def _warn_unmatched(model: nn.Module, keys: Sequence[Union[str, type]], wrapped: bool,
                    argument: str = "skip_modules") -> None:
    """Warn about each ``skip_modules`` entry (or ``approx`` dict key, ``argument="approx"``) that picks no
    module of ``model`` (a typo, or a name regex written for another model), so that a layer meant to be
    left out, or given a shape, does not silently get the default."""
    modules = list(model.named_modules())
    names = [n for n, _ in modules if n][:3]
    effect = "nothing is skipped for it" if argument == "skip_modules" else \
        ("the modules no key matches take their layer's default shape (K-FAC for Linear, the convolutions "
         "(transposed too), Embedding)")
    for key in keys:
        if not any(_matches(key, name, module, unwrapped_name(name) if wrapped else None) for name, module in modules):
            what = key.__name__ if isinstance(key, type) else repr(key)
            seen = f"e.g. {names}" if names else "the model has no submodules"
            warnings.warn(f"{argument} entry {what} matches no module of the model: entries are matched against "
                          f"the names in model.named_modules() ({seen}) and the modules' class names; {effect}",
                          UserWarning, stacklevel=caller_stacklevel())


def _warn_overbroad(model: nn.Module, keys: Sequence[Union[str, type]], argument: str = "skip_modules") -> None:
    """Warn about each string entry that is the exact name of one module but, searched as a regex, also picks
    modules outside it (``"1"`` picks ``"10"``, ``"features.1"`` picks ``"features.12"``): a config written with
    module names (JSON, YAML) would silently select more than it names."""
    names = [n for n, _ in model.named_modules() if n]
    exact = set(names)
    for key in keys:
        if not isinstance(key, str) or key not in exact:
            continue
        others = [n for n in names if n != key and not n.startswith(key + ".") and re.search(key, n)]
        if others:
            warnings.warn(f"{argument} entry {key!r} is the name of module {key!r}, but as a regex searched in the "
                          f"module names it also picks {others[:5]}{' ...' if len(others) > 5 else ''}: anchor it "
                          f"({'^' + re.escape(key) + '$'!r}) to pick that module only", UserWarning,
                          stacklevel=caller_stacklevel())


def _is_torch_layer_name(key: str) -> bool:
    """Whether ``key`` is the name of a ``torch.nn`` module class (``"Conv2d"``, ``"BatchNorm2d"``)."""
    cls = getattr(nn, key, None)
    return isinstance(cls, type) and issubclass(cls, nn.Module)


class UncoveredModule(ValueError):
    """A module with trainable parameters that no layer family covers (``select_layouts`` without
    ``any_module``): the ValueError names it and the ways out."""


#: the family of every module ``select_layouts(..., any_module=True)`` covers by its gradients alone
GENERIC = ParameterFamily()


def _refuse_unsupported(model: nn.Module, name: str, module: nn.Module, fam: Optional[LayerFamily],
                        direct: Sequence[Tuple[str, nn.Parameter]]) -> None:
    """ValueError (:class:`UncoveredModule` where no family knows the module) naming module ``name``
    and the way out, when its family's formulas do not describe it: a parametrization, an option the
    family refuses (the family's error as ``__cause__``), parameters other than the layer's own, no
    family, a replaced ``forward``."""
    if isinstance(module, nn.utils.parametrize.ParametrizationList):  # weight_norm, spectral_norm, ... (new API)
        layer = name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""
        if not layer:
            raise ValueError(
                f"the model itself ({type(model).__name__}) has a parametrized parameter ({name}: "
                "torch.nn.utils.parametrize): its weight is computed from other parameters, which the curvature "
                "formulas do not cover, and skipping it would leave no layer; remove the parametrization, or "
                "train this model with a torch.optim optimizer")
        raise ValueError(
            f"module {layer!r} has a parametrized parameter ({name}: torch.nn.utils.parametrize, e.g. "
            "parametrizations.weight_norm): its weight is computed from other parameters, which the curvature "
            f"formulas do not cover; skip it with {skip_hint(layer)} (its parameters "
            "then take the plain update) or remove the parametrization")
    if fam is not None:  # the layer's own unsupported options first (nn.MultiheadAttention's kdim/vdim and
        # add_bias_kv hold parameters of their own, which the check below would take for a reparametrization)
        try:
            fam.validate(module)
        except ValueError as err:
            hint = "" if isinstance(err, SkipDoesNotHelp) else \
                f"; or leave the module to the plain update with {skip_hint(name)}"
            extra = sorted({n for n, _ in direct} - _LAYER_PARAMETERS - _OWN_PARAMETERS.get(type(module), set()))
            also = "" if not extra else (f" (it also holds parameters {extra} that are not its layer's own "
                                         "weight/bias, e.g. from the old hook-based weight_norm, which the "
                                         "curvature does not cover either)")
            raise ValueError(f"module {name!r} ({type(module).__name__}): {err}{also}{hint}") from err
    if fam is not None and {n for n, _ in direct} - _LAYER_PARAMETERS:
        extra = sorted({n for n, _ in direct} - _LAYER_PARAMETERS)
        raise ValueError(
            f"module {name!r} ({type(module).__name__}) holds parameters {extra} that are not its layer's own "
            "weight/bias: a reparametrization (torch.nn.utils.weight_norm / spectral_norm of the old, hook-based "
            "API, or torch.nn.utils.prune) computes the weight from them, which the curvature formulas do not "
            f"cover; skip it with {skip_hint(name)} or remove the reparametrization")
    if fam is None and any(True for _ in module.children()):
        # a container holding parameters itself (a ViT's cls_token, a learned temperature): skipping
        # it would skip its layers too
        qualified = [f"{name}.{n}" if name else n for n, _ in direct]
        names, as_set = ", ".join(qualified), ", ".join(map(repr, qualified))
        raise UncoveredModule(
            f"module {name!r} of type {type(module).__name__} holds trainable parameters itself ({names}) "
            f"outside any layer with curvature support ({SUPPORTED_LAYERS}); skip_modules would skip its layers "
            "too. Leave them out of the optimizer's "
            f"params (params=[p for n, p in model.named_parameters() if n not in {{{as_set}}}]) and add them "
            "afterwards with opt.add_param_group({'params': [...]}) for the plain (momentum SGD) update, "
            "give them to another torch.optim optimizer, or freeze them")
    if fam is None:
        raise UncoveredModule(
            f"module {name!r} of type {type(module).__name__} has trainable parameters "
            f"({', '.join(n for n, _ in direct)}) but no curvature support; supported: {SUPPORTED_LAYERS}. "
            "Exclude it with skip_modules=[...] "
            "(by name regex or type) or freeze its parameters")
    replaced = forward_replaced(module, fam)
    if replaced is not None:
        raise ValueError(
            f"module {name!r} ({type(module).__name__}): {replaced}; the curvature formulas are those of the "
            "layer's own forward and would be silently wrong for another function (a scaled output, a "
            "standardized or masked weight, a permuted normalization axis); leave the module to the plain "
            f"update with {skip_hint(name)}, or use the plain layer class")


def _type_key(key: Any, module: nn.Module) -> bool:
    """Whether the ``approx`` key ``key`` picked ``module`` by its layer type (a type, or the class name)."""
    return isinstance(key, type) or (isinstance(key, str) and key == type(module).__name__)


def _fallback_summary(modules: Sequence[Tuple[str, nn.Module, Optional[str]]]) -> str:
    """The modules K-FAC fell back from (``(name, module, reason)``, a reason for a tied block), by kind:
    ``"grouped convolutions '3' (Conv2d, groups=16), '8' (Conv2d, groups=32); 23 layers of types without K-FAC
    (BatchNorm2d)"``."""
    grouped = [f"{n!r} ({type(m).__name__}, groups={m.groups})" for n, m, why in modules
               if why is None and getattr(m, "groups", 1) != 1]
    tied = [f"{n!r} ({type(m).__name__}: {why})" for n, m, why in modules if why is not None]
    without = [type(m).__name__ for n, m, why in modules  # layer types without K-FAC (the norm layers)
               if why is None and getattr(m, "groups", 1) == 1]
    parts = [f"grouped convolutions {', '.join(grouped[:8])}{', ...' if len(grouped) > 8 else ''}"] if grouped else []
    parts += tied
    if without:
        parts.append(f"{len(without)} layer{'s' if len(without) > 1 else ''} of types without K-FAC "
                     f"({', '.join(sorted(set(without)))})")
    return "; ".join(parts)


def _default_approx(module: nn.Module) -> Approx:
    fam = family_of(module)
    return Approx.KFAC if fam is not None and fam.kfac_undefined(module) is None else Approx.DIAG


#: the parameter names of the supported layers (nn.MultiheadAttention's in-projection included); a covered
#: module holding others has been reparametrized (the old weight_norm's weight_g / weight_v)
_LAYER_PARAMETERS = frozenset({"weight", "bias", "in_proj_weight", "in_proj_bias"})
#: parameters a layer's own unsupported options create (named by its family's check, not reparametrizations)
_OWN_PARAMETERS = {nn.MultiheadAttention: {"q_proj_weight", "k_proj_weight", "v_proj_weight", "bias_k", "bias_v"}}


def skip_hint(name: str) -> str:
    """``skip_modules=['^name$']``: the exact-name entry that leaves module ``name`` to the plain update."""
    return f"skip_modules=[{'^' + re.escape(name) + '$'!r}]"


def forward_replaced(module: nn.Module, fam: LayerFamily) -> Optional[str]:
    """Why ``module`` does not compute its family's layer function, or None.

    A subclass overriding ``forward`` (``3 * super().forward(x)``, timm's weight-standardized
    ``StdConv2d``, a ``LayerNorm2d`` permuting channels last) or a ``forward`` set on the instance
    computes something the family's formulas do not describe. A subclass that keeps the layer's
    ``forward`` (``NonDynamicallyQuantizableLinear``, a custom initialisation) is the layer.
    """
    if "forward" in vars(module):
        return "its forward was replaced on the instance (module.forward = ...)"
    base = next(t for t in fam.module_types if isinstance(module, t))
    for method in ("forward", "_conv_forward"):  # Conv2d.forward calls _conv_forward (weight standardization)
        if getattr(base, method, None) is not None and getattr(type(module), method) is not getattr(base, method):
            owner = next(c for c in type(module).__mro__ if method in vars(c))
            name = owner.__qualname__ if owner.__qualname__ != base.__name__ else f"{owner.__module__}.{owner.__qualname__}"
            return f"{name}.{method} overrides {base.__module__}.{base.__name__}.{method}"
    return None


def refuse_lazy_parameters(name: str, module: nn.Module) -> None:
    """ValueError naming module ``name`` when its own parameters are not created yet (``nn.LazyLinear``,
    ``nn.LazyConv2d``, ...: their shapes come from the first forward). Called for the modules the
    curvature would cover only: a skipped lazy module takes the plain update."""
    if any(is_lazy(p) for p in module.parameters(recurse=False)):
        raise ValueError(f"modules {[name]} have uninitialized (lazy) parameters, whose shapes are set by the model's "
                         "first forward: run one forward pass (e.g. model(x[:1])) before building the optimizer or "
                         "computing the curvature, or skip them")


def select_layouts(model: nn.Module, approx: ApproxSpec, skip_modules: SkipSpec = None,
                   include: Optional[AbstractSet[int]] = None, any_module: bool = False
                   ) -> Tuple[Dict[str, Layout], Dict[str, Approx]]:
    """Covered modules (``named_modules`` order) with their layouts and shapes.

    A module matched by ``skip_modules`` is left out with all its submodules: a parent may
    compute with its children's parameters itself (``nn.MultiheadAttention`` uses
    ``out_proj``'s weight without calling ``out_proj``), so ``skip_modules=[nn.MultiheadAttention]``
    leaves the whole attention to the optimizer's plain update.

    Tied parameters (one ``Parameter`` held by several covered modules, e.g. ``head.weight =
    emb.weight``) get one block, in the layout of the first module holding them (the one
    ``named_parameters`` lists them under); the other modules are recorded in that layout's
    :attr:`~curvature.blocks.Layout.tied` and contribute their part (see
    :meth:`curvature.engine.CurvatureEngine.blocks_from_grad_chunks`). Their other parameters form
    their own layout (a module whose only parameter is tied has none).

    ``include``: the ``id`` of the parameters to cover (an optimizer's own parameters); the others
    are treated as frozen. None: every trainable parameter.

    ``any_module``: a module no layer family covers (an ``nn.GRU``, a custom module's own
    ``nn.Parameter``, a container's ``cls_token``) gets a diagonal block of its direct parameters
    (:class:`~curvature.modules.parameters.ParameterFamily`) instead of the ValueError, for an
    estimator that needs only the gradients (``VIOptimizer``'s ``curvature="reparam"``); it must be
    given a diagonal shape (``approx="diag"``, or a rule naming it).

    Raises ValueError for a module holding trainable parameters of an unsupported type
    (unless skipped) and for a model with no supported layer.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    refuse_sharded(model, "torchsso2")
    if isinstance(skip_modules, str):  # a list is iterated; a string would be taken character by character
        raise TypeError(f"skip_modules must be a list of module types, class names or name regexes, got the string "
                        f"{skip_modules!r}; pass skip_modules=[{skip_modules!r}]")
    if isinstance(skip_modules, Mapping):  # iterated, it gives its keys: {head: false} would still skip head
        raise TypeError(f"skip_modules must be a list of module types, class names or name regexes, got a mapping "
                        f"{dict(skip_modules)!r}; pass [k for k, v in skip_modules.items() if v]")
    try:
        skip = list(skip_modules) if skip_modules is not None else []  # (False / 0 are not "no selection")
    except TypeError:
        raise TypeError(f"skip_modules must be a list of module types, class names or name regexes, got "
                        f"{type(skip_modules).__name__} {skip_modules!r}") from None
    for key in skip:
        if not isinstance(key, (str, type)):
            raise TypeError(f"skip_modules entries must be module types, class names or name regexes, got "
                            f"{type(key).__name__} {key!r}")
        if isinstance(key, str):  # a class name is a valid regex too
            try:
                re.compile(key)
            except re.error as err:
                raise ValueError(f"skip_modules entry {key!r} is not a valid regular expression ({err})") from err
    if isinstance(approx, Mapping):
        for k in approx:
            if not isinstance(k, (str, type)):  # (YAML reads an unquoted 0 as an int)
                raise TypeError(f"approx keys must be module types, class names or name regexes, got "
                                f"{type(k).__name__} {k!r}; quote it ({str(k)!r}, or {'^' + str(k) + '$'!r} for "
                                "that module only)")
        rules = [(k, parse(Approx, v, f"approx[{k!r}]")) for k, v in approx.items()]
        default: Optional[Approx] = None
        # not for a type or the name of one of torch.nn's layer classes: those cannot be typos, and a dict
        # written for several models may name classes some of them lack ({"Conv2d": ..., "Linear": ...})
        _warn_unmatched(model, [k for k, _ in rules if isinstance(k, str) and not _is_torch_layer_name(k)],
                        _is_wrapper(model), "approx")
        _warn_overbroad(model, [k for k, _ in rules], "approx")
    else:
        rules, default = [], parse(Approx, approx, "approx")
    layouts: Dict[str, Layout] = {}
    shapes: Dict[str, Approx] = {}
    owner: Dict[int, Tuple[str, str]] = {}  # id(parameter) -> (module name, local name) of its first module
    tied: Dict[str, List[TiedUse]] = {}
    soft_kfac: Set[str] = set()  # modules whose K-FAC came by default or by layer type, not by their name
    fallbacks: List[Tuple[str, nn.Module, Optional[str]]] = []  # where a K-FAC by default or type took the diagonal
    skipped: List[str] = []  # names of skipped modules: their submodules are skipped too
    wrapped = _is_wrapper(model)
    _warn_unmatched(model, skip, wrapped)  # before a module the entry was meant to skip raises below
    _warn_overbroad(model, skip)
    for name, module in model.named_modules():
        if any(name.startswith(f"{s}.") or not s for s in skipped):
            continue
        plain = unwrapped_name(name) if wrapped else None
        if any(_matches(k, name, module, plain) for k in skip):
            skipped.append(name)
            continue
        direct = [(n, p) for n, p in module.named_parameters(recurse=False)
                  if p.requires_grad and (include is None or id(p) in include)]
        if not direct:
            continue
        refuse_lazy_parameters(name, module)
        fam = family_of(module)
        if isinstance(module, torch.jit.ScriptModule):
            raise ValueError(
                f"module {name!r} is a TorchScript module ({type(module).__name__}, from torch.jit.script/trace): "
                "its layers are compiled code the curvature capture cannot hook. Build the optimizer on the original "
                "nn.Module (script or trace it for deployment after training), or skip it with "
                f"{skip_hint(name)}")
        try:
            _refuse_unsupported(model, name, module, fam, direct)
        except ValueError as err:
            # any_module: a module the layer families do not describe takes the gradients' diagonal block
            # (ParameterFamily), unless a skip would not help either (Embedding(sparse=True)) or the gradients
            # cannot describe it (Embedding(max_norm=...))
            if not any_module or isinstance(err.__cause__, (SkipDoesNotHelp, GradientsDoNotHelp)):
                raise
            fam = GENERIC
        own = []
        for local, p in direct:
            if id(p) in owner:  # tied: the first module (named_parameters order) holds the block
                owner_name, owner_local = owner[id(p)]
                tied.setdefault(owner_name, []).append(TiedUse(name, module, fam, local, owner_local))
            else:
                owner[id(p)] = (name, local)
                own.append((local, p))
        direct = own
        if not direct:
            continue
        key, shape = next(((k, v) for k, v in rules if _matches(k, name, module, plain)), (None, None))
        if fam is GENERIC:
            shape = shape if shape is not None else default if default is not None else Approx.DIAG
            if shape is not Approx.DIAG:
                raise ValueError(f"module {name!r} of type {type(module).__name__} has no layer curvature: its "
                                 f"parameters get a diagonal block from their gradients only, not approx="
                                 f"{shape.value!r}; give it approx='diag' or skip it with {skip_hint(name)}")
        elif shape is None or (shape is Approx.KFAC and fam.supports_kfac and _type_key(key, module)):
            # a plain approx='kfac', the family default, or K-FAC asked for a layer type: the layers of that type
            # K-FAC is not defined for (a grouped convolution) take the diagonal, as norm layers do
            shape = shape if shape is not None else default if default is not None else _default_approx(module)
            if shape is Approx.KFAC:
                soft_kfac.add(name)
                if fam.kfac_undefined(module) is not None:
                    shape = Approx.DIAG
                    fallbacks.append((name, module, None))
        elif shape is Approx.KFAC and fam.kfac_undefined(module) is not None:
            by_type = (f", or ask K-FAC by layer type ({{{type(module).__name__}: 'kfac'}}: the layers of that type "
                       "without it then take the diagonal)") if fam.supports_kfac else ""
            raise ValueError(f"approx='kfac' was asked for module {name!r} (key "
                             f"{key.__name__ if isinstance(key, type) else repr(key)}) but "
                             f"{fam.kfac_undefined(module)}; give it 'full' or 'diag' (a key naming it, placed "
                             f"first){by_type}")
        layouts[name] = Layout(name, module, fam, tuple(n for n, _ in direct))
        shapes[name] = shape
    for owner_name, uses in tied.items():
        layouts[owner_name].tied = tuple(uses)
        # a tied block whose K-FAC is not defined (a grouped convolution or a transposed one sharing an ordinary
        # convolution's weight): a K-FAC the owner got by default or by type takes the diagonal (asked by name,
        # the engine's tied check raises with the reason)
        why = tied_kfac_undefined(layouts[owner_name]) if shapes[owner_name] is Approx.KFAC else None
        if why is not None and owner_name in soft_kfac:
            shapes[owner_name] = Approx.DIAG
            fallbacks.append((owner_name, layouts[owner_name].module, why))
    if fallbacks:
        logger.info("K-FAC is not defined for these modules, which take approx='diag': %s", _fallback_summary(fallbacks))
    if not layouts:
        raise ValueError(f"the model has no module with curvature support ({SUPPORTED_LAYERS}) and trainable parameters"
                         + (f" left after skip_modules={skip!r} (skipped: {skipped})" if skipped else ""))
    return layouts, shapes


def covered_parameters(layouts: Mapping[str, Layout]) -> List[nn.Parameter]:
    """Covered parameters in ``named_parameters`` order."""
    return [p for lay in layouts.values() for p in lay.params]
