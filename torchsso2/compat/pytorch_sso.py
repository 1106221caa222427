"""PyTorch-SSO's optimizers on torchsso2: its signatures and config JSON, its numbers converted.

>>> from torchsso2.compat.pytorch_sso import SecondOrderOptimizer
>>> opt = SecondOrderOptimizer(model, "Fisher", {"Conv2d": "Kron", "Linear": "Kron"},
...                            {"damping": 1e-3, "ema_decay": 0.999}, lr=1e-3, momentum=0.9,
...                            fisher_args={"approx_type": "mc", "num_mc": 1})
>>> opt = from_config(json.load(open("lenet_kfac.json")), model)      # PyTorch-SSO's example configs

The returned objects are the native :class:`torchsso2.SecondOrderOptimizer` /
:class:`torchsso2.VIOptimizer` (subclasses), so ``step(closure)`` with a closure returning
``(loss, output)`` works as in PyTorch-SSO; the labels of ``'Fisher'`` are sampled inside
``step`` (no ``torchsso.get_closure_for_fisher`` needed).

What is converted is listed in :mod:`torchsso2.compat.sso_conventions`. Exact: curvature kinds,
``'Kron'`` blocks and the ``'Diag'`` of Linear and Conv2d weights, ``ema_decay``, K-FAC's factored
``√λ·π`` damping (both optimizers), ``l2_reg``, decoupled ``weight_decay`` (inside a buffer of
preconditioned gradients, after one of raw gradients, as there), VI's per-example ``damping`` /
``init_precision`` (with the prior's share of the damping averaged in from 0, as PyTorch-SSO's
``l2_reg_ema``) / ``prior_variance`` / ``kl_weighting``, a gradient EMA of the native momentum kind.
Approximate, with a logged warning: the other momentum kind (the same while the curvature is
constant). Different: the ``'Diag'`` of a Conv2d bias and of BatchNorm2d (exact here, approximated
there); a class absent from ``curv_shapes`` (a full block here; no working full shape there);
noisy K-FAC's weight noise. PyTorch-SSO draws ``U_G Z U_A`` with upper Cholesky factors
``UᵀU = (G + …)⁻¹``, ``(A + …)⁻¹``, whose G-side covariance is ``U_G U_Gᵀ``, not ``(G + …)⁻¹``;
here the noise has the posterior covariance the update assumes. No equivalent (NotImplementedError): ``lars``, ``normalizing_weights``,
``bias_correction``, ``use_max_ema``, ``use_sqrt_ema``, ``ema_decay=0``, ``acc_steps > 1``, ``non_reg_for_bn``,
KL warm-up, ``update_inv=False``, ``precondition_grad=False``; several processes (use the native faces).
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

from curvature.blocks import KFACBlock
from curvature.blocks.base import check_positive
from curvature.linalg import LinalgError, get_backend

from ..optim import NonFiniteError
from ..optim import SecondOrderOptimizer as _NativeSO
from ..optim import VIOptimizer as _NativeVI
from ..optim.routing import zero_block
from ..optim.validation import MAX_VI_SCALE, check_number
from ..optim.vi_start import isotropic_blocks
from . import sso_conventions as conv

logger = logging.getLogger(__name__)

#: the compat VIOptimizer's per-parameter state entry for the decoupled weight decay's share of PyTorch-SSO's
#: buffer of preconditioned gradients (the native momentum accumulates raw gradients)
DECAY_BUFFER = "sso_decay_buffer"

__all__ = ["SecondOrderOptimizer", "VIOptimizer", "from_config", "tracenorm_shifts", "tracenorm_damped_inverse",
           "tracenorm_damped_eigen"]


def tracenorm_shifts(blk: KFACBlock, damping: float, dtype: Optional[torch.dtype] = None
                     ) -> List[Tuple[Tensor, float]]:
    """PyTorch-SSO's K-FAC damping: ``√λ·π`` added to ``A``, ``√λ/π`` to ``G``, with
    ``π = √((tr A / d_A) / (tr G / d_G))`` (its ``pi_type='tracenorm'``); returns
    ``[(left factor, its shift), (right factor, its shift)]`` in the block's order."""
    a_left = blk.left is blk.A
    a, g = (f if dtype is None else f.to(dtype) for f in (blk.A, blk.G))
    ratio = float(((a.sum() if a.dim() == 1 else a.trace()) / a.shape[0])
                  / ((g.sum() if g.dim() == 1 else g.trace()) / g.shape[0]))
    pi = math.sqrt(ratio) if ratio > 0 and math.isfinite(ratio) else 1.0
    r = damping ** 0.5
    pairs = [(a, r * pi), (g, r / pi)]
    return pairs if a_left else pairs[::-1]


