"""One-shot curvature of a batch: ``curvature.compute(model, inputs, targets, ...)``."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .engine import CurvatureEngine
from .likelihoods import check_targets, outputs_finite
from .options import LossType, check_generator
from .result import Curvature
from .selection import ApproxSpec, SkipSpec
from .stacklevel import caller_stacklevel


#: the error for a 0-dim model output (the optimizers' too)
SCALAR_OUTPUT = ("the model output is a scalar, not a batch [N, ...]: a .squeeze() that dropped the batch dimension "
                 "of a batch of one (use .squeeze(-1)), or the loss selected instead of the logits (a Hugging Face "
                 "model called with labels= returns the loss first: output_selector=lambda out: out['logits'], "
                 "not out[0])")


def _check_inputs_match_model(model: nn.Module, args: Tuple[Tensor, ...]) -> None:
    """Floating inputs must be on the model's device and (outside autocast) in its dtype."""
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    if param is None:
        return
    for i, x in enumerate(args):
        if x.device != param.device:
            raise ValueError(f"inputs[{i}] is on {x.device} but the model's parameters are on {param.device}; "
                             "move them to the same device")
        if (x.is_floating_point() and x.dtype != param.dtype
                and not torch.is_autocast_enabled(param.device.type)):
            raise ValueError(f"inputs[{i}] has dtype {x.dtype} but the model's parameters are {param.dtype}; "
                             f"cast the inputs (x.to({param.dtype})) or run under torch.autocast")


