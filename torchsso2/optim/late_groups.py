"""Warnings for layers that join an optimizer's updates after it was built (``add_param_group``, or
parameters of its groups unfrozen with ``requires_grad_(True)``).

Which modules get curvature (and, with VIOptimizer, weight noise) is fixed when the optimizer is
built, from the model's trainable parameters then. A layer of a supported type whose parameters
join later, a new head appended to the model or a layer unfrozen for fine-tuning and added with
``add_param_group``, takes the plain update (SGD with momentum; VI: its mean as a point estimate,
no noise); so does a parameter frozen when the optimizer was built that ``params=[...]`` listed,
once unfrozen. That is allowed, but silent it looks like curvature that is not there, so it is a
UserWarning naming the modules and the way to give them curvature. A parameter frozen when an
optimizer was built on the model's trainable parameters (no ``params``) is not in its groups: once
unfrozen it gets gradients the optimizer never applies, which is a UserWarning too (naming
``add_param_group``). So are parameters of the groups that have left the model (a layer replaced after
the optimizer was built: the new one is in no group).
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Iterable, List, Set

from curvature.blocks import Layout
from curvature.modules.parameters import ParameterFamily
from curvature.selection import caller_stacklevel, select_layouts


def _would_cover(opt: Any, ids: Set[int]) -> Dict[str, Layout]:
    """The layouts ``opt``'s ``approx`` and ``skip_modules`` would give the parameters ``ids`` (by ``id``)
    had they been trainable and in it at construction; empty where none has curvature support."""
    try:
        with warnings.catch_warnings():  # a skip_modules entry matching nothing was warned about at construction
            warnings.simplefilter("ignore")
            would, _ = select_layouts(opt.model, opt.settings.approx, opt.settings.skip_modules, include=ids,
                                       any_module=opt.engine.any_module)
    except (ValueError, TypeError, NotImplementedError):  # no supported layer among them, or one it refuses
        return {}
    return would


def warn_uncovered_layers(opt: Any, params: Iterable[Any]) -> None:
    """UserWarning when ``params`` (a group just added to ``opt``, a built
    :class:`~torchsso2.optim.base.CurvatureOptimizer`) include parameters the optimizer's ``approx``
    and ``skip_modules`` would cover had they been trainable and in the optimizer at construction:
    parameters of modules it does not cover, and uncovered parameters of modules it covers (a bias
    left out of the constructor's ``params``)."""
    covered = {id(p) for p in opt.engine.params}
    new = {id(p) for p in params if p.requires_grad} - covered
    if not new:
        return
    would = _would_cover(opt, new)
    # a module no layer family describes (VIOptimizer's default diagonal covers any module by its gradients:
    # a container's own cls_token or temperature): skip_modules is no way out there (it would skip the
    # container, the covered layers in it too), so its parameters are named with the way to give them noise
    generic = [n for n in would if n not in opt.engine.layouts and isinstance(would[n].family, ParameterFamily)]
    if generic:
        names = [f"{n}.{local}" if n else local for n in sorted(generic) for local in would[n].param_names]
        warnings.warn(
            f"add_param_group: parameters {names} take the plain update (their mean as a point estimate, without "
            f"weight noise): this {type(opt).__name__}'s diagonal covers any parameter by its gradients, but the "
            "covered parameters are fixed when it is built. To give them weight noise, list them in the constructor's "
            "params (or build it on the whole model); else filter this warning", UserWarning,
            stacklevel=caller_stacklevel())
    fresh = sorted(n for n in would if n not in opt.engine.layouts and n not in generic)
    partial = [f"{n}.{local}" for n in sorted(would) if n in opt.engine.layouts for local in would[n].param_names]
    what = type(opt).__name__
    if fresh:
        warnings.warn(
            f"add_param_group: modules {fresh} have curvature support but were not covered when this {what} was "
            "built (frozen then, not yet in the model, or not in its params), so they take the plain update: the "
            "covered modules are fixed at construction. To give them curvature, build the optimizer with them in the "
            "model and trainable (then freeze them with requires_grad_(False) until they should train: a frozen "
            "covered module keeps its curvature); to keep the plain update, build it with skip_modules naming "
            "them, or filter this warning", UserWarning, stacklevel=caller_stacklevel())
    if partial:
        warnings.warn(
            f"add_param_group: parameters {partial} of modules this {what} covers were not in its params when it "
            "was built, so they take the plain update; list them in the constructor's params to give them "
            "curvature, or filter this warning", UserWarning, stacklevel=caller_stacklevel())


def warn_unfrozen(opt: Any, params: List[Any], in_groups: bool) -> None:
    """UserWarning naming ``params``: parameters frozen when ``opt`` was built (so not covered) and
    trainable now. ``in_groups``: they are in its param groups (``params=[...]`` listed them) and take
    the plain update; else (built on the model's trainable parameters) it does not update them at all.
    Modules among them with curvature support are named with the way to give them curvature."""
    what = type(opt).__name__
    ids = {id(p) for p in params}
    names = [n for n, p in opt.model.named_parameters() if id(p) in ids] or [f"{len(params)} parameters"]
    fresh = sorted(_would_cover(opt, ids))
    how = (f" Modules {fresh} have curvature support: to give them curvature, build the optimizer with them "
           "trainable, then freeze them with requires_grad_(False) until they should train (a frozen covered module "
           "keeps its curvature).") if fresh else ""
    if in_groups:
        plain = "their mean as a point estimate, without weight noise" if hasattr(opt, "dataset_size") else \
            "momentum SGD, no curvature"
        what_happens = f"they take the plain update ({plain}), since the covered modules are fixed at construction"
        keep = "To keep the plain update, filter this warning"
    else:
        what_happens = ("they are not in its param groups (it was built on the model's trainable parameters, as "
                        "torch.optim is with filter(lambda p: p.requires_grad, model.parameters())), so it does not "
                        "update them")
        keep = "For the plain update, add them with opt.add_param_group({'params': [...]})"
    warnings.warn(
        f"parameters {names} were frozen (requires_grad=False) when this {what} was built and are trainable now: "
        f"{what_happens}.{how} {keep}", UserWarning, stacklevel=caller_stacklevel())


def warn_params_gone(opt: Any, with_grad: List[Any]) -> None:
    """Once per set of ``opt``'s parameters with a gradient that leaves some out: a UserWarning naming the
    parameters of the groups that have no gradient and are no longer in the model (a layer replaced or
    removed after the optimizer was built and the new one's parameters in no group: never trained,
    silently, as under torch.optim). Costs a count per step; the model is searched only when it changes."""
    if len(with_grad) == sum(len(g["params"]) for g in opt.param_groups):
        return
    key = tuple(map(id, with_grad))
    if opt.__dict__.get("_gone_checked") == key:
        return
    opt._gone_checked = key
    born = opt.__dict__.get("_params_in_model", set())  # (a free parameter given in params= was never in it)
    own = {id(p) for p in opt.model.parameters()}
    gone = [p for g in opt.param_groups for p in g["params"] if p.grad is None and id(p) in born and id(p) not in own]
    if gone:
        shapes = [tuple(p.shape) for p in gone[:6]]
        warnings.warn(f"{type(opt).__name__}: {len(gone)} of its parameters (shapes {shapes}"
                      f"{' ...' if len(gone) > 6 else ''}) have no gradient and are no longer in the model: a layer "
                      "replaced or removed after the optimizer was built (model.head = nn.Linear(...)) leaves the "
                      "new layer's parameters in no param group, and they are never updated. Build a new optimizer "
                      "after changing the model (or add_param_group for a layer added on purpose)",
                      UserWarning, stacklevel=caller_stacklevel())