def tracenorm_damped_inverse(blk: KFACBlock, damping: float, backend: Optional[str] = None,
                             dtype: Optional[torch.dtype] = None) -> Dict[str, Any]:
    """``(A + √λ·π·I)⁻¹`` and ``(G + √λ/π·I)⁻¹`` (:func:`tracenorm_shifts`) as a
    ``method="inverse"`` decomposition of ``blk`` (its solve is ``L'⁻¹ M R'⁻¹``)."""
    inv = []
    for raw, (f, shift) in zip((blk.left, blk.right), tracenorm_shifts(blk, damping, dtype)):
        if f.dim() == 1:
            d = f + shift
            check_positive(d, f"K-FAC factor of {blk.layout.name!r}")
            inv.append(1.0 / d)
        else:  # the stored factor, cast by damped_inv: its round-off is judged by the stored dtype's eps
            inv.append(get_backend(backend).damped_inv(raw, shift, dtype=dtype))
    return {"method": "inverse", "linv": inv[0], "rinv": inv[1]}


def tracenorm_damped_eigen(blk: KFACBlock, damping: float, scale: float, backend: Optional[str] = None,
                           dtype: Optional[torch.dtype] = None) -> Dict[str, Any]:
    """``scale·(L + s_L·I) ⊗ (R + s_R·I)`` (:func:`tracenorm_shifts`) as a ``method="eigen"``
    decomposition of ``blk`` (solves and samples as the native eigen method, with no extra damping)."""
    parts = []
    for f, shift in tracenorm_shifts(blk, damping, dtype):
        if f.dim() == 1:
            parts.append((f + shift, None))
        else:
            evals, evecs = get_backend(backend).eigh(f, dtype=dtype)
            parts.append((evals.clamp_min(0.0) + shift, evecs))
    (el, ql), (er, qr) = parts
    denom = scale * torch.outer(el, er.to(el.dtype))
    check_positive(denom, f"K-FAC block {blk.layout.name!r}")
    return {"method": "eigen", "ql": ql, "qr": qr, "denom": denom}


def _decompose_factored(opt: Any, native: Callable[[], bool], factored: Callable[[KFACBlock], Dict[str, Any]]) -> bool:
    """``native()`` decomposes every block, then the K-FAC blocks get ``factored(block)``: PyTorch-SSO's
    factored damping. Those are computed first, so that a failure keeps every previous decomposition
    and follows ``on_nonfinite`` as the native decomposition does."""
    try:
        kfac = {n: factored(b) for n, b in opt.running.blocks.items() if isinstance(b, KFACBlock)}
    except LinalgError as err:
        if opt.on_nonfinite == "raise":
            raise NonFiniteError(f"decomposition failed at step {opt.num_steps}: {err}") from err
        opt.num_skipped += 1
        logger.warning("step %d: decomposition failed (%s); keeping the previous one", opt.num_steps, err)
        return False
    if not native():
        return False
    for name, dec in kfac.items():
        opt.running.blocks[name].decomposition = dec
    return True