def compute(model: nn.Module, inputs: Union[Tensor, Tuple[Tensor, ...]], targets: Tensor, *,
            loss: str = "cross_entropy", kind: str = "fisher", approx: ApproxSpec = "full",
            mc_samples: int = 1, generator: Optional[torch.Generator] = None,
            skip_modules: SkipSpec = None, output_selector: Optional[Callable[[Any], Tensor]] = None,
            kfac_approx: str = "expand") -> Curvature:
    """Curvature of the mean loss ``(1/N) Σ_n ℓ_n`` of ``model`` on one batch.

    Args:
        model: an ``nn.Module`` mapping ``inputs`` to outputs ``[N, C]`` (logits) or ``[N, ...]``.
        inputs: a tensor ``[N, ...]`` or a tuple of tensors passed as ``model(*inputs)``.
        targets: ``[N]`` class indices (cross_entropy), or the output's shape (mse; binary_cross_entropy:
            labels in ``[0, 1]``).
        loss: ``"cross_entropy"``, ``"mse"`` (½‖y − f‖²) or ``"binary_cross_entropy"`` (a Bernoulli on each
            logit, summed over an example's outputs; :mod:`curvature.likelihoods`).
        kind: ``"fisher" | "fisher_mc" | "empirical_fisher" | "hessian"``.
        approx: ``"full" | "diag" | "kfac"`` or a dict (see :mod:`curvature.selection`).
        mc_samples: sampled labels per example for ``fisher_mc``.
        generator: ``torch.Generator`` for the label sampling (None: torch's global generator). The model's
            forward runs as it is (in training mode its dropout draws from the global generator).
        skip_modules: module names (regex), class names or types to leave uncovered, each with
            its submodules.
        output_selector: maps the model's output to the tensor the loss is computed from, for
            models that return a tuple, dict or output object (e.g. ``lambda out: out[0]``).
        kfac_approx: ``"expand"`` (default) or ``"reduce"``: how K-FAC blocks of Linear-like layers
            treat positions ``T`` of ``[N, T, d]`` inputs (:class:`curvature.options.KFACApprox`).

    Returns:
        :class:`Curvature` with ``.blocks`` and ``.dense()``. The model's parameters, gradients and
        buffers are left as they were (a training-mode BatchNorm's running statistics too).
    """
    engine = CurvatureEngine(model, kind=kind, approx=approx, loss=loss, mc_samples=mc_samples,
                             skip_modules=skip_modules, output_selector=output_selector,
                             kfac_approx=kfac_approx)
    if torch.is_inference_mode_enabled():  # enable_grad() cannot lift it: no output would require a gradient
        raise RuntimeError("curvature.compute cannot run under torch.inference_mode(): it takes gradients of the "
                           "model; call it outside inference mode (under torch.no_grad() it works)")
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    if not all(isinstance(x, Tensor) for x in args):
        raise TypeError("inputs must be a Tensor or a tuple of Tensors")
    _check_inputs_match_model(model, args)
    check_generator(generator)
    check_targets(targets)
    # the model's buffers as they were (a training-mode BatchNorm's forward updates its running statistics):
    # compute() is an analysis call, it leaves the model as it found it
    # (each buffer by its module and name: a forward may also rebind one, `self.count = self.count + 1`)
    buffers = [(m, name, b, b.clone()) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    try:
        return _estimate(engine, model, args, targets, generator)
    finally:
        with torch.no_grad():
            for m, name, b, value in buffers:
                m._buffers[name] = b
                b.copy_(value)


def warn_if_class_layout_is_ambiguous(loss: LossType, outputs: Tensor, targets: Optional[Tensor]) -> None:
    """Warn where ``[N, C, H, W, ...]`` logits could be ``F.cross_entropy``'s layout (classes at dim 1) as well as
    the curvature's (classes last) because ``C`` equals the spatial sizes, so that the targets' shape fits both
    (``C = H = W``). The optimizers tell the two apart from the loss's gradient; ``compute`` has no loss of the
    user's to read. (Three dims, ``[N, T, C]`` with ``T = C``, are a sequence model's logits: no warning.)"""
    if loss is not LossType.CROSS_ENTROPY or targets is None or outputs.dim() < 4:
        return
    if tuple(targets.shape) == tuple(outputs.shape[:-1]) == tuple(outputs.shape[:1] + outputs.shape[2:]):
        warnings.warn(
            f"logits of shape {tuple(outputs.shape)} with targets {tuple(targets.shape)}: the classes are taken from "
            f"the last dimension ({outputs.shape[-1]} classes); if the model gives F.cross_entropy's layout with "
            "the classes at dim 1 ([N, C, H, W], a segmentation model), pass "
            "output_selector=lambda out: out.movedim(1, -1) (the shapes fit both layouts here)",
            UserWarning, stacklevel=caller_stacklevel())


def _estimate(engine: CurvatureEngine, model: nn.Module, args: Tuple[Tensor, ...], targets: Tensor,
              generator: Optional[torch.Generator]) -> Curvature:
    """:func:`compute`'s recorded forward and estimate."""
    # the estimate's backward passes run with the capture's hooks in place: a region under non-reentrant
    # activation checkpointing is recomputed then, and must repeat the recorded forward's ops
    with torch.enable_grad(), engine.capture() as cap:
        outputs = engine.select_output(model(*args))
        if outputs.dim() == 0:
            raise ValueError(SCALAR_OUTPUT)
        if outputs.shape[0] == 0:
            raise ValueError(f"the model ran on an empty batch (output of shape {list(outputs.shape)}); the "
                             "curvature of an empty batch is undefined")
        if outputs.is_floating_point() and not outputs_finite(engine.loss, outputs):
            bad = int((~torch.isfinite(outputs)).sum())
            raise ValueError(f"the model's output has {bad} non-finite (NaN/inf) entries of {outputs.numel()} (output "
                             f"of shape {list(outputs.shape)}{'; -inf logits of masked classes are fine' if engine.loss is LossType.CROSS_ENTROPY else ''}): the curvature "
                             "there is undefined; check the inputs and the parameters for NaN/inf")
        if targets is not None and targets.is_floating_point() and not bool(torch.isfinite(targets).all()):
            raise ValueError("targets has non-finite (NaN/inf) entries: the curvature there is undefined")
        if engine.output_selector is None:  # (a selector's pick is the layout its author meant)
            warn_if_class_layout_is_ambiguous(engine.loss, outputs, targets)
        blocks = engine.estimate(cap, outputs, targets, generator)
    bad = [name for name, blk in blocks.items() if not blk.is_finite()]
    if bad:  # an inf input a ReLU zeroes leaves the output finite, not the layer's statistics
        raise ValueError(f"the curvature of {', '.join(map(repr, bad))} is not finite (NaN/inf) although the output "
                         "is: a layer's input or output gradient is (an inf input that a later layer maps to a finite "
                         "output, or an overflow); check the inputs and the parameters for NaN/inf")
    return Curvature(blocks=blocks, layouts=engine.layouts, kind=engine.kind.value,
                     approx={n: a.value for n, a in engine.approx.items()})
