"""The Levenberg–Marquardt rule's loss after the update by one forward, without the user's closure.

The LM rule (:class:`torchsso2.optim.damping.LMDamping`) compares the change of the batch loss
after the update with the quadratic model's prediction. It calls the closure again for the new
loss: a forward and a backward whose gradients nobody reads (digits MLP at batch 128: ~0.35 ms;
digits CNN: ~1.7 ms, every ``damping_adaptation_interval`` steps).

In adaptive mode the closure's forward is recorded (:class:`torchsso2.optim.adaptive.InputRecorder`).
When the step is also given the batch's ``targets``, the closure returned the recorded forward's
own output (or the loss alone: the output is then that forward's, :mod:`.closure_output`) and its
loss is the model's mean negative log-likelihood of them (checked on that output: equal to rounding), the loss after the update is that same function of one forward of
the recorded input, without autograd: the same value as the closure's (to rounding: cross-entropy
over fewer than 16 classes takes the faster log-softmax of :func:`_mean_nll`), at the cost of a
forward (for a plain ``nn.Sequential``: :func:`torchsso2.optim.sequential_jvp.sequential_forward`). The
forward draws the random numbers the closure's forward drew (the LM step replays the RNG states the
recorded forward saw: its dropout masks; the closure's backward draws none); the
buffers it updates (BatchNorm statistics) are put back after either evaluation
(:meth:`~torchsso2.optim.second_order.SecondOrderOptimizer`'s LM step). Unlike the closure it leaves the gradients (``p.grad``) at the
step's own gradients.

Anywhere else (no targets, several forwards in the closure, a loss with other terms, an output
in another dtype than the parameters, e.g. under autocast) the closure is called as before.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from curvature.likelihoods import FEW_CLASSES, check_outputs_targets, mean_nll
from curvature.options import LossType
from curvature.stacklevel import caller_stacklevel

from . import sequential_jvp
from .adaptive import output_versions

logger = logging.getLogger(__name__)

#: relative tolerance of the check that the closure's loss is the mean NLL of its output and the
#: targets (float32 rounding of a mean over a batch is ~1e-7 relative)
LOSS_MATCH_RTOL = 1e-5


def forward_only_closure(opt: Any, targets: Optional[Tensor], loss: Any, output: Any
                         ) -> Optional[Callable[[], Tuple[Tensor, Tensor]]]:
    """A closure returning ``(loss, output)`` at the current parameters by one forward (no grad) of
    the step's recorded input, or None where it would not equal the user's closure (module
    docstring). ``opt``: a :class:`SecondOrderOptimizer` in adaptive mode after its closure ran;
    ``loss``, ``output``: the closure's loss at this step and its output (the model's, for a closure
    returning the loss alone). With several processes every
    rank takes the same way (one all-reduce of a flag): a closure called on some ranks only could
    wait for a collective of the others (a DDP backward)."""
    recorder = opt.adaptive.recorder if opt.adaptive is not None else None
    ok = recorder is not None and _matches(opt, recorder, targets, loss, output)
    if opt.comm.world_size > 1:
        ok = opt._every_rank(ok)
    if not ok:
        return None
    assert recorder is not None and targets is not None
    args, kwargs, _ = recorder.calls[0]
    engine = opt.engine

    def closure() -> Tuple[Tensor, Tensor]:
        with torch.no_grad():
            if sequential_jvp.supports(opt.model, args, kwargs):  # a plain nn.Sequential: the faster forward
                out = sequential_jvp.sequential_forward(opt.model, args[0])
            else:
                out = opt.model(*args, **kwargs)
            return _mean_nll(engine.loss, engine.select_output(out), targets), out
    return closure


def _mean_nll(loss: LossType, outputs: Tensor, targets: Tensor) -> Tensor:
    """:func:`curvature.likelihoods.mean_nll`; cross-entropy of [N, C] logits with fewer than
    :data:`curvature.likelihoods.FEW_CLASSES` classes on CPU by the log-softmax over a leading dimension
    (of the transposed view; as :func:`curvature.likelihoods.class_softmax` for the softmax): torch's
    last-dimension kernel has no vector path for so few classes (digits
    [128, 10]: ~27 µs -> ~10 µs). The same value up to rounding (the order of the sum over classes)."""
    if loss is LossType.CROSS_ENTROPY and outputs.dim() == 2 and outputs.device.type == "cpu" \
            and outputs.shape[1] < FEW_CLASSES and outputs.is_floating_point():
        return F.nll_loss(torch.log_softmax(outputs.t(), 0).t(), targets.long())
    return mean_nll(loss, outputs, targets)


def closure_loss_and_nll(opt: Any, recorder: Any, targets: Optional[Tensor], loss: Any, output: Any
                         ) -> Optional[Tuple[float, float]]:
    """``(closure's loss, mean NLL of its output and targets)`` when the closure ran the model once and
    returned that forward's output, or the ``output_selector``'s pick of it (``return loss, out["logits"]``: the
    same tensor, or the same view of it), in the parameters' dtype and not changed in place since the forward;
    None where that cannot be told (no targets, several forwards, targets that do not fit the output)."""
    if not isinstance(targets, Tensor) or len(recorder.calls) != 1 or len(recorder.outputs) != 1:
        return None
    model_output = recorder.outputs[0]
    if model_output is not output and not _is_pick(opt.engine, model_output, output):
        return None
    if recorder.versions and output_versions(model_output) != recorder.versions[0]:
        return None  # changed in place in the closure (a temperature, a mask): not what a forward of the input gives
    if recorder.autocast and recorder.autocast[0]:
        return None  # run under autocast (a model upcasting its logits passes the dtype test), the forward outside it
    return loss_and_nll(opt, targets, loss, model_output, model_output=True)


def _is_pick(engine: Any, model_output: Any, output: Any) -> bool:
    """Whether ``output`` (what a closure returned) is ``engine``'s ``output_selector`` pick of ``model_output``:
    that tensor, or a view of the same memory with the same shape, strides and dtype (``out.reshape(-1, C)``
    taken again in the closure)."""
    if engine.output_selector is None or not isinstance(output, Tensor):
        return False
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            pick = engine.select_output(model_output)
        except Exception:  # a selector that does not fit the model's output here: not its pick
            return False
    return isinstance(pick, Tensor) and (pick is output or (
        pick.data_ptr() == output.data_ptr() and pick.shape == output.shape and pick.stride() == output.stride()
        and pick.dtype == output.dtype and pick.device == output.device))


def returned_pick(engine: Any, output: Any, targets: Tensor) -> Tensor:
    """The tensor the loss is computed from, of the output a closure returned: the ``output_selector``'s pick
    of the model's output, or the returned tensor itself where the closure returned that pick already (the
    selector raises on it, or its pick does not fit ``targets`` while the tensor does). A selector that also
    fits its own pick (``o[:, 1:]``) is applied to it: the first of :func:`returned_candidates`."""
    return returned_candidates(engine, output, targets)[0]


def returned_candidates(engine: Any, output: Any, targets: Tensor) -> List[Tensor]:
    """What the loss may be computed from, of the output a closure returned (:func:`returned_pick`'s rule),
    the selector's pick first: both the pick and the returned tensor where both fit ``targets`` (a selector
    that also fits its own pick, ``o[:, 1:]``: the closure may have returned either). The attempt is quiet:
    torch warns about ``tensor["logits"]`` before it raises (only the first step's checks try it)."""
    if engine.output_selector is None or not isinstance(output, Tensor):
        return [engine.select_output(output)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            picked = engine.select_output(output)
        except (RuntimeError, ValueError, IndexError, KeyError, TypeError, AttributeError):
            return [output]

    def fits(t: Tensor) -> bool:
        try:
            check_outputs_targets(engine.loss, t, targets)
        except (RuntimeError, ValueError, IndexError, TypeError):
            return False
        return True
    if not fits(picked):
        return [output] if fits(output) else [picked]
    return [picked, output] if picked is not output and fits(output) else [picked]


def loss_and_nll(opt: Any, targets: Optional[Tensor], loss: Any, output: Any, model_output: bool = False
                 ) -> Optional[Tuple[float, float]]:
    """``(loss, mean NLL of output and targets)`` under ``opt``'s likelihood (``loss=``, its
    ``output_selector``); None where that cannot be told (no targets, an output that is not a tensor
    of the parameters' dtype, a loss of more than one element, targets that do not fit the output).
    ``output``: what the closure returned (:func:`returned_candidates`: where it may be the selector's pick
    or the tensor the pick is taken of, the mean NLL nearer the loss), or with ``model_output`` the model's
    own output (its selector's pick is taken)."""
    if not isinstance(targets, Tensor) or not isinstance(loss, Tensor) or loss.numel() != 1:
        return None
    engine = opt.engine
    value = float(loss.detach())
    with torch.no_grad():
        try:
            candidates = [engine.select_output(output)] if model_output else \
                returned_candidates(engine, output, targets)
        except Exception:  # a selector that does not fit what the closure returned: nothing to tell
            return None
        refs = []
        for selected in candidates:
            if selected.dtype not in (torch.float32, torch.float64) \
                    or any(p.dtype != selected.dtype for g in opt.param_groups for p in g["params"]):
                return None  # (half precision: the two computations' rounding alone differs by up to 1%)
            try:
                # the output of the batch the targets are of: a micro-batch's output broadcasts against the
                # whole batch's regression targets ([1, D] against [N, D]) without an error
                check_outputs_targets(engine.loss, selected, targets)
                refs.append(float(_mean_nll(engine.loss, selected, targets)))
            except (RuntimeError, ValueError, IndexError, TypeError):  # targets that do not fit the output
                pass
    if not refs:
        return None
    return value, min(refs, key=lambda ref: abs(ref - value))


def nll_description(loss: LossType) -> str:
    """What the mean NLL of ``loss=`` is, for the loss-scale warnings."""
    if loss is LossType.BINARY_CROSS_ENTROPY:
        return ("F.binary_cross_entropy_with_logits summed over an example's outputs, mean over the examples: "
                "reduction='mean' for one output per example, reduction='sum' divided by N for several (their "
                "reduction='mean' is 1/D of it for D outputs per example)")
    return "½·Σ over the outputs, mean over the examples" if loss is LossType.MSE \
        else "F.cross_entropy with reduction='mean'"


def warn_if_loss_is_not_the_nll(opt: Any, targets: Optional[Tensor], loss: Any, output: Any, who: str,
                                consequence: str, rtol: float, recorder: Any = None) -> bool:
    """Warn when the closure's ``loss`` differs from the mean NLL of its ``output`` and ``targets`` by more
    than ``rtol`` relative (``who``: the warning's subject; ``consequence``: what the difference does).
    ``recorder``: the model calls the closure made, when known (then its one forward's output only,
    :func:`closure_loss_and_nll`). Returns whether it could tell (False: nothing compared,
    :func:`loss_and_nll`)."""
    pair = loss_and_nll(opt, targets, loss, output) if recorder is None else \
        closure_loss_and_nll(opt, recorder, targets, loss, output)
    if pair is None:
        return False
    value, ref = pair
    if abs(value - ref) > rtol * max(abs(ref), 1e-12):
        ratio = f"{value / ref:.4g}×" if ref else "not"
        warnings.warn(f"{who}: the closure's loss ({value:.6g}) is {ratio} the mean negative log-likelihood of its "
                      f"output and the targets ({ref:.6g}; loss={opt.engine.loss.value!r}: "
                      f"{nll_description(opt.engine.loss)}; label smoothing, "
                      f"class weights, mixup or an added term make the two differ too). {consequence}",
                      UserWarning, stacklevel=caller_stacklevel())
    return True


def _matches(opt: Any, recorder: Any, targets: Optional[Tensor], loss: Any, output: Any) -> bool:
    """True when the closure ran the model once, returned that forward's output (in the parameters'
    dtype) and a loss equal to the mean NLL of it and ``targets``."""
    pair = closure_loss_and_nll(opt, recorder, targets, loss, output)
    if pair is None:
        return False
    value, ref = pair
    if not abs(ref - value) <= LOSS_MATCH_RTOL * max(1.0, abs(value)):
        logger.debug("LM rule: the closure's loss %.8g is not the mean NLL of its output (%.8g); "
                     "it is called again", value, ref)
        return False
    return True


#: relative difference between the closure's loss and the mean NLL beyond which adaptive mode warns
LOSS_SCALE_WARN_RTOL = 1e-3


def warn_if_not_mean_nll(opt: Any, targets: Optional[Tensor], loss: Any, output: Any) -> None:
    """Warn (once per optimizer) when an adaptive learning rate is given ``targets`` and the closure's
    loss is not the mean NLL of its output: the quadratic model takes the curvature of the mean NLL and
    the gradient of the closure's loss, so a loss ``c``× the mean NLL (``F.mse_loss``'s mean over the D
    outputs per example: ``2/D``; ``reduction="sum"``: ``N``) makes the adaptive step ``c``× the model's
    minimiser."""
    if opt.__dict__.get("_loss_scale_checked") or opt.adaptive is None or not opt.adaptive.learning_rate:
        return
    if warn_if_loss_is_not_the_nll(
            opt, targets, loss, output, "adaptive learning rate",
            "The quadratic model takes the curvature of the mean NLL and the gradient of the closure's loss, so a "
            "scaled loss (F.mse_loss: 2/D for D outputs per example; reduction='sum': N) scales the adaptive step "
            "by the same factor, and a term the loss adds (another head's or an auxiliary loss) has a gradient but "
            "no curvature in the model, whose solved step may overshoot it; return the mean NLL of the output from "
            "the closure (weight decay as the param group's weight_decay, which the model includes), or leave "
            "adaptive mode (a fixed lr and momentum) for a multi-task loss",
            LOSS_SCALE_WARN_RTOL, recorder=opt.adaptive.recorder):
        opt._loss_scale_checked = True