def _single_process(opt: Any) -> None:
    if opt.comm.world_size != 1:
        raise NotImplementedError("torchsso2.compat.pytorch_sso runs in one process; with several, use the "
                                  "native torchsso2.SecondOrderOptimizer / VIOptimizer (docs/migrating.md)")


def _decay_decoupled(params: List[nn.Parameter], old: List[Tensor], lrs: List[float], wd: float,
                     states: Optional[List[Dict[str, Any]]] = None) -> None:
    """``θ ← θ − lr·wd·θ_old``, and ``buf += wd·θ_old`` where ``states`` are given and a momentum buffer
    took the step (PyTorch-SSO adds ``wd·θ`` to the preconditioned gradient before a momentum or
    gradient EMA of preconditioned gradients; after one of raw gradients)."""
    with torch.no_grad():
        for i, (p, o, lr) in enumerate(zip(params, old, lrs)):
            if states is not None and "momentum_buffer" in states[i]:
                states[i]["momentum_buffer"].add_(o, alpha=wd)
            p.add_(o, alpha=-lr * wd)


@contextlib.contextmanager
def _native_lr(opt: Any) -> Iterator[None]:
    """The groups' lr (PyTorch-SSO's, as set and scheduled by the user) times ``opt._lr_scale`` (``d`` of a
    gradient EMA, :func:`~torchsso2.compat.sso_conventions.momentum_settings`) inside the block, then the
    values the groups held put back as they were."""
    scale = opt._lr_scale
    if scale == 1.0:
        yield
        return
    held = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = g["lr"] * scale
    try:
        yield
    finally:
        for g, lr in zip(opt.param_groups, held):
            g["lr"] = lr


def _probabilities(output: Tensor) -> Tensor:
    """PyTorch-SSO's probabilities of a model output: ``softmax(·, dim=1)`` of ``[N, C]`` logits, the
    sigmoid of ``[N]`` (binary) logits; other shapes are a ValueError there and here."""
    if output.dim() == 2:
        return torch.softmax(output, dim=1)
    if output.dim() == 1:
        return torch.sigmoid(output)
    raise ValueError(f"prediction takes model outputs [N, C] (softmax) or [N] (sigmoid), as PyTorch-SSO's; got "
                     f"shape {tuple(output.shape)}; the native predict(x, num_samples) takes [N, T, C] logits too")


class _SSOGroups:
    """What the compat classes' checkpoints add: a mark that the groups' lr is PyTorch-SSO's (times
    ``_lr_scale`` inside each update, :func:`_native_lr`); a checkpoint without it was saved when the
    groups held the native ``lr·d`` under a gradient EMA, which is converted back on loading (``lr`` and an
    lr scheduler's ``initial_lr``; a scheduler's own state, ``base_lrs``, is the scheduler's to convert)."""

    _lr_scale: float
    param_groups: List[Dict[str, Any]]
    groups_lr = "pytorch-sso"

    def _extra_state(self) -> Dict[str, Any]:
        return {**super()._extra_state(), "groups_lr": "pytorch-sso", "lr_scale": self._lr_scale}  # type: ignore[misc]

    def _load_extra_state(self, state: Dict[str, Any]) -> None:
        super()._load_extra_state(state)  # type: ignore[misc]
        if state.get("groups_lr") != "pytorch-sso" and self._lr_scale != 1.0:
            for g in self.param_groups:
                for key in ("lr", "initial_lr"):  # initial_lr: an lr scheduler's start, kept in the groups
                    if key in g:
                        g[key] = g[key] / self._lr_scale


