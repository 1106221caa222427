"""SecondOrderOptimizer: natural-gradient training over any curvature kind and shape.

Update, per step (each a small function of :mod:`torchsso2.optim.steps`)::

    d  = g + weight_decay·θ                       # g: gradient of the mean loss (averaged over ranks)
    Δ  = (C + damping·I)⁻¹ d                      # per curvature block; uncovered params: Δ = d
                                                  # (kfac_method="inverse": (G + λI)⁻¹ ⊗ (A + λI)⁻¹ for K-FAC)
    Δ ← ν·Δ,  ν = min(1, sqrt(kl_clip / Σ lr² Δᵀd))     # KL clip (default 1e-3/√inv_update_interval;
                                                        # kl_clip=None: off; lr per group)
    buf = momentum·buf + Δ;   θ ← θ − lr·buf

``C`` is the chosen curvature (EMA over steps with ``ema_decay``), re-estimated every
``curv_update_interval`` steps and re-decomposed every ``inv_update_interval`` steps.
"""
from __future__ import annotations

import contextlib
import logging
import math
import numbers
import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from curvature.blocks import DiagBlock, FullBlock
from curvature.blocks.base import owned_all_finite
from curvature.likelihoods import check_targets
from curvature.options import Kind, LossType
from curvature.stacklevel import caller_stacklevel

from .settings import CurvatureSettings
from .skips import DEFAULT_MAX_CONSECUTIVE_SKIPS
from .adaptive import AdaptiveCoefficients, adaptive_step, decay_term, param_names, replayed_rng, rng_states
from .loss_scale import warn_if_gradient_is_not_the_nll
from .lm_forward import LOSS_SCALE_WARN_RTOL, forward_only_closure, warn_if_loss_is_not_the_nll, warn_if_not_mean_nll
from .rollback import CurvatureRollback
from .update_undo import UpdateUndo
from .redamp import redamp
from .base import Closure, CurvatureOptimizer
from .damping import DEFAULT_MIN_DAMPING, LMDamping, per_adjustment_decay
from .legacy import check_not_pytorch_sso_call
from .lowrank import LowRankSolver, low_rank_seed
from .misuse import NO_BACKWARD, warn_ignored_schedule, warn_unreached_blocks
from .plan import PartialBlock, UpdatePlan
from .changed_model import explains_changed_model
from .precision import full_precision_step
from .clipped_update import clip_scale
from .fused_momentum import scaled_momentum_step_
from .steps import add_weight_decay
from .validation import MAX_LR, MAX_STEPS, check_choice, check_int, check_number, unpack_closure_result

logger = logging.getLogger(__name__)

#: adaptive_damping's second closure call with a closure that unscales (torch allows one unscale_ per update)
LM_UNSCALE_IN_CLOSURE = (
    "adaptive_damping calls the closure a second time, after the update, to measure the loss change, and torch "
    "allows one scaler.unscale_(opt) per scaler.update(): with a grad_scaler and adaptive_damping, do not unscale "
    "in the closure (step unscales the gradients itself; to clip, use clip_grad_norm_ on the scaled gradients "
    "with max_norm times scaler.get_scale())")

#: per-module-type shapes used when ``approx`` is not given (PyTorch-SSO's choice)
DEFAULT_APPROX = {nn.Linear: "kfac", nn.Conv1d: "kfac", nn.Conv2d: "kfac", nn.Conv3d: "kfac",
                  nn.ConvTranspose1d: "kfac", nn.ConvTranspose2d: "kfac", nn.ConvTranspose3d: "kfac",
                  nn.Embedding: "kfac",
                  nn.BatchNorm1d: "diag", nn.BatchNorm2d: "diag", nn.BatchNorm3d: "diag", nn.LayerNorm: "diag",
                  nn.GroupNorm: "diag", nn.InstanceNorm1d: "diag", nn.InstanceNorm2d: "diag", nn.InstanceNorm3d: "diag",
                  nn.RMSNorm: "diag"}


#: Default Tikhonov damping. A one-batch curvature estimate (the first steps, and fisher_mc's single
#: sampled label) has many tiny eigenvalues; with λ = 1e-3 their directions get steps ~1000× the
#: gradient and the digits MLP diverged (loss 3088 with lr 0.01). λ = 0.1 bounds the step by
#: ``lr·|g|/λ`` along poorly estimated directions while still rescaling the well-estimated ones;
#: on the digits MLP and README's quick-tour model it trains at least as well as SGD with the
#: same lr for lr in {0.01, 0.03, 0.1}, K-FAC and diagonal (tests/test_defaults.py).
DEFAULT_DAMPING = 0.1

#: Default KL clip (kfac_pytorch's default). It bounds the size of each preconditioned step
#: whatever lr and damping are, so a large lr or a small damping shrinks the step instead of
#: diverging (the K-FAC robustness grid: no point diverges with it; without it 4 of 9 do).
DEFAULT_KL_CLIP = 1e-3


def default_kl_clip(inv_update_interval: Any) -> float:
    """The KL clip used when ``kl_clip`` is not passed: ``DEFAULT_KL_CLIP / √inv_update_interval``.

    One decomposition of the curvature serves ``inv_update_interval`` steps; the longer it is
    reused, the further the parameters move from where it was estimated, and the less its
    quadratic model can be trusted, so each step is bounded more tightly. Measured on issue 30's
    grid (digits MLP, batch 512, momentum 0.9, curvature/inverse intervals 10/100, lr ×
    damping 3 × 3, 3 seeds, 60 epochs): kl_clip 1e-3 reaches 97% test accuracy on the median
    seed at 5 of 9 points with standardized inputs (8 with pixels/16), 3e-4 at 6 (8), 1e-4 =
    1e-3/√100 at 9 (8); the misses at 1e-3 fit the training set (training loss ≤ 0.06) and settle
    at 94–96.9%, and no point diverges at any of the three (docs/defaults.md). At interval 1 it stays 1e-3 (tests/test_defaults.py: the
    batch-64 digits runs train as well as SGD; 1e-4 was 0.040 against SGD's 0.023 at lr 0.1).
    An invalid interval is left to the interval's own check (returns DEFAULT_KL_CLIP then)."""
    if isinstance(inv_update_interval, bool) or not isinstance(inv_update_interval, numbers.Integral) \
            or inv_update_interval < 1 or inv_update_interval > MAX_STEPS:
        return DEFAULT_KL_CLIP
    return DEFAULT_KL_CLIP / math.sqrt(int(inv_update_interval))  # (a NumPy int too: its interval's clip)


class _DefaultKLClip:
    """The signature default of ``kl_clip``: :func:`default_kl_clip` (``DEFAULT_KL_CLIP /
    √inv_update_interval``) without an adaptive learning rate, off with one (the step length then comes from the quadratic model). A sentinel,
    so that any value the user passes, ``DEFAULT_KL_CLIP`` itself included, counts as explicit."""

    def __repr__(self) -> str:
        return f"<default: {DEFAULT_KL_CLIP:g}/sqrt(inv_update_interval), off with an adaptive lr>"


