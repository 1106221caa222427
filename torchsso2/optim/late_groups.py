"""A warning for layers added to an optimizer after it was built (``add_param_group``).

Which modules get curvature (and, with VIOptimizer, weight noise) is fixed when the optimizer is
built, from the model's trainable parameters then. A layer of a supported type whose parameters
join later, a new head appended to the model or a layer unfrozen for fine-tuning and added with
``add_param_group``, takes the plain update (SGD with momentum; VI: its mean as a point estimate,
no noise). That is allowed, but silent it looks like curvature that is not there, so it is a
UserWarning naming the modules and the way to give them curvature.
"""
from __future__ import annotations

import warnings
from typing import Any, Iterable

from curvature.selection import caller_stacklevel, select_layouts


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
    try:
        with warnings.catch_warnings():  # a skip_modules entry matching nothing was warned about at construction
            warnings.simplefilter("ignore")
            would, _ = select_layouts(opt.model, opt.settings.approx, opt.settings.skip_modules, include=new)
    except (ValueError, TypeError, NotImplementedError):  # no supported layer among them, or one it refuses
        return
    fresh = sorted(n for n in would if n not in opt.engine.layouts)
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
