"""VIOptimizer: natural-gradient variational inference (VOGN, noisy K-FAC, full covariance).

Posterior ``q(θ) = N(μ, Σ)`` over the covered parameters, blockwise per module, the fixed point
of the KL-weighted ELBO ``E_q[Σ_n ℓ_n] + τ·KL(q ‖ N(0, δ⁻¹I))``:

    Λ = N·C + τ·δ·I + damping·I,   Σ = τ·Λ⁻¹      (N = dataset_size, C = curvature EMA, δ = prior precision, τ = kl_weighting)

so ``posterior_precision() = Λ/τ``; ``τ = 1`` is the Bayesian posterior, ``τ < 1`` a cold
(narrower) posterior, ``τ > 1`` a wider one.

and the mean ``μ`` = the model's weights. One ``step(closure)``:

1. draw ``num_mc_samples`` weight samples ``θ_s = μ + ε_s``, ``ε_s ~ N(0, τ·Λ⁻¹)``;
2. run the closure at each sample (forward + backward) and average gradients ``ḡ`` and curvature;
3. restore ``μ``; fold the curvature into the EMA and decompose ``Λ``;
   (the EMA starts at ``curvature_init·I``, default 1: IVON's ``hess_init``; ``ema_decay`` default
   0.99999, IVON's ``beta2``: on runs of ≲ 10⁵ steps ``C`` stays near its start);
4. ``m ← momentum·m + (N·ḡ/σ² + τ·δ·μ)``; ``μ ← μ − ν·lr·Λ⁻¹ m`` (``σ²``: the observation noise of
   ``loss="mse"``, 1 for cross-entropy; ``ν``: the KL clip, default 0.1; with ``momentum_debias=True``
   step t uses ``lr/(1 − momentum^t)``; ``diag`` = a mean-field Gaussian (IVON's Hessian estimator by
   default, VOGN's Gauss-Newton with ``curvature="fisher"``), ``kfac`` = noisy K-FAC, ``full`` = full
   covariance per module). The buffer in ``state`` holds
   ``b ← momentum·b + (ḡ + τδσ²/N·μ)`` (the momentum of the mean loss's gradient; one fused kernel, see
   ``_update_mean``) and the step is taken along ``(N/σ²)·Λ⁻¹ b`` with the current ``σ²``: ``m = N·b/σ²``
   when ``σ²`` is fixed (with ``noise_variance="learned"`` the current ``σ²`` weighs the whole buffer). The KL
   clip's ``ν = min(1, √(kl_clip / Σ lr²·((N/σ²)·bᵀΛ⁻¹b [covered] + bᵀb [not covered])))``.

Parameters not covered by a block keep a point estimate: they get ``μ ← μ − ν·lr·σ²·m/N`` with the
same momentum (i.e. SGD on the mean loss plus the prior term, scaled by the KL clip's ``ν``, to whose
sum they contribute; ``kl_clip=None``: ``ν = 1``), and are not sampled.
Fixed point (lr = 1, τ = 1, exact Fisher, Bayesian linear regression): ``Λ = XᵀX + δI`` and
``μ = (XᵀX + δI)⁻¹ Xᵀy``, the closed-form posterior (tested).

Weight noise of step ``t``, global MC sample ``s`` colours one standard normal ``z`` over all
covered parameters, drawn from a generator seeded with ``hash(seed, t, s)`` (each block colours
its slice of ``z``; :mod:`torchsso2.optim.grid`): reproducible from the seed,
independent of the label sampling, and the same on every rank that draws sample ``s``. Under
``mc_parallel = R`` the ranks form a data × sample grid; sample group ``k`` draws samples
``k·m … k·m + m − 1`` (``m = num_mc_samples``), so ``R`` groups equal one process with
``num_mc_samples = R·m`` (``docs/scaling.md``).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from curvature.blocks import Block, DiagBlock
from curvature.blocks.base import compute_dtype, like_dtype
from curvature.likelihoods import check_targets
from curvature.options import Kind, LossType, check_mc_samples, did_you_mean, parse
from curvature.linalg import LinalgError
from curvature.selection import UncoveredModule

from .skips import DEFAULT_MAX_CONSECUTIVE_SKIPS
from .base import BlockAverage, Closure, CurvatureOptimizer
from .grid import NoiseStreams, SampleGrid, noise_spans
from .legacy import check_not_pytorch_sso_call
from .settings import CurvatureSettings
from .changed_model import explains_changed_model
from .precision import full_precision_step
from .steps import add_scaled_, kl_clip_factor, natural_momentum_, preconditioned_descent_
from .validation import MAX_DATASET_SIZE, MAX_LR, MAX_VI_SCALE, as_loss_tensor, check_int, check_number
from .reparam import reparam_ema_, reparam_sample
from .rollback import CurvatureRollback
from .noise import ObservationNoise
from .misuse import warn_unreached_blocks
from ..distributed.assignment import grad_worker_count
from .vi_start import debias_factor, isotropic_blocks
from .vi_checks import warn_about_batch
from .lm_forward import returned_pick
from .vi_flat import FlatDiagPath
from .vi_schedule import vi_schedule
from .vi_defaults import (DEFAULT_CURVATURE_INIT, DEFAULT_VI_EMA_DECAY, DEFAULT_VI_KL_CLIP, DEFAULT_VI_LR,
                          DEFAULT_VI_MOMENTUM_DEBIAS)
from .vi_noise import WeightNoise
from .vi_predict import PosteriorUse
from .vi_shift import Shift, negated, shifted_params

__all__ = ["VIOptimizer", "DEFAULT_CURVATURE_INIT", "DEFAULT_VI_EMA_DECAY", "DEFAULT_VI_KL_CLIP", "DEFAULT_VI_LR",
           "DEFAULT_VI_MOMENTUM_DEBIAS", "default_is_reparam", "negated", "shifted_params"]


def _no_weight_decay(given: str) -> str:
    """The message refusing a weight decay (``given``: what was passed)."""
    return (f"VIOptimizer has no weight decay ({given}): its L2 regulariser is the Gaussian prior, set with "
            "prior_precision (weight decay wd on the mean loss corresponds to prior_precision = "
            "wd * dataset_size / kl_weighting, divided by the noise variance σ² for loss='mse')")


def padding_row(embedding: nn.Embedding) -> int:
    """The row of ``embedding.weight`` its ``padding_idx`` names (a negative index counted from the end)."""
    return int(embedding.padding_idx) % embedding.num_embeddings


def default_is_reparam(approx: Any, curvature_init: Optional[float]) -> bool:
    """Whether ``curvature=None`` (the default) means ``"reparam"``: for ``approx="diag"`` with a starting
    curvature (``"fisher_mc"`` for ``"kfac"``/``"full"``/dicts; with several processes also where the
    grad workers are fewer than the ranks, see :meth:`VIOptimizer._check_reparam`)."""
    return isinstance(approx, str) and approx == "diag" and curvature_init is not None


class VIOptimizer(PosteriorUse, WeightNoise, CurvatureOptimizer):
    """Bayesian deep learning by natural-gradient VI; a real ``torch.optim.Optimizer``.

    Args:
        model: the network; its weights are the posterior mean.
        dataset_size: N, the number of training examples (>= 1); a first batch larger than it warns
            (it is not the number of batches or steps: the data weigh N × the mean loss).
        lr: step size of the mean (and of nothing else: the precision is an EMA). Default
            :data:`DEFAULT_VI_LR` = 1e-2 (the defaults train for lr in 1e-3 … 1e-1, see there).
        curvature: kind of curvature; ``approx``: ``"diag" | "kfac" | "full"`` or a dict.
            ``"reparam"`` (with ``approx="diag"``): IVON's estimator ``ĥ = g ⊙ ε/s²`` from the gradient
            at the weight sample (``s² = τ/Λ``, its variance per weight), no second backward pass (:mod:`torchsso2.optim.reparam`); its EMA
            uses IVON's positivity-preserving update. It needs only the gradients, so it covers every
            trainable parameter of any module, those no layer family knows (``nn.GRU``, a custom
            module's own ``nn.Parameter``) with a diagonal block of their own
            (:mod:`curvature.modules.parameters`); the other kinds refuse such a module (skip it, or
            use ``"reparam"``). Default ``None``: ``"reparam"`` for
            ``approx="diag"`` (the curvature costs no second backward; on the digits tasks its quality
            equals ``fisher_mc``'s, docs/defaults.md), ``"fisher_mc"`` for ``"kfac"``/``"full"``/dicts,
            and also for diag with ``curvature_init=None`` (where ``"reparam"`` is not available) or
            with several processes and ``grad_worker_fraction < 1`` (a ``NotImplementedError`` when a
            module only ``"reparam"`` covers is present). With a ``grad_scaler`` ĥ takes
            the unscaled gradient (an overflow skips the step as usual); with several processes
            each rank's ĥ comes from its shard's gradient and is averaged over the ranks like any
            curvature (W ranks on W shards equal one process at the same defaults), which needs
            every decomposition on every rank (``grad_worker_fraction="comm_opt"``, the default).
        prior_precision / prior_variance: isotropic Gaussian prior (give at most one). Default
            precision δ = 1 (unit prior variance: wider than a standard initialisation's weights,
            so the data decide; Λ ≥ τδ keeps the posterior proper along directions the data
            do not see).
        init_precision: precision of the isotropic Gaussian sampled at the first step, before any
            curvature is known (default: that of the starting curvature, ``(N·curvature_init + τδ +
            damping)/τ``; with ``curvature_init=None`` too: no noise at the first step).
        curvature_init: the curvature EMA starts at ``curvature_init·I`` (IVON's ``hess_init``; the
            first batch is folded in with weight ``1 − ema_decay``), so the first samples are
            small and the first steps bounded. Default :data:`DEFAULT_CURVATURE_INIT` = 1 (see
            there why). ``None``: start at the first batch's estimate (a batch's curvature with
            near-zero directions then gives huge first steps unless ``prior_precision`` or
            ``damping`` is large).
        num_mc_samples: weight samples per step (the closure runs once per sample, each with its own
            independent noise). The optimizer's parameters step with the mean gradient over the samples
            and K-FAC averages each Kronecker factor over them; parameters outside the optimizer (a
            network body under another optimizer) keep what the closures left in ``.grad``: the last
            sample's gradient when the closure zeroes them, else the sum over the samples.
        kl_weighting: τ > 0, weight of the KL term; the posterior covariance is τ·(N·C + τδ + damping)⁻¹
            (τ < 1: a cold, narrower posterior).
        kl_clip: bound on the mean's step, see :data:`DEFAULT_VI_KL_CLIP` (default 0.1; ``None``: off).
        momentum_debias: ``True``: the mean's step ``t`` (1, 2, …; skipped steps do not count) uses
            ``lr/(1 − momentum^t)``, IVON's bias correction of the momentum, so the first steps are as
            long as the later ones (the KL clip bounds the corrected step). ``t`` is the optimizer's step
            count, one for every group: a group added with ``add_param_group`` later (or a momentum
            changed by a scheduler) starts its buffer without the correction. Default
            :data:`DEFAULT_VI_MOMENTUM_DEBIAS` = False (see there why).
        weight_decay: 0 only (IVON's constructor takes one): the L2 term is the prior, weight decay ``wd``
            on the mean loss is ``prior_precision = wd·N/kl_weighting``; another value is a ValueError.
        momentum, ema_decay, damping: see the module docstring. Defaults 0.9 (as SGD),
            :data:`DEFAULT_VI_EMA_DECAY` = 0.99999 **per step** (IVON's β₂; see there why), 0.0 (the
            prior alone keeps Λ positive definite). The EMA is updated every ``curv_update_interval``
            steps, so ``ema_decay=None`` (the default) decays by ``0.99999 ** curv_update_interval`` per
            update: the start keeps the weight ``0.99999^t`` after ``t`` steps at any interval. An
            explicit ``ema_decay`` is the decay per update.
        curv_update_interval, inv_update_interval: estimate the curvature every that many steps and
            decompose ``Λ`` every that many steps. Default ``None``: 1 and 1 for ``approx="diag"`` (its
            ``"reparam"`` curvature comes from the step's own backward), 10 and 10 for ``"kfac"``
            (the Monte-Carlo Fisher's second backward and the factors' eigendecompositions cost
            several Adam steps: on the digits MLP at batch 64 a step costs about 2.5–3× an Adam step
            over a run instead of 6.8×, with the validation accuracy, NLL and ECE of every-step
            noisy K-FAC within noise on the digits MLP and CNN; decompositions every 100 steps were
            worse on the CNN at a small lr; docs/defaults.md, ``benchmarks/vi_kfac_intervals.py``),
            1 and 1 for ``"full"`` and dicts (:mod:`torchsso2.optim.vi_schedule`). Explicit values
            are used as given.
        loss: ``"cross_entropy"``, ``"mse"`` (the closure returns the unit-variance ``½·mean_n ‖y_n − f_n‖²``;
            ``F.mse_loss`` also averages over the D outputs: ``2/D`` of it) or ``"binary_cross_entropy"`` (a
            Bernoulli on each logit: ``F.binary_cross_entropy_with_logits`` summed over an example's outputs, mean
            over the examples; ``predict`` averages ``sigmoid(output)``). The closure's loss is the mean
            negative log-likelihood (``reduction="mean"``, no L2 term: the prior is built in); a first step
            given ``targets`` and returning ``(loss, output)`` warns when its gradient is not (a factor ``c`` on
            the gradient weighs the data ``c``-fold in the mean's update; with ``"reparam"`` in the
            curvature too: a tempered posterior; :mod:`torchsso2.optim.vi_checks`).
        noise_variance: observation noise ``σ²`` of the Gaussian likelihood (``loss="mse"`` only;
            :mod:`torchsso2.optim.noise`): a float > 0, or ``"learned"`` (the running mean of the
            squared residuals at the weight samples, the ELBO's maximiser over ``σ²`` at a still mean (a moving
            mean's jitter adds a few per cent at large steps); needs
            ``step(closure, targets=y)``). The gradient and the curvature are scaled by ``1/σ²``
            (``N/σ²`` replaces ``N`` everywhere), and ``predict(x, return_variance=True)`` adds
            ``σ²`` to the spread of the samples. Default ``None``: ``σ² = 1``. With several
            processes a step's mean squared residual is the mean over all ranks (each rank's
            mean over its shard and its samples; one all-reduce of one float per step), as the
            gradients are averaged: W ranks on W equal shards learn the ``σ²`` of one process on
            the whole batch (with ``mc_parallel = R``: of one process with ``R·m`` samples), and
            every rank holds the same ``σ²``. Unequal shards count equally, as in the gradient.
            The ``σ²`` in use is :attr:`observation_variance` (the attribute ``noise_variance`` keeps
            the argument: ``"learned"``).
        seed: seed of the sampling generator (saved in state_dict). None (default): drawn from torch's
            global generator at construction (one draw, as a DataLoader's base seed): ``torch.manual_seed``
            makes a run repeatable, and optimizers built one after another get different streams.
        communicator: ``"auto" | "none" | "torch" | "mpi"`` or a Communicator (``None`` is ``"auto"``); faults as in
            :class:`SecondOrderOptimizer` (MPI abort hooks unless ``TORCHSSO2_ABORT_ON_EXCEPTION=0``,
            collective timeout ``TORCHSSO2_DIST_TIMEOUT``, settings compared across ranks).
        skip_modules: module names (regex), class names or types, each with its submodules, left
            out of the posterior: point estimates with the mean's update ``μ ← μ − ν·lr·m`` (``m`` the momentum
            of ``g + τδσ²/N·μ``, as for the covered parameters), never sampled.
        grad_worker_fraction, assignment_strategy: KAISA placement of the decompositions over ranks,
            as in :class:`SecondOrderOptimizer`. With a fraction < 1 the grad workers also draw
            the weight noise and broadcast it (and :meth:`predict` needs ``"comm_opt"``).
        mc_parallel: number of sample groups R; the world of W ranks is a grid of W/R data ranks
            × R sample groups (shard the data with ``num_replicas=opt.data_parallel_size,
            rank=opt.data_parallel_rank``). Default 1: pure data parallelism.
        output_selector: as in :class:`SecondOrderOptimizer` (also used by :meth:`predict`).
        kfac_approx: ``"expand" | "reduce"``, as in :class:`SecondOrderOptimizer` (K-FAC blocks only).
        on_nonfinite, max_consecutive_skips: as in :class:`SecondOrderOptimizer` (a skipped step
            leaves the step count, hence the weight noise and the schedule, unchanged).
        params: optional torch.optim-style param groups (default: all trainable parameters of
            ``model``). Only these have a posterior: the model's other parameters are neither
            sampled nor updated (a Bayesian last layer: ``params=model.head.parameters()``).
        mc_samples, linalg, decomposition_dtype, grad_scaler: as in :class:`SecondOrderOptimizer`. The
            weight noise is drawn in float64 when the model or ``decomposition_dtype`` is, else in float32:
            the same seed gives other samples after a change of ``decomposition_dtype`` (the same
            distribution).
    """

    def __init__(self, model: nn.Module, dataset_size: int, lr: float = DEFAULT_VI_LR, *,
                 curvature: Optional[str] = None, approx: Any = "diag", prior_precision: Optional[float] = None,
                 prior_variance: Optional[float] = None, init_precision: Optional[float] = None,
                 num_mc_samples: int = 1, kl_weighting: float = 1.0, momentum: float = 0.9,
                 ema_decay: Optional[float] = None, damping: float = 0.0, loss: str = "cross_entropy",
                 mc_samples: int = 1, curv_update_interval: Optional[int] = None,
                 inv_update_interval: Optional[int] = None,
                 on_nonfinite: str = "skip", skip_modules: Any = None, params: Any = None,
                 linalg: Optional[str] = None, communicator: Any = "auto", seed: Optional[int] = None,
                 decomposition_dtype: Optional[torch.dtype] = None, grad_scaler: Any = None,
                 grad_worker_fraction: Any = "comm_opt", assignment_strategy: Any = "compute",
                 mc_parallel: int = 1, output_selector: Any = None,
                 max_consecutive_skips: Optional[int] = DEFAULT_MAX_CONSECUTIVE_SKIPS,
                 curvature_init: Optional[float] = DEFAULT_CURVATURE_INIT,
                 kl_clip: Optional[float] = DEFAULT_VI_KL_CLIP, kfac_approx: str = "expand",
                 noise_variance: Union[float, str, None] = None,
                 momentum_debias: bool = DEFAULT_VI_MOMENTUM_DEBIAS, weight_decay: float = 0.0) -> None:
        check_not_pytorch_sso_call(lr, "VIOptimizer")
        check_number("weight_decay", weight_decay, low=0.0)
        if weight_decay != 0.0:  # IVON's constructor takes it; here the prior is the L2 term
            raise ValueError(_no_weight_decay(f"weight_decay={weight_decay!r}"))
        self.dataset_size = check_int("dataset_size", dataset_size, low=1, high=MAX_DATASET_SIZE)
        check_number("lr", lr, low=0.0, high=MAX_LR)
        if prior_precision is not None and prior_variance is not None:
            raise ValueError("give prior_precision or prior_variance, not both "
                             f"(got prior_precision={prior_precision!r}, prior_variance={prior_variance!r})")
        if prior_variance is not None:
            self.prior_precision = 1.0 / check_number("prior_variance", prior_variance, low=1.0 / MAX_VI_SCALE)
        else:
            self.prior_precision = check_number("prior_precision", 1.0 if prior_precision is None else prior_precision,
                                                low=0.0, high=MAX_VI_SCALE)
        self.init_precision = None if init_precision is None else \
            check_number("init_precision", init_precision, low=0.0, low_open=True, high=MAX_VI_SCALE)
        self.curvature_init = None if curvature_init is None else \
            check_number("curvature_init", curvature_init, low=0.0, low_open=True, high=MAX_VI_SCALE)
        self.kl_clip = None if kl_clip is None else check_number("kl_clip", kl_clip, low=0.0, low_open=True)
        if not isinstance(momentum_debias, bool):
            raise TypeError(f"momentum_debias must be a bool, got {type(momentum_debias).__name__} {momentum_debias!r}")
        self.momentum_debias = momentum_debias
        self.num_mc_samples = check_int("num_mc_samples", num_mc_samples)
        self.kl_weighting = check_number("kl_weighting", kl_weighting, low=0.0, low_open=True, high=MAX_VI_SCALE)
        self.damping = check_number("damping", damping, low=0.0, high=MAX_VI_SCALE)
        check_number("momentum", momentum, low=0.0, high=1.0, high_open=True)
        defaults = dict(lr=lr, momentum=momentum)
        if noise_variance is not None and parse(LossType, loss, "loss") is not LossType.MSE:
            raise ValueError(f"noise_variance is the variance of the Gaussian likelihood of loss='mse'; got "
                             f"noise_variance={noise_variance!r} with loss={loss!r}")
        #: σ² of the Gaussian likelihood (1 unless loss="mse" with noise_variance=...)
        self.noise = ObservationNoise(1.0 if noise_variance is None else noise_variance)
        # compared across ranks (distributed/consistency.py): "learned" in one spelling
        self.noise_variance = "learned" if self.noise.learned else noise_variance
        if isinstance(curvature, str) and curvature.lower() == "reparam":  # any case, as the other choices
            curvature = "reparam"
        #: curvature="reparam": diagonal curvature from the step's own backward (torchsso2/optim/reparam.py)
        self.reparam = curvature == "reparam" or (curvature is None and default_is_reparam(approx, curvature_init))
        kind = "fisher_mc" if curvature is None else "fisher" if self.reparam else curvature
        if kind != "fisher":  # a name to parse first ("fisher-mc": the did-you-mean error, not this one)
            try:
                kind = parse(Kind, kind, "curvature").value
            except ValueError as err:
                if "another library's name" in str(err):
                    raise
                choices = ["reparam"] + [k.value for k in Kind]  # VIOptimizer's, with its own 'reparam'
                raise ValueError(f"curvature={curvature!r} is not supported{did_you_mean(curvature, choices)}; "
                                 f"expected None or one of {', '.join(map(repr, choices))}") from None
        default = " (curvature=None is 'reparam' with approx='diag')" if curvature is None and self.reparam else ""
        check_mc_samples(mc_samples, "reparam" if self.reparam else kind, "curvature",
                         f"{default}; weight samples per step are num_mc_samples")
        # None: the defaults per approx, and the decay per step (torchsso2/optim/vi_schedule.py)
        curv_update_interval, inv_update_interval, ema_decay = vi_schedule(
            approx, curv_update_interval, inv_update_interval, ema_decay, DEFAULT_VI_EMA_DECAY)
        self.mc_parallel = mc_parallel  # compared across ranks (checked below)
        # reparam's estimate needs only the gradients: any module's own parameters get a diagonal block
        settings = CurvatureSettings.from_arguments(locals(), curvature=kind, any_module=self.reparam)
        try:
            super().__init__(model, params, defaults, settings)
        except UncoveredModule as err:  # VIOptimizer's own way out: the default diagonal covers it
            why = " (curvature_init=None turns the default 'reparam' off: it needs a starting curvature)" \
                if curvature is None and approx == "diag" else ""
            raise UncoveredModule(
                f"{err}. VIOptimizer's default diagonal (curvature='reparam' with approx='diag') covers any module "
                f"by its parameters' gradients; curvature={kind!r}{why} needs layer curvature. A module left to the "
                "plain update with skip_modules has no weight noise: its mean is a point estimate") from None
        if curvature is None and self.reparam and self.placement.active \
                and grad_worker_count(self.comm.world_size, self.placement.grad_worker_fraction) < self.comm.world_size:
            if self.engine.generic:  # those blocks have no other estimate
                raise NotImplementedError(
                    f"modules {self.engine.generic} have no layer curvature: VIOptimizer covers them with "
                    "curvature='reparam' (the default with approx='diag'), which with several processes needs every "
                    f"rank to hold every decomposition (grad_worker_fraction='comm_opt'); got grad_worker_fraction="
                    f"{self.placement.grad_worker_fraction!r} on {self.comm.world_size} ranks. Use 'comm_opt', or "
                    "skip them (skip_modules=[...]: their mean is then a point estimate, without weight noise)")
            self.reparam = False  # reparam needs every decomposition on every rank (_check_reparam): the default falls back
        self.grid = SampleGrid(self.comm.world_size, check_int("mc_parallel", mc_parallel))  # [issue #7]
        self._noise_streams = NoiseStreams()  # the generators of the weight noise, re-seeded per (step, sample)
        self._flat = FlatDiagPath()  # curvature="reparam": the step on flat buffers (vi_flat.py)
        # a weight sample colours one standard normal over all covered parameters; block b's slice:
        self._noise_spans, self._noise_numel = noise_spans(self.engine.layouts)
        #: the padding row of each covered Embedding weight with a ``padding_idx``: torch keeps it fixed
        #: (no gradient), so it is not sampled either, unless another use of the weight trains it (a tied
        #: output head; another Embedding with the same padding row does not)
        self._padding_rows: Dict[int, int] = {
            id(lay.module.weight): padding_row(lay.module)
            for lay in self.engine.layouts.values()
            if isinstance(lay.module, nn.Embedding) and lay.module.padding_idx is not None
            and "weight" in lay.param_names
            and all(t.owner_param != "weight" or (isinstance(t.module, nn.Embedding) and t.module.padding_idx is not None
                                                  and padding_row(t.module) == padding_row(lay.module))
                    for t in lay.tied)}
        if self.reparam:
            self._check_reparam()
        self._check_posterior_scales()

    def _check_posterior_scales(self) -> None:
        """``τ·δ + λ > 0`` (a positive definite precision), and ``N/σ²`` and ``τ·δ + λ`` within float32 (each
        argument within it, their product was not). Near the bound the products with the curvature can still
        overflow (those steps are skipped)."""
        shift = self.kl_weighting * self.prior_precision + self.damping  # (not precision_shift: the PyTorch-SSO
        if not 0 < shift <= MAX_VI_SCALE:  # face ramps its prior in from 0 at the first steps)
            given = (f"prior_precision={self.prior_precision!r}, kl_weighting={self.kl_weighting!r}, "
                     f"damping={self.damping!r}")
            if shift <= 0:
                raise ValueError(f"prior_precision·kl_weighting + damping must be > 0 so that the posterior "
                                 f"precision is positive definite (for every curvature kind; the Hessian's may be "
                                 f"indefinite), got {given}")
            raise ValueError(f"prior_precision·kl_weighting + damping = {shift:g} is beyond the largest "
                             f"float32 ({MAX_VI_SCALE:g}), which the posterior's update cannot hold; got {given}")
        if not self.noise.learned and self.likelihood_size > MAX_VI_SCALE:
            raise ValueError(f"dataset_size / noise_variance = {self.likelihood_size:g} is beyond the largest float32 "
                             f"({MAX_VI_SCALE:g}), which the posterior's update cannot hold; got "
                             f"dataset_size={self.dataset_size!r}, noise_variance={self.noise_variance!r}")

    def _check_attrs(self) -> None:
        super()._check_attrs()
        self._check_posterior_scales()

    def _call_closure(self, closure: Closure) -> Tuple[Any, Any]:
        """The closure at a weight sample: ``predict()``, ``sampled_params()`` and ``step()`` inside it are
        refused (:meth:`_check_not_sampling`)."""
        self._sampling = "step()'s closure"  # the mark sampled_params() sets (PosteriorUse._check_not_sampling)
        try:
            return super()._call_closure(closure)
        finally:
            self._sampling = None

    def _check_reparam(self) -> None:
        """``curvature="reparam"`` needs diagonal blocks, a starting curvature and, with several processes,
        every decomposition on every rank (the noise's variance); a ``grad_scaler`` is fine (the
        estimate is unscaled as it is formed, in :meth:`_reparam_sample`)."""
        shapes = {a.value for a in self.engine.approx.values()}
        if shapes - {"diag"}:
            raise ValueError(f"curvature='reparam' estimates a diagonal; it needs approx='diag', got blocks {sorted(shapes)}")
        if self.curvature_init is None:
            raise ValueError("curvature='reparam' needs curvature_init > 0: its estimate can be negative, so the "
                             "running curvature must start positive (got curvature_init=None)")
        if self.placement.active and grad_worker_count(self.comm.world_size, self.placement.grad_worker_fraction) \
                < self.comm.world_size:
            raise NotImplementedError(f"curvature='reparam' with several processes needs every rank to hold every "
                                      f"decomposition (grad_worker_fraction='comm_opt'); got grad_worker_fraction="
                                      f"{self.placement.grad_worker_fraction!r} on {self.comm.world_size} ranks")

    def _reparam_sample(self, noise: Optional[Shift]) -> Dict[str, Tensor]:
        """``ĥ = g ⊙ ε / s²`` of one weight sample, ``[P_b]`` per block (:func:`~torchsso2.optim.reparam.reparam_sample`)."""
        return reparam_sample(self, noise)

    # ---- the posterior ---------------------------------------------------------------------
    @property
    def likelihood_size(self) -> float:
        """``N/σ²``: the weight of the unit-variance loss's gradient and curvature in the posterior
        (``N`` = dataset_size; ``σ² = 1`` unless ``noise_variance`` is given or learned)."""
        return self.dataset_size / self.noise.variance

    @property
    def observation_variance(self) -> float:
        """``σ²`` of the Gaussian likelihood in use now (``loss="mse"``): ``noise_variance`` as given, or under
        ``noise_variance="learned"`` the current estimate (it moves with the steps; 1 before the first); 1 without
        ``noise_variance`` and for the other losses."""
        return float(self.noise.variance)

    @property
    def precision_shift(self) -> float:
        """``τ·δ + damping``: what is added to ``N·C`` on the diagonal."""
        return self.kl_weighting * self.prior_precision + self.damping

    @property
    def _noise_scale(self) -> float:
        """``√τ``: draws from ``N(0, Λ⁻¹)`` are scaled to the posterior covariance ``τ·Λ⁻¹``."""
        return self.kl_weighting ** 0.5

    @property
    def _first_precision(self) -> Optional[float]:
        """Precision of the isotropic noise before the first decomposition: ``init_precision`` if
        given, else that of the starting curvature, ``(N·curvature_init + τδ + damping)/τ``, else None."""
        if self.init_precision is not None:
            return self.init_precision
        if self.curvature_init is not None:
            return (self.likelihood_size * self.curvature_init + self.precision_shift) / self.kl_weighting
        return None

    def _noise_kind(self) -> Tuple[torch.dtype, torch.device]:
        """dtype (float64 when a covered parameter or the decompositions are, else float32) and device
        of the weight noise; followed when ``model.double()`` / ``model.to(device)`` change the first
        covered parameter after construction (recomputed only then)."""
        first = self._covered_at_start[0] if self._covered_at_start else None
        key = None if first is None else (first.dtype, first.device)
        cached = getattr(self, "_noise_cache", None)
        if cached is None or cached[0] != key:
            wide = self.decomposition_dtype == torch.float64 or \
                any(p.dtype == torch.float64 for p in self._covered_at_start)
            device = first.device if first is not None else torch.device("cpu")
            kind = (torch.float64 if wide else torch.float32, device)
            self._noise_cache = cached = (key, kind)
        return cached[1]

    @property
    def _noise_dtype(self) -> torch.dtype:
        return self._noise_kind()[0]

    @property
    def _noise_device(self) -> torch.device:
        return self._noise_kind()[1]

    # ---- the data × sample grid [issue #7] ------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        """Number of data shards ``W / mc_parallel`` (the sampler's ``num_replicas``)."""
        return self.grid.data_size

    @property
    def data_parallel_rank(self) -> int:
        """Which data shard this rank reads (the sampler's ``rank``)."""
        return self.grid.data_rank(self.comm.rank)

    @property
    def sample_group(self) -> int:
        """Which MC sample group this rank belongs to."""
        return self.grid.sample_group(self.comm.rank)

    # ---- the step ---------------------------------------------------------------------------------
    @explains_changed_model  # a step failing on a model sharded or re-created since: say so
    @full_precision_step  # the optimizer's math outside torch.autocast, the closure inside it
    def step(self, closure: Optional[Closure] = None, targets: Optional[Tensor] = None) -> Any:  # type: ignore[override]
        """One VI step (``num_mc_samples`` closure calls, each at a weight sample); returns the mean loss
        over the samples if the closure returns the loss alone (torch.optim's convention), else
        ``(mean loss, last output)`` for a closure returning ``(loss, output)``.

        ``closure``: zero-grads, runs the model's forward, calls ``backward()`` and returns the loss (a
        tensor of one element) or ``(loss, output)`` (the model output, ``[N, ...]``). ``targets``: the
        batch's labels ``[N]`` (targets of the output's shape for ``loss="mse"`` and ``"binary_cross_entropy"``), needed by
        ``noise_variance="learned"``."""
        self._check_step_call(closure)
        check_targets(targets)
        self._follow_param_dtypes()  # before the weight noise is drawn from the decompositions
        self._redo_loaded_decompositions()
        if self.reparam and self._decomposed and len(self.running.blocks) != len(self.engine.layouts):
            self._start_unfrozen_blocks()
        if self.reparam:  # the one-process diagonal step on flat buffers (torchsso2/optim/vi_flat.py)
            done = self._flat.step(self, closure, targets)
            if done is not None:
                return self._output_checked(done, targets)
        estimate = self.num_steps % self.curv_update_interval == 0
        snapshot = self._snapshot()  # given back if the step is skipped (torchsso2/optim/skips.py)
        trainable = [p for g in self.param_groups for p in g["params"]] if self.num_mc_samples > 1 else []
        grad_sum: Dict[int, Tensor] = {}
        curvature = BlockAverage() if estimate else None
        losses = []
        output = None
        hats: Dict[str, Tensor] = {}
        residuals: List[float] = []  # noise_variance="learned": each sample's mean squared residual
        if self.noise.learned and targets is None:
            raise ValueError("noise_variance='learned' estimates σ² from the residuals: call step(closure, targets=y)")
        if self.reparam:  # the curvature comes from the samples' own gradients: no capture, no second backward
            curvature = None
        try:
            for noise in self._step_noise():
                with self._perturbed(noise):
                    loss, output, fresh = self._run_closure(closure, targets, estimate and not self.reparam)
                losses.append(loss.detach() if isinstance(loss, Tensor) else as_loss_tensor(loss))
                if self.noise.learned:
                    residuals.append(ObservationNoise.mean_squared_residual(self._residual_output(output, targets),
                                                                            targets))
                if self.reparam and estimate:
                    self._refuse_ddp_averaged_samples()
                    for name, h in self._reparam_sample(noise).items():
                        hats[name] = hats[name] + h if name in hats else h
                if curvature is not None:  # {} marks a sample whose output was not finite
                    curvature.nonfinite |= not fresh
                    if fresh:
                        curvature.add(fresh, 1)
                if self.num_mc_samples == 1:  # the gradient stays in p.grad as the closure left it
                    break
                for p in trainable:
                    if p.grad is not None:
                        g = p.grad.detach()
                        grad_sum[id(p)] = grad_sum[id(p)] + g if id(p) in grad_sum else g.clone()
                        p.grad = None  # taken: the next sample's backward starts afresh (whether or not
                        # its closure zeroes the gradients)
        except BaseException:  # a closure that raised (a bad batch caught by the caller, Ctrl-C): the Monte-Carlo
            snapshot.restore()  # labels drawn are given back, so training on is as if the call never happened
            raise
        if self.num_mc_samples > 1:
            for p in trainable:  # the averaged gradient goes through p.grad (and the grad scaler, if any)
                p.grad = grad_sum[id(p)] / self.num_mc_samples if id(p) in grad_sum else None
        return self._output_checked(self._finish_step(snapshot, losses, output, hats, curvature, residuals, targets),
                                    targets)

    def _refuse_ddp_averaged_samples(self) -> None:
        """``curvature="reparam"`` with sample groups (``mc_parallel > 1``): a ``DistributedDataParallel``
        wrapper that averaged any of this closure call's gradients (one forward of several, one sample of
        several) did so over ranks, across the groups, and each group's ``ĥ = g ⊙ ε/s²`` needs its own gradient
        with its own ``ε`` (the step's state is given back)."""
        sync = self.__dict__.get("_ddp_sync")
        if self.grid.mc_parallel <= 1 or sync is None:
            return
        # a DDP over ranks of one sample group (its data shards, one ε) is fine: ĥ is linear in g
        if any(ranks is None or len({self.grid.sample_group(r) for r in ranks}) > 1 for ranks in sync.call_averaged):
            raise ValueError(
                f"VIOptimizer(curvature='reparam', mc_parallel={self.grid.mc_parallel}): DistributedDataParallel "
                "averaged this step's gradients over ranks of different sample groups before the estimate "
                "ĥ = g ⊙ ε/s² could pair each group's gradient with its own weight sample ε. Run the model without "
                "the DDP wrapper (the optimizer averages the gradients itself, docs/scaling.md), or use "
                "mc_parallel=1, or a curvature kind that does not read the gradient (curvature='fisher_mc' or "
                "'fisher'); the optimizer is unchanged")

    def _keeps_output_grads(self, targets: Optional[Tensor]) -> bool:
        """The first step's watch keeps the output's gradient for the loss-scale check (:mod:`.vi_checks`)."""
        return targets is not None and self.num_mc_samples == 1 and not self.__dict__.get("_batch_checked", False)

    def _output_use(self, targets: Optional[Tensor]) -> Tuple[bool, bool]:
        return bool(self.reparam) or super()._output_use(targets)[0], True  # predict() averages the output

    def _rows_counted(self, targets: Optional[Tensor]) -> Optional[str]:
        return None if self.reparam else super()._rows_counted(targets)  # ĥ = g ⊙ ε/s² reads the loss's gradient

    def _categorical_use(self, targets: Optional[Tensor]) -> Optional[str]:
        if self.engine.loss is not LossType.CROSS_ENTROPY:
            return None
        own = None if self.reparam else super()._categorical_use(targets)
        return own or "predict() averages softmax(output) over the weight samples: a categorical likelihood."

    def _redo_loaded_decompositions(self) -> None:
        """At the start of a step (every rank is there): a loaded posterior whose decompositions are missing
        (saved on a rank that held only part of them) or another posterior's (built with another
        ``dataset_size``, prior, ``kl_weighting``, damping or noise variance) is decomposed before the step's
        weight noise, so that it is a sample of it, not of the isotropic start or of the old posterior."""
        self.__dict__.pop("_loaded_decomposed_here", None)
        if self.__dict__.pop("_loaded_undecomposed", False):
            self._decompose(self.precision_shift, scale=self.likelihood_size)

    def _decompose_loaded_here(self) -> None:
        """The same before a sample outside a step (``sampled_params``, ``predict``), which one rank may take
        alone (an evaluation on rank 0): this rank decomposes every block itself (each rank holds the whole
        running curvature), without collectives and without the skip policy (a failure is a RuntimeError);
        the next step still decomposes on every rank together."""
        if not self.__dict__.get("_loaded_undecomposed", False) or self.__dict__.get("_loaded_decomposed_here"):
            return
        if not self.placement.active:  # one process: no collectives, the step's own decomposition
            self._redo_loaded_decompositions()
            return
        try:
            self.running.decompose(self.precision_shift, scale=self.likelihood_size, backend=self.linalg,
                                   dtype=self.decomposition_dtype, kfac_method=self.kfac_method)
        except LinalgError as err:
            raise RuntimeError(f"the loaded posterior could not be decomposed for this sample ({err}); take a step "
                               "first (it decomposes under the optimizer's non-finite policy)") from err
        self._decomposed = True
        self._loaded_decomposed_here = True

    def _start_unfrozen_blocks(self) -> None:
        """``curvature="reparam"``: a covered module frozen before the first step and trainable now (in the
        param groups) gets its block at ``curvature_init·I``, decomposed, before this step's noise is drawn.
        Its estimate ``ĥ = g·ε/s²`` needs a weight sample of it, and the noise is drawn from the running
        blocks: without this it would never be sampled and never get a block (a point estimate)."""
        in_groups = {id(p) for g in self.param_groups for p in g["params"]}
        missing = [lay for name, lay in self.engine.layouts.items() if name not in self.running.blocks
                   and any(p.requires_grad and id(p) in in_groups for p in lay.params)]
        if not missing:
            return
        init = float(self.curvature_init)  # type: ignore[arg-type]  # reparam requires it
        for lay in missing:
            first = lay.params[0]
            self.running.blocks[lay.name] = DiagBlock(lay, torch.full((lay.numel,), init, device=first.device,
                                                                      dtype=compute_dtype(first.dtype)))
        # a positive diagonal plus a positive shift: the decomposition cannot fail
        self.running.decompose(self.precision_shift, scale=self.likelihood_size, backend=self.linalg,
                               dtype=self.decomposition_dtype, names=[lay.name for lay in missing])

    def _residual_output(self, output: Any, targets: Tensor) -> Optional[Tensor]:
        """The output ``noise_variance="learned"`` compares with ``targets``: the ``output_selector``'s pick of
        what the closure returned, or that tensor itself where the closure returns the pick already. Which of
        the two is told at the first step (:func:`~torchsso2.optim.lm_forward.returned_pick`) and kept: the
        same closure returns the same form at every step."""
        if output is None:
            return None
        if self.engine.output_selector is None or not isinstance(output, Tensor):
            return self.engine.select_output(output)
        returns_pick = self.__dict__.get("_closure_returns_pick")
        if returns_pick is None:
            returns_pick = self._closure_returns_pick = returned_pick(self.engine, output, targets) is output
        return output if returns_pick else self.engine.select_output(output)

    def _output_checked(self, result: Tuple[Tensor, Any], targets: Optional[Tensor]) -> Any:
        """What ``step`` returns for ``result`` (``(mean loss, output)``); at the first step, the model
        output is checked to be (or to select, with ``output_selector``) a tensor, so that a
        dict-returning model without ``output_selector`` fails at once, not at ``predict`` after the
        training (the diagonal's step never reads the output); the batch's size and the loss's scale
        are checked once (:mod:`torchsso2.optim.vi_checks`: warnings)."""
        if not self.__dict__.get("_output_seen", False):
            if result[1] is not None and not isinstance(result[1], Tensor):  # the closure may return either form
                self.engine.select_output(result[1])
            self._output_seen = True
        if not self.__dict__.get("_batch_checked", False):  # the first step's closure: the same later
            self._batch_checked = True
            warn_about_batch(self, targets, *result)
        return self._step_result(*result)

    def _finish_step(self, snapshot: Any, losses: List[Tensor], output: Any, hats: Dict[str, Tensor],
                     curvature: Optional[BlockAverage], residuals: Sequence[float] = (),
                     targets: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """The step after its closure calls (``p.grad`` holds the mean gradient over the samples):
        the non-finite policy, the curvature EMA, the decomposition and the mean's update
        (``residuals``: the samples' mean squared residuals, for ``noise_variance="learned"``; ``targets``: the
        step's, named where they are not finite)."""
        mean_loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        if not self._unscale_grads():  # an AMP overflow skips the step, reparam's estimate with it, as if the
            snapshot.restore()          # batch was never seen: num_steps, the schedules and the streams stay
            return mean_loss, output
        # noise_variance="learned": the samples' mean, then the mean over all ranks (every rank gets here)
        residual = self._mean_over_ranks(sum(residuals) / len(residuals)) if residuals else None
        fresh = curvature.result() if curvature is not None else None
        if hats:
            # ĥ = g ⊙ ε/s² of each sample (unscaled as formed, see _reparam_sample): their mean
            fresh = self._without_frozen({name: DiagBlock(self.engine.layouts[name], h / len(losses))
                                          for name, h in hats.items()})
        agreed, params, groups = self._average_over_ranks(fresh, mean_loss)
        grads = [p.grad for p in params]
        if not agreed or not self._batch_is_finite(mean_loss, grads, fresh):
            self._refuse_nonfinite_targets(targets, snapshot)
            self._nonfinite("loss, gradient or curvature", snapshot,
                            self._what_is_nonfinite(mean_loss, fresh, not agreed))
            return mean_loss, output
        if residual is not None:  # σ² of this step includes this batch (its 1/σ² scales the update below)
            self.noise.update(residual)
        new = False
        missing: Dict[str, Block] = {}
        if fresh:
            warn_unreached_blocks(self, fresh)
        # what an overflowing update, or Ctrl-C in the EMA or a decomposition, puts back: the block set, the
        # decompositions and counts (no block half-updated); the statistics may keep an interrupted batch
        # (torchsso2/optim/rollback.py)
        rollback = CurvatureRollback(self, False)
        try:
            if fresh is not None:
                if not self.running.blocks and self.curvature_init is not None:  # the EMA starts at curvature_init·I
                    self.running.update(isotropic_blocks(fresh, self.curvature_init), 0.0)
                # a block seen for the first time later (frozen at the start, a head earlier batches did not call)
                missing = {n: b for n, b in fresh.items() if n not in self.running.blocks}
                if missing:
                    new = True
                    if self.curvature_init is not None or self.reparam:  # its EMA starts at curvature_init·I too
                        self.running.blocks.update(isotropic_blocks(missing, self.curvature_init))
                if self.reparam:  # IVON's update: stays positive whatever the sign of ĥ
                    updated = {}
                    for name, blk in fresh.items():
                        run = self.running.blocks[name].diagonal
                        updated[name] = run.clone()
                        reparam_ema_(updated[name], blk.diagonal.to(run.dtype), self.ema_decay,
                                     self.precision_shift / self.likelihood_size, self._scalars)
                    # a huge finite gradient overflows the update (or its denominator scale·C + damping): a
                    # non-finite step, as one with an infinite gradient (the curvature would stay unusable)
                    overflow = [name for name, c in updated.items() if c.numel() and not bool(torch.isfinite(
                        c.abs().max() * self.likelihood_size + self.precision_shift))]
                    if overflow:
                        rollback.restore(self)
                        self._nonfinite("curvature (its update overflowed)", snapshot,
                                        lambda: f"the curvature update of blocks {overflow} overflowed")
                        return mean_loss, output
                    for name, c in updated.items():
                        self.running.blocks[name].diagonal.copy_(c)
                    self.running.num_updates += 1
                else:
                    self.running.update(fresh, self.ema_decay)
            if self.num_steps % self.inv_update_interval == 0 or not self._decomposed or new:
                if not self._decompose(self.precision_shift, scale=self.likelihood_size):
                    if not self._decomposed:
                        # no posterior to step with yet: a skipped step, which leaves the step count (the weight noise,
                        # the schedules and momentum_debias's step t) as it was; the curvature keeps the batch
                        return mean_loss, output
                    self._forget_blocks(list(missing))  # the others keep their decompositions; a new one has none
        except BaseException as exc:
            rollback.restore(self, exc)
            snapshot.restore()
            raise
        self._update_mean(params, groups, grads)
        self._step_taken()
        self.num_steps += 1
        return mean_loss, output

    def _update_mean(self, params: List[nn.Parameter], groups: List[Dict[str, Any]], grads: List[Tensor]) -> None:
        """``m ← momentum·m + (g + τδσ²/N·μ)`` (the momentum of the mean loss's gradient; ``N·m/σ²`` is VOGN's
        ``m`` of the summed loss); ``μ ← μ − ν·lr·Λ⁻¹ N·m/σ²`` (covered), ``μ ← μ − ν·lr·m`` (others), ``ν`` the KL
        clip's factor over all of them (1 with ``kl_clip=None``, which takes the fused path)."""
        n, tau_delta = self.likelihood_size, self.kl_weighting * self.prior_precision
        plan = self._plan(params, groups)
        with torch.no_grad():
            bufs = natural_momentum_([self.state[p] for p in params], grads, params, tau_delta / n,
                                     plan.values("momentum"))
            lrs = plan.values("lr")
            if self.momentum_debias:  # step t = num_steps + 1 (a skipped step updates no buffer)
                lrs = [lr * debias_factor(mom, self.num_steps + 1) for lr, mom in zip(lrs, plan.values("momentum"))]
            if self.placement.active or self.kl_clip is not None:
                if self.placement.active:  # [issue #7] each block solved by its grad workers
                    covered = {blk.layout.name: blk for blk, _ in plan.blocks}
                    direction = self._precondition(covered, {id(p): b for p, b in zip(params, bufs)})
                    solved = [direction[id(p)] for p in params]
                else:
                    solved = plan.precondition(bufs)
                steps = [like_dtype(d * n if inside else b, p)
                         for d, b, inside, p in zip(solved, bufs, plan.in_block, params)]
                if self.kl_clip is not None:  # ν = min(1, √(kl_clip / Σ lr²·uᵀm)): the step under Λ/N
                    nu = kl_clip_factor(steps, bufs, lrs, self.kl_clip)
                    lrs = [lr * nu for lr in lrs]
                add_scaled_(params, steps, lrs)
            else:
                preconditioned_descent_(plan, params, bufs, lrs, n, 1.0)

    face_name = "VIOptimizer"

    #: no weight decay: the prior (``prior_precision``) is VI's L2 term, so a group's ``weight_decay``
    #: may only be 0 (a recipe's "no decay" group); anything else would be ignored
    _GROUP_RANGES = (("lr", MAX_LR, False), ("momentum", 1.0, True), ("weight_decay", 0.0, False))
    _REFUSED_GROUP_KEYS = CurvatureOptimizer._REFUSED_GROUP_KEYS | {"prior_precision", "prior_variance"}
    _STEP_ATTRS = CurvatureOptimizer._STEP_ATTRS + (
        ("damping", 0.0, False, MAX_VI_SCALE, False, False), ("kl_weighting", 0.0, True, MAX_VI_SCALE, False, False),
        ("prior_precision", 0.0, False, MAX_VI_SCALE, False, False))

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """As :meth:`CurvatureOptimizer.add_param_group`; a non-zero ``weight_decay`` is a ValueError
        (VI's L2 regulariser is the prior: ``prior_precision``), and so is a per-group prior (one
        ``prior_precision`` covers every parameter)."""
        if isinstance(param_group, dict):
            per_group = [k for k in ("prior_precision", "prior_variance") if k in param_group]
            if per_group:
                raise ValueError(f"param group {per_group[0]}={param_group[per_group[0]]!r}: VIOptimizer's prior is "
                                 "one isotropic Gaussian for every parameter (the constructor's prior_precision / "
                                 "prior_variance); a per-group prior is not supported")
        if isinstance(param_group, dict) and param_group.get("weight_decay", 0.0) != 0.0:
            raise ValueError(_no_weight_decay(f"param group weight_decay={param_group['weight_decay']!r}"))
        super().add_param_group(param_group)

    def _check_extra_state(self, state: Dict[str, Any]) -> None:
        momentum = state.get("momentum")
        if momentum is not None and not isinstance(momentum, str):
            raise ValueError("checkpoint entry ['torchsso2']['extra']['momentum'] must be a string; "
                             "the optimizer is unchanged")
        noise = state.get("noise")
        if noise is not None:
            if not isinstance(noise, dict):
                raise ValueError(f"checkpoint entry ['torchsso2']['extra']['noise'] must be a dict, got {noise!r}; "
                                 "the optimizer is unchanged")
            ObservationNoise("learned").load(noise)  # validates on a throwaway copy
        posterior = state.get("posterior")
        if posterior is not None and not (isinstance(posterior, (list, tuple)) and len(posterior) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in posterior)):
            raise ValueError(f"checkpoint entry ['torchsso2']['extra']['posterior'] must be two finite numbers "
                             f"[scale, shift], got {posterior!r}; the optimizer is unchanged")

    def _curvature_name(self) -> str:
        return "reparam" if self.reparam else super()._curvature_name()

    def _extra_state(self) -> Dict[str, Any]:
        # momentum buffers of the mean loss's gradient (since 2026-11-24); the learned σ²'s running mean; the
        # scale and shift the saved decompositions were built with (scale·C + shift: N/σ², τδ + damping)
        return {"momentum": "mean-loss", "noise": self.noise.state(),
                "posterior": [float(self.likelihood_size), float(self.precision_shift)]}

    def _load_extra_state(self, state: Dict[str, Any]) -> None:
        self.noise.load(state.get("noise"))
        saved = state.get("posterior")
        if saved is not None and self._decomposed and not all(
                math.isclose(a, b, rel_tol=1e-12) for a, b in zip(saved, (self.likelihood_size, self.precision_shift))):
            # built with another dataset_size, prior, kl_weighting, damping or noise variance: the saved
            # decompositions are another posterior's; redone (before the next weight sample) from the curvature
            self._decomposed = False
        if state.get("momentum") != "mean-loss":  # an older checkpoint kept N·m (VOGN's summed-loss momentum)
            with torch.no_grad():
                for p in (q for g in self.param_groups for q in g["params"]):
                    buf = self.state.get(p, {}).get("momentum_buffer")
                    if buf is not None:
                        buf.div_(self.dataset_size)