#: the sentinel ``kl_clip`` defaults to (see :class:`_DefaultKLClip`)
KL_CLIP_DEFAULT = _DefaultKLClip()


def _as_float(value: Any) -> float:
    """A loss as a Python float (detached first: no autograd warning for a loss that requires grad)."""
    return float(value.detach()) if isinstance(value, Tensor) else float(value)


def _adaptive_kl_clip(kl_clip: Any) -> str:
    """The ValueError's message for a KL clip with an adaptive learning rate."""
    return (f"kl_clip={kl_clip!r} cannot be combined with use_adaptive_learning_rate: the step length comes from "
            "the quadratic model; leave kl_clip at its default (off with an adaptive learning rate) or pass kl_clip=None")


def _adaptive_damping(adaptive_damping: Any, use_adaptive_damping: Any) -> bool:
    """``adaptive_damping``, or kfac-jax's ``use_adaptive_damping`` when that is given (not None);
    ``TypeError`` for a non-bool, ``ValueError`` when both are given and differ."""
    if not isinstance(adaptive_damping, bool):
        raise TypeError(f"adaptive_damping must be a bool, got {adaptive_damping!r}")
    if use_adaptive_damping is None:
        return adaptive_damping
    if not isinstance(use_adaptive_damping, bool):
        raise TypeError(f"use_adaptive_damping must be a bool or None, got {use_adaptive_damping!r}")
    if adaptive_damping and not use_adaptive_damping:
        raise ValueError("adaptive_damping=True and use_adaptive_damping=False contradict each other; "
                         "use_adaptive_damping is kfac-jax's name for the same switch: pass one of them")
    return use_adaptive_damping