class SecondOrderOptimizer(_SSOGroups, _NativeSO):
    """PyTorch-SSO's ``SecondOrderOptimizer(model, curv_type, curv_shapes, curv_kwargs, ...)``.

    Its arguments and defaults (``momentum=0``, ``momentum_type='preconditioned'``, ...), plus
    ``fisher_args`` (its example's ``{"approx_type": "mc", "num_mc": 1}``). See the module doc."""

    def __init__(self, model: nn.Module, curv_type: str, curv_shapes: Optional[Mapping[str, str]],
                 curv_kwargs: Optional[Mapping[str, Any]], lr: float = 0.01, momentum: float = 0.,
                 momentum_type: str = "preconditioned", grad_ema_decay: float = 1., grad_ema_type: str = "raw",
                 l2_reg: float = 0., weight_decay: float = 0., normalizing_weights: bool = False,
                 weight_scale: Optional[float] = None, acc_steps: int = 1, non_reg_for_bn: bool = False,
                 bias_correction: bool = False, lars: bool = False, lars_type: str = "preconditioned",
                 update_inv: bool = True, precondition_grad: bool = True,
                 fisher_args: Optional[Mapping[str, Any]] = None, **native: Any) -> None:
        conv.check_native_keywords(native, "SecondOrderOptimizer",
                                   ("curvature", "approx", "damping", "kfac_method", "ema_decay", "mc_samples"))
        conv.reject_unsupported(lars=lars, normalizing_weights=normalizing_weights, bias_correction=bias_correction,
                                non_reg_for_bn=non_reg_for_bn)
        conv.check_acc_steps(acc_steps)
        if not update_inv:
            raise NotImplementedError("update_inv=False has no equivalent; use inv_update_interval=<large> instead")
        if not precondition_grad:
            raise NotImplementedError("precondition_grad=False is plain SGD: use torch.optim.SGD")
        for name, v in (("l2_reg", l2_reg), ("weight_decay", weight_decay)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}={v!r} must be a number >= 0")
        kind, mc = conv.curvature_kind(curv_type, fisher_args)
        conv.check_hessian_shapes(kind, curv_shapes)
        ema_decay, damping, _ = conv.curvature_settings(curv_kwargs)
        momentum_given = momentum
        self._lr_scale, momentum = conv.momentum_settings(momentum, momentum_type, grad_ema_decay, grad_ema_type,
                                                          native="preconditioned")
        self.decoupled_weight_decay = float(weight_decay)
        # in the buffer of preconditioned gradients: the native momentum
        self._decay_in_buffer, self._decay_lr_factor = conv.decay_placement(momentum_given, momentum_type,
                                                                            grad_ema_decay, grad_ema_type)
        native.setdefault("kl_clip", None)  # PyTorch-SSO has no KL clip (the native default clips)
        super().__init__(model, lr=lr, momentum=momentum, weight_decay=float(l2_reg), curvature=kind,
                         approx=conv.approx_map(model, curv_shapes), damping=damping + float(l2_reg),
                         kfac_method="inverse", ema_decay=ema_decay, mc_samples=mc, **native)
        conv.check_implied_full(self, curv_shapes)
        _single_process(self)

    def _decompose(self, damping: float, scale: float = 1.0) -> bool:
        native = super()._decompose
        return _decompose_factored(self, lambda: native(damping, scale),
                                   lambda b: tracenorm_damped_inverse(b, damping, self.linalg, self.decomposition_dtype))

    @torch.no_grad()
    def _apply_update(self, params: List[nn.Parameter], groups: List[Dict[str, Any]]) -> bool:
        wd = self.decoupled_weight_decay
        old = [p.detach().clone() for p in params] if wd else []
        with _native_lr(self):
            if not super()._apply_update(params, groups):
                return False
        if wd:
            _decay_decoupled(params, old, [g["lr"] * self._decay_lr_factor for g in groups], wd,
                             [self.state[p] for p in params] if self._decay_in_buffer else None)
        return True


