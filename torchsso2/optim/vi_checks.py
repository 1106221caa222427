"""Once-per-optimizer warnings of VIOptimizer about what its closure's batch says of the setup.

The posterior weighs the data by ``dataset_size × the closure's gradient`` against the prior, so
(i) a loss whose gradient is ``c``× the mean negative log-likelihood's (``F.mse_loss`` averages over
the D outputs as well: ``c = 2/D``; ``reduction="sum"``: ``N``; ``F.gaussian_nll_loss`` with the
noise variance σ² that ``noise_variance`` already divides by: ``1/(D·σ²)``) weighs the data ``c``-fold in
the mean's update: with ``curvature="reparam"`` (the diag default) the curvature follows, a posterior
tempered by ``c``; with the Fisher kinds the curvature is the mean NLL's, so the mean is that of the
``c``-tempered posterior and the covariance that of ``c = 1``. (ii) A ``dataset_size`` smaller than
one batch is almost surely the number of batches or of steps, not of training examples. Both are
warned about at the first step, when it can tell (the loss check needs ``step(closure, targets=y)``,
a closure returning ``(loss, output)`` and one weight sample per step); neither changes what the
step does. ``c`` is measured on the gradient with respect to the output (``⟨g, r⟩/⟨r, r⟩`` with ``r``
the mean NLL's gradient), so a constant in the loss (``log 2π``, ``log σ²``) does not count; where the
output's gradient was not seen (an ``output_selector`` whose pick the loss does not use), the loss
values are compared instead.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

from torch import Tensor

from curvature.stacklevel import caller_stacklevel

from .lm_forward import warn_if_loss_is_not_the_nll
from .loss_scale import warn_if_gradient_is_not_the_nll

__all__ = ["warn_about_batch", "VI_LOSS_SCALE_WARN_RTOL"]

#: relative difference between the closure's loss and the mean NLL beyond which VIOptimizer warns: the
#: scale mistakes differ by 2× or more (F.mse_loss of one output, reduction='sum'), and deliberate other
#: likelihoods near it (label smoothing 0.1: 0.999×, class weights) are not warned about
VI_LOSS_SCALE_WARN_RTOL = 0.1


def warn_about_batch(opt: Any, targets: Optional[Tensor], loss: Any, output: Any) -> None:
    """The checks of the module docstring for VIOptimizer ``opt`` after a step whose closure returned
    ``loss`` (the mean over the step's samples) and ``output`` (None for a loss-only closure)."""
    batch = _batch_size(opt, targets, output)
    if batch is not None and batch > opt.dataset_size:
        warnings.warn(
            f"VIOptimizer: dataset_size={opt.dataset_size} is smaller than this step's batch of {batch} "
            "examples; dataset_size is the number of training examples N (the data's weight against the "
            "prior, N × the mean loss), not of batches or steps (a deliberately tempered posterior is "
            "kl_weighting)", UserWarning, stacklevel=caller_stacklevel())
    seen = opt.__dict__.get("_misuse", {}).pop("output_grads", None)
    if opt.num_mc_samples != 1:  # (the mean loss over several samples is not one output's NLL)
        return
    consequence = (
        "The posterior weighs the data as dataset_size × the closure's gradient, so a scaled loss (F.mse_loss: 2/D "
        "for D outputs per example; reduction='sum': N; F.gaussian_nll_loss with the σ² that noise_variance "
        "divides by already: 1/(D·σ²)) weighs the data by that factor in the mean's update (with "
        "curvature='reparam', the diag default, in the covariance too: a tempered posterior; with the Fisher "
        "kinds the covariance stays the mean NLL's); return the mean NLL from the closure (the prior is "
        "VIOptimizer's own: add no L2 term), or ignore this if the other likelihood is meant (label "
        "smoothing, class weights)")
    if not warn_if_gradient_is_not_the_nll(opt, targets, seen, "VIOptimizer", consequence):
        warn_if_loss_is_not_the_nll(opt, targets, loss, output, "VIOptimizer", consequence, VI_LOSS_SCALE_WARN_RTOL)


def _batch_size(opt: Any, targets: Optional[Tensor], output: Any) -> Optional[int]:
    """The number of examples of the step's batch: the targets' first dimension, else the output's (a
    tensor's own, as the closure returned it: it may already be the selected one; else the
    ``output_selector``'s pick); None when neither is known."""
    if isinstance(targets, Tensor) and targets.dim() > 0:
        return int(targets.shape[0])
    out = output
    if output is not None and not isinstance(output, Tensor):
        try:
            out = opt.engine.select_output(output)
        except Exception:  # a selector that does not fit what the closure returned: nothing to tell
            return None
    return int(out.shape[0]) if isinstance(out, Tensor) and out.dim() > 0 else None