class SecondOrderOptimizer(CurvatureOptimizer):
    """Natural-gradient (second-order) optimizer; a real ``torch.optim.Optimizer``.

    Args:
        model: the model whose curvature is estimated (any ``nn.Module``).
        lr, momentum, weight_decay: as in SGD (per param group).
        curvature: ``"fisher" | "fisher_mc" | "empirical_fisher" | "hessian"``.
        approx: ``"kfac" | "diag" | "full"`` or a dict module type / class name / name regex -> shape.
            ``None`` uses :data:`DEFAULT_APPROX` (K-FAC for Linear, the convolutions (transposed too) and
            Embedding, diag for norm layers).
        damping: Tikhonov damping λ added to the curvature (default :data:`DEFAULT_DAMPING` = 0.1;
            see there why). The attribute ``opt.damping`` reads the current one (the LM rule's, with
            ``adaptive_damping``) and may be set between steps, taking effect at the next step (see
            :attr:`damping`); ``load_state_dict`` takes the checkpoint's.
        kfac_method: how K-FAC blocks are damped and solved. ``"eigen"`` (default): exact damping,
            ``(G⊗A + λI)⁻¹`` through the factors' eigenbases (four matmuls per layer and step).
            ``"inverse"``: factored damping, ``(G + λI)⁻¹ ⊗ (A + λI)⁻¹`` — kfac_pytorch's INVERSE
            method: the damping enters each factor, which damps more strongly (roughly
            ``λ(G⊗I + I⊗A) + λ²I`` is added instead of ``λI``), two matmuls per layer and step and
            Cholesky inverses instead of eigendecompositions. Diagonal and full blocks are exact
            either way. Pick λ for the method: the same number damps much more under ``"inverse"``.
        ema_decay: in [0, 1): ``C ← ema_decay·C + (1 − ema_decay)·C_batch``; the first estimate is taken as it
            is (no start at zero, no bias correction).
        curv_update_interval, inv_update_interval: steps between curvature estimates / decompositions.
        curv_warmup_steps: the first ``curv_warmup_steps`` steps (default 0) each estimate the
            curvature and decompose it, whatever the intervals; the intervals apply from then on.
            The curvature changes fastest at the start of training, where an estimate from the
            initial weights reused for ``curv_update_interval`` steps preconditions badly (see
            docs/guide.md "Transformers").
        loss: ``"cross_entropy"``, ``"mse"`` or ``"binary_cross_entropy"`` (a Bernoulli on each logit:
            binary and multi-label classifiers): the likelihood of the model's output.
        mc_samples: sampled labels per example for ``fisher_mc``.
        kl_clip: kfac_pytorch-style KL clipping of the preconditioned update: the update is scaled
            by ``ν`` so that ``Σ lr²·Δᵀd`` (twice the KL divergence the step implies under the
            curvature) stays at most ``kl_clip``. Default (when not passed): :data:`DEFAULT_KL_CLIP` = 1e-3
            (kfac_pytorch's default) divided by ``√inv_update_interval`` (:func:`default_kl_clip`: a
            decomposition reused for longer is trusted less far; 1e-4 at interval 100); ``None`` turns it off. With an adaptive
            learning rate the default is off and an explicit value is refused (``ValueError``); with adaptive
            momentum alone the fixed lr's step along Δ is clipped (``Δ ← ν·Δ``) before ``μ`` is solved.
        adaptive_damping: Levenberg–Marquardt rule every ``damping_adaptation_interval`` steps
            (needs a closure that can be called again; the extra call re-evaluates the loss).
            ``damping_adaptation_decay`` is per step (kfac-jax's convention): each adjustment
            multiplies or divides the damping by ``damping_adaptation_decay ** damping_adaptation_interval``
            (0.95⁵ ≈ 0.774 at the defaults), never below ``min_damping`` (default
            :data:`~torchsso2.optim.damping.DEFAULT_MIN_DAMPING` = 1e-4: lower, long runs whose
            loss goes to zero diverged or stalled; an initial damping below it is a ValueError) nor above
            1e4. Its quadratic model is ``C + λI`` with either ``kfac_method`` (Martens & Grosse 2015 also
            adapt λ on that model while preconditioning with factored damping); in adaptive mode
            (``use_adaptive_learning_rate`` / ``use_adaptive_momentum``) it is the exact-curvature model
            of docs/adaptive.md that solved the step. A step the model predicts no decrease for (one
            coefficient fixed) gives ρ = −inf: the damping rises.
        on_nonfinite: ``"skip"`` (default; the state after a skipped step equals the state
            before it, logged and counted in ``num_skipped``) or ``"raise"`` (NonFiniteError).
            A skipped step does not advance ``num_steps``, the sampling generator or BatchNorm's
            running statistics: training with a skipped batch equals training without it.
        max_consecutive_skips: after this many consecutive skipped steps (default 20) the step
            raises :class:`NonFiniteError` naming what is non-finite and what to try (lower lr,
            more damping); ``None`` never raises.
        skip_modules: module names (regex), class names or types left to the plain update (momentum SGD,
            scaled by the KL clip's ν, to whose sum they contribute; ``kl_clip=None``: exactly momentum
            SGD), each with its submodules.
        params: optional torch.optim-style param groups (default: all trainable params of model).
            Curvature is estimated for these only; the model's other parameters are left alone.
        linalg: ``"torch" | "cupy" | "numpy"`` decomposition backend (default: env TORCHSSO2_LINALG or torch).
        communicator: ``"auto" | "none" | "torch" | "mpi"`` or a Communicator (``None`` is ``"auto"``: a
            launcher's processes are found and averaged over; ``"none"`` for one process).
            Selecting MPI installs the process-wide fault handlers (an uncaught exception calls
            ``MPI_Abort``, a rank that exits tells the others; opt out with
            ``TORCHSSO2_ABORT_ON_EXCEPTION=0`` or ``get_communicator("mpi", abort_on_exception=False)``);
            collectives give up after ``TORCHSSO2_DIST_TIMEOUT`` s (60). The ranks' settings are
            compared at construction (``ValueError`` naming any that differ). See docs/distributed.md.
        seed: seed of the sampling generator (saved in state_dict). None (default): drawn from torch's
            global generator at construction (one draw, as a DataLoader's base seed): ``torch.manual_seed``
            makes a run repeatable, and optimizers built one after another get different streams.
        grad_scaler: a ``torch.amp.GradScaler``; the closure calls ``scaler.scale(loss).backward()``,
            ``step`` unscales (skipping the step on overflow, as if the batch was never seen:
            ``num_steps`` and the schedules stay) and the user calls ``scaler.update()`` (not
            ``scaler.step``). A closure may ``scaler.unscale_(opt)`` itself to clip (docs/guide.md).
        decomposition_dtype: ``torch.float64`` to decompose ill-conditioned curvature in double.
        grad_worker_fraction: KAISA placement over ranks (``docs/scaling.md``): a float in (0, 1],
            a ``DistributedStrategy`` or ``"comm_opt"`` (default: every rank holds every
            decomposition) / ``"mem_opt"`` (one rank per block decomposes and preconditions, then
            broadcasts the preconditioned gradient) / ``"hybrid_opt"``.
        assignment_strategy: ``"compute"`` (balance ``n³``, default) or ``"memory"`` (``n²``).
        low_rank_solve: with one process and no grad scaler, precondition Linear K-FAC blocks
            from the low-rank form ``gᵀã`` of their gradient when that needs fewer FLOPs
            (small batch, wide layer; same result up to rounding, guarded by a probe of
            ``p.grad``; see :mod:`torchsso2.optim.lowrank`). Weight-decayed groups take the dense path,
            and so does ``kfac_method="inverse"`` (its solve has no eigenbasis to rotate into).
        output_selector: for a model whose forward returns a tuple, dict or output object: a
            callable giving the tensor the loss is computed from (``lambda out: out[0]``,
            ``lambda out: out["logits"]``); the curvature is taken there. Default: the output.
        kfac_approx: ``"expand"`` (default) or ``"reduce"``: K-FAC of Linear-like layers applied over
            positions (``[N, T, d]`` inputs, attention projections): every position an example, or
            each sequence's inputs averaged and output gradients summed over ``T`` first
            (Eschenhagen et al., 2023; :class:`curvature.options.KFACApprox`).
        use_adaptive_learning_rate, use_adaptive_momentum: kfac-jax's adaptive mode
            (:mod:`torchsso2.optim.adaptive`, ``docs/adaptive.md``): the update is
            ``θ ← θ − a·Δ + μ·δ_prev`` (``Δ = (C + λI)⁻¹ d``, ``δ_prev`` the previous update) with
            ``a`` and/or ``μ`` minimising the damped quadratic model of the loss on the batch,
            exact GGN (the Hessian for ``curvature="hessian"``) through one JVP per direction.
            An adapted coefficient ignores the group's ``lr`` / ``momentum``; one not adapted is
            fixed to it. Costs about two extra forward passes per step; combine with
            ``adaptive_damping=True`` (then fed the quadratic model's predicted change) for a
            run with neither lr nor damping to tune. With an adaptive learning rate the default KL clip
            is off and an explicit ``kl_clip`` (other than ``None``) is refused; with adaptive momentum
            alone the clip (default on) bounds the fixed lr's step along Δ.
        adaptive_coefficients_interval: with adaptive coefficients, solve them every this many steps
            (and at the first two and at every LM damping step) and reuse the last ones in between,
            which then cost no JVP (default 1: every step).
        use_adaptive_damping: kfac-jax's name for ``adaptive_damping`` (the same switch; passing
            both with different values is a ``ValueError``).

    ``step(closure, targets=None)``: the closure zeroes grads, runs the model, computes the loss,
    calls ``backward()`` and returns the loss, as torch.optim's closures do, or ``(loss, output)``;
    ``step`` returns what the closure returned. The curvature is that of the mean negative
    log-likelihood (``F.cross_entropy(out, y)``; for ``loss="mse"`` ``½‖y − f‖²`` over all of an example's
    outputs, averaged over the examples, i.e. ``0.5 * (out - y).pow(2).reshape(len(out), -1).sum(1).mean()``
    — ``.sum(-1).mean()`` for ``[N, D]`` outputs, not for ``[N, T, D]`` —, not ``F.mse_loss``, which is
    ``2/D`` of it for ``D`` outputs per example, ``T·D`` for ``[N, T, D]``; for ``loss="binary_cross_entropy"``
    ``F.binary_cross_entropy_with_logits`` summed over an example's outputs, averaged over the examples: its
    ``reduction="mean"`` for one output per example); a closure loss ``c``× that
    scales the step by ``c`` (in adaptive mode too, which warns when given ``targets`` for a closure
    running one forward). ``targets`` is required for
    ``curvature="hessian"`` (``opt.step(closure, targets=y)``: the Hessian of the mean loss is
    recomputed from the output and ``y`` by double backward; the closure's loss has been
    backpropagated already) and makes ``"empirical_fisher"`` exact for any loss reduction.
    Gradient accumulation (several forwards + backwards in one closure, micro-batch ``i``'s mean loss
    times ``n_i / N``) works for every kind (adaptive mode with ``curvature="hessian"``: one forward); kinds
    given ``targets`` take them as all micro-batches' targets concatenated in the closure's order,
    and ``"empirical_fisher"`` needs ``targets`` then (without them it reads the per-example
    gradients of the closure's single backward). In adaptive mode with ``adaptive_damping``, given
    the batch's ``targets``, the LM rule takes the loss after the update from one forward instead of
    a second closure call where that is the closure's loss (:mod:`torchsso2.optim.lm_forward`).
    """

    def __init__(self, model: nn.Module, lr: float = 0.01, momentum: float = 0.9, weight_decay: float = 0.0, *,
                 curvature: str = "fisher_mc", approx: Any = "kfac", damping: float = DEFAULT_DAMPING,
                 kfac_method: str = "eigen",
                 ema_decay: float = 0.95, curv_update_interval: int = 1, inv_update_interval: int = 1,
                 loss: str = "cross_entropy", mc_samples: int = 1, kl_clip: Union[float, None, _DefaultKLClip] = KL_CLIP_DEFAULT,
                 adaptive_damping: bool = False, damping_adaptation_interval: int = 5,
                 damping_adaptation_decay: float = 0.95, min_damping: float = DEFAULT_MIN_DAMPING,
                 on_nonfinite: str = "skip", skip_modules: Any = None,
                 params: Optional[Iterable[Any]] = None, linalg: Optional[str] = None,
                 communicator: Any = "auto", seed: Optional[int] = None,
                 decomposition_dtype: Optional[torch.dtype] = None, grad_scaler: Any = None,
                 grad_worker_fraction: Any = "comm_opt", assignment_strategy: Any = "compute",
                 low_rank_solve: bool = True, output_selector: Any = None,
                 max_consecutive_skips: Optional[int] = DEFAULT_MAX_CONSECUTIVE_SKIPS,
                 use_adaptive_learning_rate: bool = False, use_adaptive_momentum: bool = False,
                 kfac_approx: str = "expand", curv_warmup_steps: int = 0,
                 adaptive_coefficients_interval: int = 1, use_adaptive_damping: Optional[bool] = None) -> None:
        check_not_pytorch_sso_call(lr, "SecondOrderOptimizer")
        self.curv_warmup_steps = check_int("curv_warmup_steps", curv_warmup_steps, low=0, high=MAX_STEPS)
        check_number("lr", lr, low=0.0, high=MAX_LR)
        if not isinstance(low_rank_solve, bool):
            raise TypeError(f"low_rank_solve must be a bool, got {low_rank_solve!r}")
        check_number("momentum", momentum, low=0.0, high=1.0, high_open=True)
        check_number("weight_decay", weight_decay, low=0.0)
        self._damping = check_number("damping", damping, low=0.0)
        # an adaptive learning rate sets the step length from the quadratic model: no clip; with adaptive
        # momentum alone the fixed lr does, and its step along Δ is clipped as in the plain mode
        adaptive_lr = use_adaptive_learning_rate is True
        if isinstance(kl_clip, _DefaultKLClip):  # not passed: off with an adaptive lr
            kl_clip = None if adaptive_lr else default_kl_clip(inv_update_interval)
        elif adaptive_lr and kl_clip is not None:
            raise ValueError(_adaptive_kl_clip(kl_clip))
        self.kl_clip = None if kl_clip is None else check_number("kl_clip", kl_clip, low=0.0, low_open=True)
        # compared across ranks (distributed/consistency.py): adaptive mode all-reduces its 2×2 model
        self.use_adaptive_learning_rate = use_adaptive_learning_rate
        self.use_adaptive_momentum = use_adaptive_momentum
        self.adaptive_coefficients_interval = check_int("adaptive_coefficients_interval", adaptive_coefficients_interval,
                                                        high=MAX_STEPS)
        adaptive_damping = _adaptive_damping(adaptive_damping, use_adaptive_damping)
        self.lm: Optional[LMDamping] = None
        self.damping_adaptation_interval = check_int("damping_adaptation_interval", damping_adaptation_interval,
                                                     high=MAX_STEPS)
        # checked whether or not adaptive_damping is on (as torch.optim checks every argument)
        decay = check_number("damping_adaptation_decay", damping_adaptation_decay,
                             low=0.0, high=1.0, low_open=True, high_open=True)
        check_number("min_damping", min_damping, low=0.0)
        if adaptive_damping:
            if self.damping <= 0:
                raise ValueError("adaptive_damping needs an initial damping > 0")
            if self.damping < min_damping:  # the rule floors every decrease there: it could only climb to it
                raise ValueError(f"damping={self.damping!r} is below min_damping={min_damping!r}, the adaptive damping "
                                 "rule's lower bound: start at or above it (or lower min_damping)")
            if self.damping > LMDamping.max_damping:  # the rule could only fall from there, and a checkpoint of it
                raise ValueError(f"damping={self.damping!r} is above {LMDamping.max_damping:g}, the adaptive damping "
                                 "rule's upper bound: start at or below it")  # would be loaded clamped
            # kfac-jax's convention: the decay is per step, so one adjustment every `interval` steps
            # moves the damping by decay ** interval (torchsso2/optim/damping.py)
            self.lm = LMDamping(self.damping, per_adjustment_decay(decay, self.damping_adaptation_interval),
                                min_damping=min_damping)
        self.kfac_method = check_choice("kfac_method", kfac_method, ("eigen", "inverse"))  # compared across ranks
        self.damping_adaptation_decay = damping_adaptation_decay if adaptive_damping else None
        self.min_damping = min_damping if adaptive_damping else None
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay)
        settings = CurvatureSettings.from_arguments(locals(), approx=DEFAULT_APPROX if approx is None else approx)
        super().__init__(model, params, defaults, settings)
        self.adaptive = self._make_adaptive(use_adaptive_learning_rate, use_adaptive_momentum,
                                            self.adaptive_coefficients_interval)
        # one process, no grad scaler: p.grad is the user's gᵀã, so wide Linear K-FAC blocks can be
        # rotated in low rank (torchsso2/optim/lowrank.py; guarded by a probe of p.grad)
        self.low_rank: Optional[LowRankSolver] = None
        if low_rank_solve and self.comm.world_size == 1 and grad_scaler is None:
            kfac = {n: lay.module for n, lay in self.engine.layouts.items() if self.engine.approx[n].value == "kfac"}
            solver = LowRankSolver(kfac, seed=low_rank_seed(self.seed))
            if solver.modules:  # some Linear layer is wide enough for the low-rank path to pay
                self.low_rank = solver

    @explains_changed_model  # a step failing on a model sharded or re-created since: say so
    @full_precision_step  # the optimizer's math outside torch.autocast, the closure inside it
    def step(self, closure: Optional[Closure] = None, targets: Optional[Tensor] = None) -> Any:  # type: ignore[override]
        """One natural-gradient step; returns what the closure returned: the loss, or ``(loss, output)``.

        ``closure``: zero-grads, runs the model's forward, calls ``backward()`` and returns the loss
        (a tensor of one element), or ``(loss, output)`` (the model output, ``[N, ...]``).
        ``targets``: the batch's labels ``[N]`` (or targets ``[N, ...]`` for ``loss="mse"``), needed by
        the Hessian and by gradient accumulation with the empirical Fisher (class docstring)."""
        return self._step_result(*self._natural_step(closure, targets))

    def _natural_step(self, closure: Closure, targets: Optional[Tensor]) -> Tuple[Any, Any]:
        """:meth:`step`'s work; ``(loss, output)`` (output None for a closure returning the loss alone)."""
        self._check_step_call(closure)
        check_targets(targets)
        warmup = self.num_steps < self.curv_warmup_steps  # every step estimates and decomposes
        estimate = warmup or self.num_steps % self.curv_update_interval == 0
        self._follow_param_dtypes()
        snapshot = self._snapshot()  # given back if the step is skipped (torchsso2/optim/skips.py)
        # the LM rule's loss after the update draws the random numbers (dropout masks) this closure call draws;
        # where it calls the closure again (no targets, no adaptive mode, or a closure whose loss is not the mean
        # NLL of its output: known only after this call), Python's and NumPy's generators too (~60 µs per LM step)
        rng = rng_states(self.model, host=True) if self._adapt_now() else None
        try:
            with self.low_rank.record() if self.low_rank is not None else contextlib.nullcontext(), \
                    self.adaptive.record(self.model) if self.adaptive is not None else contextlib.nullcontext():
                loss, output, fresh = self._run_closure(closure, targets, estimate)
        except BaseException:  # a closure that raised (a bad batch caught by the caller): the Monte-Carlo labels
            snapshot.restore()  # it drew are given back, so training on is as if the call never happened
            raise
        if self.lm is not None and self.adaptive is None and self.grad_scaler is not None and self._grads_unscaled():
            snapshot.restore()  # the LM rule's call of this closure would unscale a second time: said at once
            raise RuntimeError(LM_UNSCALE_IN_CLOSURE)
        # (an adaptive learning rate checks the closure's loss itself: lm_forward.warn_if_not_mean_nll)
        if (self.adaptive is None or not self.adaptive.learning_rate) and targets is not None \
                and not self.__dict__.get("_loss_checked"):
            self._loss_checked = True
            self._check_loss_against_targets(targets, loss, output)
        if not self._unscale_grads():  # an AMP overflow: as if the batch was never seen (num_steps stays)
            snapshot.restore()
            return loss, output
        agreed, params, groups = self._average_over_ranks(fresh, loss)
        self._take_damping_request()
        if self.adaptive is not None:
            warn_ignored_schedule(self)
        if not params and self.adaptive is not None:  # no gradient at all: nothing to solve a step for (the first
            snapshot.restore()  # closure calls are checked for it, later ones here), and no state changed
            raise RuntimeError(NO_BACKWARD)
        grads = [p.grad for p in params]
        decompose = warmup or self.num_steps % self.inv_update_interval == 0 or not self._decomposed \
            or self._redamp_pending
        # the gradients are checked here only when the curvature state would change before the
        # update (an EMA update or a decomposition); otherwise the finite check of the update
        # below catches them (a non-finite gradient makes its preconditioned update non-finite)
        checked = grads if fresh is not None or decompose else []
        if not agreed or not self._batch_is_finite(loss, checked, fresh):
            self._refuse_nonfinite_targets(targets, snapshot)
            self._nonfinite("loss, gradient or curvature", snapshot, self._what_is_nonfinite(loss, fresh, not agreed))
            return loss, output
        adapt = self._adapt_now()  # the LM rule after the update; an update it finds non-finite is undone
        # what a step that raises after the curvature took the batch gives back (rollback.py): adaptive mode's
        # forward-mode pass and the LM rule's closure call run after it, so there the statistics are cloned;
        # otherwise (an interrupted decomposition) the decompositions and counts, the statistics keeping the batch
        rollback = CurvatureRollback(self, fresh is not None and (self.adaptive is not None or adapt))
        new = [name for name in fresh if name not in self.running.blocks] if fresh is not None else []
        if fresh:
            warn_unreached_blocks(self, fresh)
        try:
            if fresh is not None:
                self.running.update(fresh, self.ema_decay)
                if new and self._decomposed:  # a block seen for the first time (a head earlier batches did not call)
                    decompose = True
            if not self.running.blocks:
                raise RuntimeError("no curvature estimate yet: the first step must estimate the curvature")
            decomposed = not decompose or self._decompose(self.damping)
        except BaseException as exc:  # Ctrl-C in a decomposition: no block half-updated, the labels given back
            rollback.restore(self, exc)
            snapshot.restore()
            raise
        if not decomposed:
            if not self._decomposed:  # nothing to precondition with yet: a skipped step, which leaves the step
                return loss, output   # count (the schedules, the label streams) as it was; the curvature keeps the batch
            self._forget_blocks(new)  # the others keep their decompositions; a new one has none
        undo = UpdateUndo(self, params, snapshot) if adapt else None  # (update_undo.py)
        old = undo.values if undo is not None and self.adaptive is None else None  # adaptive mode predicts without
        predicted = None
        decay: Optional[Tuple[List[float], float]] = None
        if self.adaptive is not None:  # adaptive lr/momentum (torchsso2/optim/adaptive.py)
            if adapt:  # the model predicts the change of loss + weight decay: ρ compares the same
                wds = self._plan(params, groups).values("weight_decay")
                decay = (wds, decay_term(params, wds))
            warn_if_not_mean_nll(self, targets, loss, output)
            try:
                # its J·v / H·v passes: not a KFACPreconditioner's batch, and the Hessian's double backward re-runs a
                # checkpointed forward, whose BatchNorm must not count the batch again (engine.kept_statistics)
                with self.engine.hidden_passes(), self.engine.kept_statistics:
                    predicted = adaptive_step(self, params, groups, targets, self._mean_over_ranks(_as_float(loss)))
            except BaseException:  # the step (its J·v pass) raised before any parameter moved: as if never called
                rollback.restore(self)
                snapshot.restore()
                raise
            applied = predicted is not None
        else:
            applied = self._apply_update(params, groups)
        if not applied:
            if self.adaptive is not None and self.adaptive.no_minimum:
                self._skip_without_minimum(snapshot, curvature_taken=fresh is not None)
            else:
                self._nonfinite("preconditioned update", snapshot, self._what_is_nonfinite(loss, fresh),
                                curvature_taken=fresh is not None)
            return loss, output
        taken = True
        if adapt:  # adaptive mode with targets: the new loss by one forward where that is the closure's loss
            assert undo is not None
            try:
                lm_closure = forward_only_closure(self, targets, loss, output) if self.adaptive is not None else None
                if lm_closure is not None:  # one forward of the recorded call: the states that forward saw
                    rng = self.adaptive.recorder.calls[0][2]
                # a failed decomposition raised the damping, and the step took the earlier decompositions at the
                # old one (not re-damped in place: pending): the loss is still evaluated, but this step's ρ would
                # judge the new damping by the old one's update
                # the loss after the update: an evaluation, not a batch (the user's closure may run modules
                # outside the optimizer's model: a head, a GAN's discriminator)
                with self.engine.hidden_passes(everywhere=lm_closure is None):
                    taken = self._adapt_damping(lm_closure or closure, loss, params, grads, old, predicted, decay,
                                                backward=lm_closure is None, rng=rng,
                                                update_damping=not self._redamp_pending)
            except BaseException:  # the closure raised in the LM rule's call (KeyboardInterrupt, a second
                undo.restore(self)  # unscale_): the update is undone and the curvature put back, as if the call
                rollback.restore(self)  # never happened
                raise
        if taken:
            self._step_taken()
            self.num_steps += 1
        else:  # the loss after the update is not finite: the update is undone and the step skipped
            assert undo is not None
            undo.restore(self)
            if self.on_nonfinite == "skip":  # the LM rule's answer to a failed step (ρ = -inf): more damping
                self._set_damping(self.lm.update(math.nan, math.nan))
            self._nonfinite("loss after the update (adaptive_damping's evaluation; the update was undone)",
                            curvature_taken=fresh is not None)
        return loss, output

    def _skip_without_minimum(self, snapshot: Any, curvature_taken: bool = False) -> None:
        """Adaptive mode's quadratic model has no minimum (negative curvature along the step, as the Hessian of a
        non-convex loss can have): the step is skipped as a non-finite one is, under its own name, and with
        ``adaptive_damping`` the damping is raised as after a failed step (ρ = −∞), which the next steps' model
        takes (a larger damping adds ``λ·‖step‖²`` to its curvature)."""
        raising = self.lm is not None and self.on_nonfinite == "skip"
        if raising:
            self._set_damping(self.lm.update(math.nan, math.nan))
        remedy = ("adaptive_damping raises the damping after each such step" if raising else "raise damping"
                  + ("" if self.lm is not None else ", or pass adaptive_damping=True to raise it after each such step"))
        self._nonfinite("", snapshot, reason=(
            f"the adaptive step's quadratic model has no minimum (negative curvature along the step; curvature="
            f"{self.engine.kind.value!r}); {remedy}, or take a Fisher kind (the GGN has no negative curvature)"),
            curvature_taken=curvature_taken)

    def _categorical_use(self, targets: Optional[Tensor]) -> Optional[str]:
        own = super()._categorical_use(targets)
        if own is None and self.adaptive is not None and self.engine.loss is LossType.CROSS_ENTROPY:
            # the quadratic model's products take the categorical output Hessian whatever the kind
            return "The adaptive step's quadratic model takes the categorical likelihood's curvature."
        return own

    def _keeps_output_grads(self, targets: Optional[Tensor]) -> bool:
        """The first step given ``targets`` under a Fisher kind keeps the output's gradient for the loss-scale
        check (:meth:`_check_loss_against_targets`)."""
        return targets is not None and self.engine.kind in (Kind.FISHER, Kind.FISHER_MC) \
            and not self.__dict__.get("_loss_checked") and (self.adaptive is None or not self.adaptive.learning_rate)

    def _check_loss_against_targets(self, targets: Tensor, loss: Any, output: Any) -> None:
        """The Hessian, and the empirical Fisher given ``targets``, are taken of the mean NLL of the output and
        the targets, not of the closure's loss: warn (first step) when the two values differ by more than
        0.1% (a scaled loss, an L2 term, class weights; label smoothing only where the first predictions are
        not near uniform), as adaptive mode does. The Fisher kinds are the model's likelihood whatever the
        loss, so only the loss's scale is checked there: its gradient with respect to the output against the
        mean NLL's (:mod:`.loss_scale`), off by more than 30% (a summed loss, ``F.mse_loss``'s ``2/D``)."""
        kind = self.engine.kind
        seen = self.__dict__.get("_misuse", {}).pop("output_grads", None)
        if kind in (Kind.FISHER, Kind.FISHER_MC):
            warn_if_gradient_is_not_the_nll(
                self, targets, seen, f"SecondOrderOptimizer (curvature={kind.value!r}, given targets)",
                "The curvature is the mean likelihood's and the step preconditions the closure's gradient, so a loss "
                "c× the mean NLL makes the step c× the natural-gradient step (reduction='sum': N×; F.mse_loss: 2/D "
                "for D outputs); return the mean NLL from the closure, or ignore this if the loss is another on "
                "purpose (mixup, distillation)")
            return
        if kind is Kind.HESSIAN or kind is Kind.EMPIRICAL_FISHER:
            warn_if_loss_is_not_the_nll(
                self, targets, loss, output, f"SecondOrderOptimizer (curvature={kind.value!r}, given targets)",
                "The curvature is taken of the mean NLL of the output and these targets, not of the closure's loss, "
                "and the step preconditions the closure's gradient; return the mean NLL from the closure, or "
                "ignore this if the other loss is meant (its curvature is then the mean NLL's)", LOSS_SCALE_WARN_RTOL)

    @torch.no_grad()
    def _apply_update(self, params: List[nn.Parameter], groups: List[Dict[str, Any]]) -> bool:
        """Apply the update to ``params`` (``groups``: the param group of each); False (nothing
        changed) when the preconditioned update is not finite."""
        plan = self._plan(params, groups)
        wds = plan.values("weight_decay")
        vecs = [p.grad for p in params]
        if any(wds):
            vecs = [add_weight_decay([v], [p], wd)[0] for v, p, wd in zip(vecs, params, wds)]
        if self.placement.active:  # [issue #7] each block solved by its grad workers (no low-rank path with ranks)
            direction = self._precondition({blk.layout.name: blk for blk, _ in plan.blocks},
                                           {id(p): v for p, v in zip(params, vecs)})
            updates = [direction[id(p)] for p in params]
        else:
            updates = plan.precondition(vecs, solved=self._low_rank_solve(plan, vecs, wds))
        nu = 1.0
        if self.kl_clip is not None:  # the clip and the finite check in one pass (clipped_update.py)
            clip = clip_scale(updates, vecs, plan.values("lr"), self.kl_clip)
            if clip is None:
                return False
            nu = clip
        elif not owned_all_finite(updates):
            return False
        # the clip's ν folded into one fused momentum kernel (fused_momentum.py); the gradients are kept
        scaled_momentum_step_(params, updates, [self.state[p] for p in params], plan.values("lr"),
                              plan.values("momentum"), nu, vecs, self._scalars)
        return True

    def _low_rank_solve(self, plan: UpdatePlan, vecs: List[Tensor], wds: List[float]) -> Dict[str, List[Tensor]]:
        """``{block name: preconditioned gradients}`` of the blocks that took the low-rank path
        (:mod:`torchsso2.optim.lowrank`; weight-decayed blocks take the dense path)."""
        if self.low_rank is None:
            return {}
        plain = {blk.layout.name: blk for blk, pos in plan.blocks
                 if not isinstance(blk, PartialBlock) and not any(wds[i] for i in pos)}
        return self.low_rank.solve(plain, {id(p): v for p, v in zip(plan.params, vecs)})

    # ---- adaptive damping -----------------------------------------------------------------------
    def _adapt_now(self) -> bool:
        return self.lm is not None and (self.num_steps + 1) % self.damping_adaptation_interval == 0

    def _adapt_damping(self, closure: Closure, loss: Tensor, params: List[nn.Parameter],
                       grads: List[Tensor], old: Optional[List[Tensor]], predicted: Optional[float] = None,
                       decay: Optional[Tuple[List[float], float]] = None, backward: bool = True,
                       rng: Optional[Tuple[Tensor, Dict[int, Tensor]]] = None, update_damping: bool = True) -> bool:
        """LM rule on the change of the loss after the update; ``predicted``: the quadratic model's
        change when the caller has it (adaptive mode: exact curvature), else from ``C + λI`` and
        the update ``θ − old`` (``old``: the parameters before it). ``decay``: in adaptive mode, each
        parameter's weight decay and the term ``Σ ½·wd·‖θ‖²`` before the update: the model predicts
        the change of loss plus that term, so the actual change includes it. ``backward``: whether
        ``closure`` runs a backward (the user's closure; adaptive mode's forward-only one does not).
        ``rng``: the RNG states (:func:`~torchsso2.optim.adaptive.rng_states`) the call replays, so that its
        dropout masks are the step's own (kfac-jax evaluates both losses with the step's one key): ρ then
        measures the update, not a new mask; the user's streams are left as the step's call left them
        (torch's, and for a call of the user's closure Python's ``random`` and NumPy's global generators too).
        ``update_damping=False``: the loss is evaluated (a non-finite one still undoes the update) but the
        damping stays. False (the damping unchanged) when the loss after the update is not finite."""
        assert self.lm is not None
        with torch.no_grad():
            if predicted is None:  # the change predicted by C + λI
                assert old is not None
                deltas = {id(p): p.detach() - o for p, o in zip(params, old)}
                g = {id(p): gr.detach().clone() for p, gr in zip(params, grads)}
                quad = 0.0
                for blk in self.running.blocks.values():
                    ps = blk.layout.params
                    if not all(id(q) in deltas for q in ps):
                        continue
                    cv = blk.mvp([deltas[id(q)] for q in ps])
                    quad += sum(float((c * deltas[id(q)]).sum()) for c, q in zip(cv, ps))
                lin = sum(float((g[k] * d).sum()) for k, d in deltas.items())
                sq = sum(float(d.pow(2).sum()) for d in deltas.values())
                predicted = lin + 0.5 * (quad + self.damping * sq)
        # parameters outside this optimizer (a body on another optimizer) keep the gradient of the step's own
        # call: this second call would add to it (or, zeroed, replace it with the gradient after the update)
        own = {id(p) for g in self.param_groups for p in g["params"]}
        outside = [(p, None if p.grad is None else p.grad.clone()) for p in self.model.parameters()
                   if id(p) not in own and p.requires_grad] if backward else []
        # the model's buffers as the step's own forward left them: the evaluation is not a training forward
        # (BatchNorm's running statistics would take the batch twice; kfac-jax evaluates it functionally)
        buffers = [(b, b.clone()) for b in self.model.buffers()]
        with torch.enable_grad(), replayed_rng(rng) if rng is not None else contextlib.nullcontext():
            try:
                new_loss = unpack_closure_result(closure())[0]
            except RuntimeError as err:
                if self.grad_scaler is not None and "unscale_() has already been called" in str(err):
                    raise RuntimeError(LM_UNSCALE_IN_CLOSURE) from err
                raise
            finally:  # written into the tensor the closure left where it can be (a DDP bucket view stays one)
                for p, grad in outside:
                    if grad is not None and p.grad is not None and p.grad.shape == grad.shape:
                        p.grad.copy_(grad)
                    else:
                        p.grad = grad
                with torch.no_grad():
                    for b, before in buffers:
                        b.copy_(before)
        actual = self._mean_over_ranks(_as_float(new_loss) - _as_float(loss))  # [issue #7] same on every rank
        if not math.isfinite(actual):  # the same on every rank: the caller undoes the update
            return False
        if not update_damping:
            return True
        if decay is not None:  # equal on every rank (the same parameters)
            actual += decay_term(params, decay[0]) - decay[1]
        self._set_damping(self.lm.update(actual, predicted))
        logger.debug("LM damping: rho=%.3f damping=%.3e", self.lm.last_rho, self.damping)
        return True

    def _check_attrs(self) -> None:
        super()._check_attrs()
        if self.kl_clip is not None and self.use_adaptive_learning_rate is True:  # set since: it would be ignored
            raise ValueError(_adaptive_kl_clip(self.kl_clip))

    @property
    def damping(self) -> float:
        """The damping λ the next step's decompositions take (the LM rule's current one with ``adaptive_damping``).

        Set between steps (``opt.damping = 1e-2``), it takes effect at the next step, whatever the
        intervals: K-FAC eigen decompositions take it in place, other decompositions are redone from the
        running curvature then; with ``adaptive_damping`` the rule continues from it (within
        ``[min_damping, 1e4]``, else a ``ValueError``). The damping is one number for all param groups; with
        several processes set the same value on every rank: the next step compares it between the ranks (a
        ``ValueError`` where it differs) before it takes it."""
        return self.__dict__.get("_damping_request", self._damping)

    @damping.setter
    def damping(self, value: float) -> None:
        value = check_number("damping", value, low=0.0)
        if self.lm is not None and not self.lm.min_damping <= value <= self.lm.max_damping:
            raise ValueError(f"damping={value!r} is outside the adaptive damping rule's [min_damping, 1e4] = "
                             f"[{self.lm.min_damping!r}, {self.lm.max_damping!r}]")
        if self.lm is not None:
            self.lm.damping = value
        if self.placement.active:  # several processes: taken at the next step, once the ranks agree on it (the
            # K-FAC re-damp runs a collective, which a value set on one rank only would leave unmatched)
            self._damping_request = float(value)
            return
        self.__dict__.pop("_damping_request", None)  # (one loaded from a checkpoint of several processes)
        self._set_damping(value)

    def _take_damping_request(self) -> None:
        """The damping set between steps with several processes (:attr:`damping`), after the step's check that
        the ranks agree on it."""
        request = self.__dict__.pop("_damping_request", None)
        if request is not None:
            self._set_damping(request)

    def _step_settings(self) -> Dict[str, Any]:
        return {**super()._step_settings(), "damping": self.damping}

    def _set_damping(self, damping: float) -> None:
        """A new damping (the LM rule's, or the user's): K-FAC eigen decompositions take it in place
        (torchsso2/optim/redamp.py), other decompositions are redone at the next step, which keeps the
        current ones where that fails (an indefinite Hessian's diagonal at a damping still too small)."""
        old_damping, self._damping = self._damping, float(damping)
        if self._damping == old_damping or not self._decomposed:
            return
        placed = self.placement.active
        # (kfac_method="inverse" damps each factor before its inverse: never re-damped in place, no all-reduce)
        if self.kfac_method != "eigen" or not redamp(
                self.running.blocks, old_damping, self._damping, agree=self._every_rank if placed else None,
                held=self.placement.held(self.running.blocks) if placed else None):
            self._redamp_pending = True

    def _shortfall_probe(self) -> Tuple[type, ...]:
        """Diagonal and full blocks where the rule reads the shortfall (``adaptive_damping``, skip mode) of a
        curvature that can be indefinite (the Hessian; the Fisher kinds' blocks never fall short)."""
        if self.lm is None or self.on_nonfinite != "skip" or self.running.psd:
            return ()
        return (DiagBlock, FullBlock)

    def _damping_after_failed_decomposition(self, error: object) -> Optional[float]:
        """``adaptive_damping``'s answer to a failed decomposition (skip mode): more damping, as after a failed
        step (ρ = −∞), and for a diagonal or full block at least twice what it fell short by
        (:attr:`~curvature.linalg.LinalgError.damping_shortfall`: an indefinite Hessian); None without the rule."""
        if self.lm is None or self.on_nonfinite != "skip":
            return None
        damping = self.lm.update(math.nan, math.nan)
        shortfall = getattr(error, "damping_shortfall", None)
        if isinstance(shortfall, float) and math.isfinite(shortfall) and shortfall > 0:
            damping = self.lm.damping = min(self.lm.max_damping, max(damping, self.damping + 2.0 * shortfall))
        self._set_damping(damping)
        return damping

    face_name = "SecondOrderOptimizer"

    def _extra_state(self) -> Dict[str, Any]:
        return {"damping": self._damping, "lm": None if self.lm is None else vars(self.lm).copy(),
                "adaptive": None if self.adaptive is None else self.adaptive.state_dict(),
                "redamp_pending": self._redamp_pending,
                # a damping set since the last step with several processes (taken at the next step: damping)
                "damping_request": self.__dict__.get("_damping_request"),
                "low_rank_generator": None if self.low_rank is None else self.low_rank.generator.get_state()}

    def _check_extra_state(self, state: Dict[str, Any]) -> None:
        for key, optional in (("damping", False), ("damping_request", True)):
            damping = state.get(key)
            if optional and damping is None:
                continue
            if isinstance(damping, bool) or not isinstance(damping, (int, float)) \
                    or not 0.0 <= float(damping) < float("inf"):
                raise ValueError(f"checkpoint entry ['torchsso2']['extra'][{key!r}] is {damping!r}, expected a finite "
                                 f"number >= 0{' or None' if optional else ''}; the optimizer is unchanged")
        if state.get("lm") is not None and not isinstance(state["lm"], dict):
            raise ValueError("checkpoint entry ['torchsso2']['extra']['lm'] must be a dict or None; "
                             "the optimizer is unchanged")
        low_rank = state.get("low_rank_generator")
        if low_rank is not None:
            try:
                torch.Generator().set_state(low_rank)
            except (TypeError, RuntimeError, ValueError) as err:
                raise ValueError("checkpoint entry ['torchsso2']['extra']['low_rank_generator'] is not a "
                                 f"torch.Generator state ({err}); the optimizer is unchanged") from err
        lm = state.get("lm") or {}
        for key, positive in (("damping", True), ("last_rho", False)):  # the rule's state, restored on load
            if key in lm:
                v = lm[key]
                ok = not isinstance(v, bool) and isinstance(v, numbers.Real) and (
                    math.isfinite(float(v)) and float(v) > 0 if positive else True)
                if not ok:
                    raise ValueError(f"checkpoint entry ['torchsso2']['extra']['lm'][{key!r}] is {v!r}, expected "
                                     + ("a finite number > 0" if positive else "a number")
                                     + "; the optimizer is unchanged")

    def _extra_snapshot(self) -> Any:
        return None if self.lm is None else vars(self.lm).copy()

    def _restore_extra(self, snapshot: Any) -> None:
        if self.lm is not None and snapshot is not None:
            vars(self.lm).clear()
            vars(self.lm).update(snapshot)

    def _load_extra_state(self, state: Dict[str, Any]) -> None:
        self.__dict__.pop("_damping_request", None)
        self.__dict__.pop("_schedule_seen", None)  # (misuse.warn_ignored_schedule: the loaded groups' values anew)
        self._damping = float(state["damping"])
        if state.get("damping_request") is not None:  # taken at the next step, as it would have been
            self._damping_request = float(state["damping_request"])
        self._redamp_pending = bool(state.get("redamp_pending", False))  # (absent from older checkpoints)
        if self.lm is not None:
            # the rule's state (its damping, the last ρ; a checkpoint saved without the rule: its damping); its
            # settings (decay, bounds) stay this optimizer's own, as built: a checkpoint's min_damping of 1e-8 kept
            # the damping falling below the 1e-4 it reported
            saved = state.get("lm") or {}
            damping = float(saved.get("damping", self.damping))
            bounded = min(max(damping, self.lm.min_damping), self.lm.max_damping)
            if bounded != damping:
                warnings.warn(f"load_state_dict: the checkpoint's damping {damping!r} is outside this optimizer's "
                              f"adaptive damping range [min_damping, 1e4] = [{self.lm.min_damping!r}, "
                              f"{self.lm.max_damping!r}]; it continues from {bounded!r} (build it with the "
                              "checkpoint's min_damping to keep it)", UserWarning, stacklevel=caller_stacklevel())
            if bounded != self.damping:  # the loaded decompositions are of the checkpoint's damping: redone
                self.__dict__.pop("_damping_request", None)
                self._damping, self._redamp_pending = bounded, True
            self.lm.damping = bounded
            self.lm.last_rho = float(saved.get("last_rho", self.lm.last_rho))
        if self.adaptive is not None and state.get("adaptive") is not None:
            self.adaptive.load_state_dict(state["adaptive"])
        if self.low_rank is not None:  # the probe's stream (last: what may raise comes first): the saved one, else
            # derived from the loaded seed
            saved = state.get("low_rank_generator")
            if saved is not None:
                self.low_rank.generator.set_state(saved.clone())
            else:
                self.low_rank.generator.manual_seed(low_rank_seed(self.seed))

    def _make_adaptive(self, learning_rate: Any, momentum: Any, interval: int = 1) -> Optional[AdaptiveCoefficients]:
        """Validate the adaptive-mode flags; the :class:`AdaptiveCoefficients` or None."""
        for name, flag in (("use_adaptive_learning_rate", learning_rate), ("use_adaptive_momentum", momentum)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if not (learning_rate or momentum):
            if interval != 1:
                raise ValueError(f"adaptive_coefficients_interval={interval} needs use_adaptive_learning_rate=True "
                                 "or use_adaptive_momentum=True")
            return None
        param_names(self.model, [p for g in self.param_groups for p in g["params"]])
        ada = AdaptiveCoefficients(learning_rate, momentum, interval)
        # the activations recorded for the hand-written J·v pass serve the GGN of the model output only
        ada.recorder.keep_activations = self.engine.kind is not Kind.HESSIAN and self.engine.output_selector is None
        return ada