class VIOptimizer(_SSOGroups, _NativeVI):
    """PyTorch-SSO's ``VIOptimizer(model, dataset_size, curv_type, curv_shapes, curv_kwargs, ...)``
    (VOGN, noisy K-FAC). See the module doc for what is converted."""

    def __init__(self, model: nn.Module, dataset_size: float, curv_type: str,
                 curv_shapes: Optional[Mapping[str, str]], curv_kwargs: Optional[Mapping[str, Any]],
                 lr: float = 0.01, momentum: float = 0., momentum_type: str = "preconditioned",
                 grad_ema_decay: float = 1., grad_ema_type: str = "raw", weight_decay: float = 0.,
                 normalizing_weights: bool = False, weight_scale: Optional[float] = None, acc_steps: int = 1,
                 non_reg_for_bn: bool = False, bias_correction: bool = False, lars: bool = False,
                 lars_type: str = "preconditioned", num_mc_samples: int = 10, val_num_mc_samples: int = 10,
                 kl_weighting: float = 1, warmup_kl_weighting_init: float = 0.01,
                 warmup_kl_weighting_steps: Optional[int] = None, prior_variance: float = 1,
                 init_precision: Optional[float] = None, seed: int = 1, total_steps: int = 1000,
                 fisher_args: Optional[Mapping[str, Any]] = None, **native: Any) -> None:
        conv.check_native_keywords(native, "VIOptimizer", ("curvature", "approx", "damping", "ema_decay", "mc_samples"))
        branch = conv.branch_vi_keys({**native, "prior_variance": prior_variance, "init_precision": init_precision},
                                     prior_variance_default=1)  # the continual-learning branch's keywords
        prior_variance, init_precision = branch.pop("prior_variance"), branch.pop("init_precision")
        native = branch
        conv.reject_unsupported(lars=lars, normalizing_weights=normalizing_weights, bias_correction=bias_correction,
                                non_reg_for_bn=non_reg_for_bn, warmup_kl_weighting_steps=warmup_kl_weighting_steps)
        conv.check_acc_steps(acc_steps)
        if prior_variance is not None:
            prior_variance = check_number("prior_variance", prior_variance)
        kl_weighting = check_number("kl_weighting", kl_weighting)
        if init_precision is not None:
            init_precision = check_number("init_precision", init_precision, high=MAX_VI_SCALE)  # as the native
        if not prior_variance or prior_variance < 0:
            raise NotImplementedError(f"prior_variance={prior_variance!r}: PyTorch-SSO then samples no noise "
                                      "(a point estimate); use the compat SecondOrderOptimizer instead")
        if not isinstance(weight_decay, (int, float)) or isinstance(weight_decay, bool) or weight_decay < 0:
            raise ValueError(f"weight_decay={weight_decay!r} must be a number >= 0")
        n = int(dataset_size)
        if n != dataset_size or n < 1:
            raise ValueError(f"dataset_size={dataset_size!r} must be a whole number >= 1")
        kind, mc = conv.curvature_kind(curv_type, fisher_args)
        ema_decay, damping, _ = conv.curvature_settings(curv_kwargs)
        momentum_given = momentum
        self._lr_scale, momentum = conv.momentum_settings(momentum, momentum_type, grad_ema_decay, grad_ema_type,
                                                          native="raw")
        approx = conv.approx_map(model, curv_shapes)
        self.decoupled_weight_decay = float(weight_decay)
        # in the buffer of preconditioned gradients: its own (DECAY_BUFFER) beside the native momentum of raw
        # gradients, with the native momentum and lr
        self._decay_in_buffer, self._decay_lr_factor = conv.decay_placement(momentum_given, momentum_type,
                                                                            grad_ema_decay, grad_ema_type)
        if not isinstance(val_num_mc_samples, int) or isinstance(val_num_mc_samples, bool) or val_num_mc_samples < 0:
            raise ValueError(f"val_num_mc_samples={val_num_mc_samples!r} must be an int >= 0 (0: the mean weights)")
        self.val_num_mc_samples = val_num_mc_samples  # PyTorch-SSO's default of predict(); pass num_samples here
        self._prior_ramp = False  # set by _start_at (init_precision): see precision_shift
        # PyTorch-SSO: no KL clip, and the curvature average starts at the first batch (or init_precision)
        native.setdefault("kl_clip", None)
        native.setdefault("curvature_init", None)
        super().__init__(model, n, lr=lr, curvature=kind, approx=approx, prior_variance=float(prior_variance),
                         num_mc_samples=num_mc_samples, kl_weighting=float(kl_weighting), momentum=momentum,
                         ema_decay=ema_decay, damping=damping * n, mc_samples=mc, seed=seed, **native)
        conv.check_implied_full(self, curv_shapes)
        _single_process(self)
        if init_precision is not None:
            self._start_at(float(init_precision))

    def prediction(self, data: Tensor, mc: Optional[int] = None, keep_probs: bool = False) -> Any:
        """PyTorch-SSO's ``prediction``: the mean over ``mc`` posterior samples (default
        ``val_num_mc_samples``) of ``softmax(model(data))``; ``mc=0`` evaluates at the posterior mean.
        With ``keep_probs`` also the list of per-sample probabilities. Native: :meth:`predict`."""
        n = self.val_num_mc_samples if mc is None else mc
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"mc={n!r} must be an int >= 0")
        with torch.no_grad():
            if n == 0:
                probs = [_probabilities(self.engine.select_output(self.model(data)))]
            elif not self._has_posterior():
                raise RuntimeError(f"prediction(mc={n}) before the first step needs init_precision (the posterior's "
                                   "starting precision; without it there is nothing to sample yet): pass "
                                   "init_precision=..., take a step first, or use mc=0 (the mean weights)")
            else:  # one generator for the n draws (sampled_params() alone redraws the same sample at one step)
                gen, probs = self.sampling_generator(), []
                for _ in range(n):
                    with self.sampled_params(generator=gen):
                        probs.append(_probabilities(self.engine.select_output(self.model(data))))
        mean = torch.stack(probs).mean(0)
        return (mean, probs) if keep_probs else mean

    def _start_at(self, init_precision: float) -> None:
        """The curvature EMA starts at ``init_precision·I`` (per example), as PyTorch-SSO's
        ``element_wise_init``; the first batch is then folded in with the EMA weights."""
        if init_precision < 0:
            raise ValueError(f"init_precision={init_precision!r} must be >= 0")
        # diag init·1, full init·I, K-FAC √init·I ⊗ √init·I (a diagonal factor as a vector of √init: Embedding's A)
        zeros = {name: zero_block(lay, self.engine.approx[name]) for name, lay in self.engine.layouts.items()}
        blocks = isotropic_blocks(zeros, init_precision)
        self.running.update(blocks, 0.0)
        self._prior_ramp = True
        self._decompose(self.precision_shift, scale=float(self.dataset_size))

    @property
    def precision_shift(self) -> float:
        """``τδ·(1 − ema_decay^t) + damping`` after ``t`` curvature updates when the curvature started at
        ``init_precision`` (else native: ``τδ + damping``): PyTorch-SSO's curvature then starts with its
        prior term ``l2 = τ/(Nσ²)`` at 0 (it is set after ``element_wise_init``) and averages it in with the
        curvature's EMA weights, so the first weight noise has no prior in its precision. The prior's
        gradient ``l2·μ`` is whole from the first step, as there."""
        shift = super().precision_shift
        if not self._prior_ramp:
            return shift
        updates = max(0, self.running.num_updates - 1)  # 0 also for a state loaded from before any update
        return shift - self.kl_weighting * self.prior_precision * self.ema_decay ** updates

    def _decompose(self, damping: float, scale: float = 1.0) -> bool:
        """Noisy K-FAC as PyTorch-SSO: ``Λ = N·(A + √λ'π)⊗(G + √λ'/π)`` with the per-example
        ``λ' = damping/N`` (its ``damping + l2``, ``l2 = τ/(Nσ²)``); other blocks as native."""
        native = super()._decompose
        return _decompose_factored(self, lambda: native(damping, scale),
                                   lambda b: tracenorm_damped_eigen(b, damping / scale, scale, self.linalg,
                                                                    self.decomposition_dtype))

    def _update_mean(self, params: List[nn.Parameter], groups: List[Dict[str, Any]], grads: List[Tensor]) -> None:
        wd = self.decoupled_weight_decay
        old = [p.detach().clone() for p in params] if wd else []
        with _native_lr(self):
            super()._update_mean(params, groups, grads)
        if not wd:
            return
        if not self._decay_in_buffer:
            _decay_decoupled(params, old, [g["lr"] * self._decay_lr_factor for g in groups], wd)
            return
        with torch.no_grad():  # D ← momentum·D + wd·θ_old, θ ← θ − lr·D (the decay's share of the buffer)
            for p, o, g in zip(params, old, groups):
                state = self.state[p]
                buf = state.get(DECAY_BUFFER)
                if buf is None:
                    buf = state[DECAY_BUFFER] = torch.zeros_like(o)
                elif buf.dtype != o.dtype or buf.device != o.device:  # the model moved (model.double(), .to())
                    buf = state[DECAY_BUFFER] = buf.to(o)
                buf.mul_(g["momentum"]).add_(o, alpha=wd)
                p.add_(buf, alpha=-g["lr"] * self._decay_lr_factor)


def from_config(config: Mapping[str, Any], model: nn.Module, dataset_size: Optional[int] = None,
                **native: Any) -> Any:
    """The optimizer of a PyTorch-SSO example config (``examples/classification/configs/*.json``,
    parsed): ``optim_name``, ``optim_args``, ``curv_args``, ``fisher_args``. ``dataset_size`` is
    needed for ``VIOptimizer``; ``SGD``/``Adam`` configs build the torch optimizer. The VI keys of
    PyTorch-SSO's ``continual-learning`` branch are taken with that branch's meaning: ``prior_precision``
    as ``prior_variance = 1/prior_precision``, ``init_prec_ema`` as ``init_precision``, ``prior_mean`` 0
    (else NotImplementedError). That branch draws no weight noise for a scalar ``prior_precision`` (its
    ``std_scale`` is 0); here the posterior is sampled as on ``master``. The ``Distributed*`` configs run
    on several processes, which the compat faces do not: a ValueError points to the native ones."""
    name = config.get("optim_name")
    args = dict(config.get("optim_args") or {})
    curv = config.get("curv_args") or {}
    fisher = config.get("fisher_args")
    if name == "SecondOrderOptimizer":
        return SecondOrderOptimizer(model, args.pop("curv_type"), args.pop("curv_shapes", None), curv,
                                    fisher_args=fisher, **args, **native)
    if name == "VIOptimizer":
        if dataset_size is None:
            raise ValueError("a VIOptimizer config needs dataset_size (the number of training examples)")
        args = conv.branch_vi_keys(args)  # the continual-learning branch's keys
        return VIOptimizer(model, dataset_size, args.pop("curv_type"), args.pop("curv_shapes", None), curv,
                           fisher_args=fisher, **args, **native)
    if name in ("SGD", "Adam", "AdamW"):
        return getattr(torch.optim, name)(model.parameters(), **args)
    if name in ("DistributedSecondOrderOptimizer", "DistributedVIOptimizer"):
        raise ValueError(
            f"optim_name={name!r}: the compat optimizers run in one process; for several processes (mpiexec, "
            f"torchrun) build the native torchsso2.{name[len('Distributed'):]} (every rank averages gradients and "
            "curvature; docs/scaling.md), converting the numbers as docs/migrating.md's table does")
    raise ValueError(f"optim_name={name!r}; expected 'SecondOrderOptimizer', 'VIOptimizer', 'SGD' or 'Adam'")
