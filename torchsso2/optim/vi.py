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
4. ``m ← momentum·m + (N·ḡ + τ·δ·μ)``; ``μ ← μ − lr·Λ⁻¹ m`` (VOGN; ``diag`` = VOGN,
   ``kfac`` = noisy K-FAC, ``full`` = full covariance per module). The buffer in ``state`` holds
   ``m/N`` (the momentum of the mean loss's gradient; one fused kernel, see ``_update_mean``).

Parameters not covered by a block keep a point estimate: they get ``μ ← μ − lr·m/N`` with the
same momentum (i.e. SGD on the mean loss plus the prior term), and are not sampled.
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

import contextlib
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from curvature.blocks import DiagBlock
from curvature.blocks.base import like_dtype
from curvature.options import LossType

from .base import BlockAverage, Closure, CurvatureOptimizer
from .grid import NoiseStreams, SampleGrid, noise_seed, noise_spans
from .legacy import check_not_pytorch_sso_call
from .plan import params_with_grad
from .precision import full_precision_step
from .steps import add_scaled_, natural_momentum_, preconditioned_descent_
from .validation import check_int, check_number


#: a weight sample as the parameters it moves, their shifts and optional factors: ``θ + shift``, or
#: ``θ + shift ⊙ factor`` (diagonal blocks: a standard normal and ``√τ/√denom``); parameter shapes
Shift = Tuple[List[nn.Parameter], List[Tensor], Optional[List[Tensor]]]


class shifted_params:  # noqa: N801  (used like a function: ``with shifted_params(params, shifts):``)
    """The body sees ``θ + shift`` (``θ + shift ⊙ factor`` with ``factors``) in every parameter
    (shapes as the parameters); ``θ`` is back after.

    The parameters point at fresh tensors ``θ + shift`` and get their own tensors back
    afterwards: one pass over the weights instead of clone + add + copy back, and ``θ`` is
    restored bit for bit (it is never written). A plain class, not a generator-based
    ``contextlib.contextmanager``: this runs at every VI step, where the generator machinery
    cost ~5 µs of a ~400 µs step (digits MLP).
    """

    def __init__(self, params: Sequence[nn.Parameter], shifts: Sequence[Tensor],
                 factors: Optional[Sequence[Tensor]] = None) -> None:
        self.params = list(params)
        self.shifts = list(shifts)
        self.factors = None if factors is None else list(factors)
        self.means: List[Tensor] = []

    def __enter__(self) -> None:
        self.means = [p.data for p in self.params]
        if not self.params:  # nothing covered: the foreach ops refuse empty lists
            return
        with torch.no_grad():
            sampled = torch._foreach_add(self.means, self.shifts) if self.factors is None else \
                torch._foreach_addcmul(self.means, self.shifts, self.factors)
        try:
            for p, w in zip(self.params, sampled):
                p.data = w
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: Any) -> None:
        for p, m in zip(self.params, self.means):
            p.data = m
        self.means = []


class VIOptimizer(CurvatureOptimizer):
    """Bayesian deep learning by natural-gradient VI; a real ``torch.optim.Optimizer``.

    Args:
        model: the network; its weights are the posterior mean.
        dataset_size: N, the number of training examples (>= 1).
        lr: step size of the mean (and of nothing else: the precision is an EMA).
        curvature: kind of curvature (default ``"fisher_mc"``); ``approx``: ``"diag" | "kfac" | "full"`` or a dict.
        prior_precision / prior_variance: isotropic Gaussian prior (give at most one).
        init_precision: precision of the isotropic Gaussian sampled at the first step, before any
            curvature is known (default: no noise at the first step).
        num_mc_samples: weight samples per step (the closure runs once per sample).
        kl_weighting: τ > 0, weight of the KL term; the posterior covariance is τ·(N·C + τδ + damping)⁻¹
            (τ < 1: a cold, narrower posterior).
        momentum, ema_decay, damping: see the module docstring.
        loss: ``"cross_entropy"`` or ``"mse"``.
        seed: seed of the sampling generator (saved in state_dict).
        skip_modules: module names (regex), class names or types, each with its submodules, left
            out of the posterior: point estimates with the mean's update ``μ ← μ − lr·(N·g + τδ·μ)/N``,
            never sampled.
        grad_worker_fraction, assignment_strategy: KAISA placement of the decompositions over ranks,
            as in :class:`SecondOrderOptimizer`. With a fraction < 1 the grad workers also draw
            the weight noise and broadcast it (and :meth:`predict` needs ``"comm_opt"``).
        mc_parallel: number of sample groups R; the world of W ranks is a grid of W/R data ranks
            × R sample groups (shard the data with ``num_replicas=opt.data_parallel_size,
            rank=opt.data_parallel_rank``). Default 1: pure data parallelism.
        output_selector: as in :class:`SecondOrderOptimizer` (also used by :meth:`predict`).
    """

    def __init__(self, model: nn.Module, dataset_size: int, lr: float = 1e-3, *,
                 curvature: str = "fisher_mc", approx: Any = "diag", prior_precision: Optional[float] = None,
                 prior_variance: Optional[float] = None, init_precision: Optional[float] = None,
                 num_mc_samples: int = 1, kl_weighting: float = 1.0, momentum: float = 0.9,
                 ema_decay: float = 0.999, damping: float = 0.0, loss: str = "cross_entropy",
                 mc_samples: int = 1, curv_update_interval: int = 1, inv_update_interval: int = 1,
                 on_nonfinite: str = "skip", skip_modules: Any = None, params: Any = None,
                 linalg: Optional[str] = None, communicator: Any = "auto", seed: Optional[int] = None,
                 decomposition_dtype: Optional[torch.dtype] = None, grad_scaler: Any = None,
                 grad_worker_fraction: Any = "comm_opt", assignment_strategy: Any = "compute",
                 mc_parallel: int = 1, output_selector: Any = None) -> None:
        check_not_pytorch_sso_call(lr, "VIOptimizer")
        self.dataset_size = check_int("dataset_size", dataset_size, low=1)
        check_number("lr", lr, low=0.0)
        if prior_precision is not None and prior_variance is not None:
            raise ValueError("give prior_precision or prior_variance, not both "
                             f"(got prior_precision={prior_precision!r}, prior_variance={prior_variance!r})")
        if prior_variance is not None:
            self.prior_precision = 1.0 / check_number("prior_variance", prior_variance, low=0.0, low_open=True)
        else:
            self.prior_precision = check_number("prior_precision", 1.0 if prior_precision is None else prior_precision,
                                                low=0.0)
        self.init_precision = None if init_precision is None else \
            check_number("init_precision", init_precision, low=0.0, low_open=True)
        self.num_mc_samples = check_int("num_mc_samples", num_mc_samples)
        self.kl_weighting = check_number("kl_weighting", kl_weighting, low=0.0, low_open=True)
        self.damping = check_number("damping", damping, low=0.0)
        check_number("momentum", momentum, low=0.0, high=1.0, high_open=True)
        defaults = dict(lr=lr, momentum=momentum)
        super().__init__(model, params, defaults, curvature=curvature, approx=approx, loss=loss,
                         mc_samples=mc_samples, skip_modules=skip_modules, ema_decay=ema_decay,
                         curv_update_interval=curv_update_interval, inv_update_interval=inv_update_interval,
                         on_nonfinite=on_nonfinite, linalg=linalg, communicator=communicator, seed=seed,
                         decomposition_dtype=decomposition_dtype, grad_scaler=grad_scaler,
                         grad_worker_fraction=grad_worker_fraction, assignment_strategy=assignment_strategy,
                         output_selector=output_selector)
        self.grid = SampleGrid(self.comm.world_size, check_int("mc_parallel", mc_parallel))  # [issue #7]
        self._noise_streams = NoiseStreams()  # the generators of the weight noise, re-seeded per (step, sample)
        # a weight sample colours one standard normal over all covered parameters; block b's slice:
        self._noise_spans, self._noise_numel = noise_spans(self.engine.layouts)
        covered = self._covered()
        wide = torch.float64 in [p.dtype for p in covered] + [decomposition_dtype]
        self._noise_dtype = torch.float64 if wide else torch.float32
        self._noise_device = covered[0].device if covered else torch.device("cpu")
        if self.prior_precision * self.kl_weighting + self.damping <= 0 and self.engine.kind.value != "hessian":
            raise ValueError("prior_precision·kl_weighting + damping must be > 0 so that the posterior precision "
                             "is positive definite")

    # ---- the posterior ---------------------------------------------------------------------
    @property
    def precision_shift(self) -> float:
        """``τ·δ + damping``: what is added to ``N·C`` on the diagonal."""
        return self.kl_weighting * self.prior_precision + self.damping

    @property
    def _noise_scale(self) -> float:
        """``√τ``: draws from ``N(0, Λ⁻¹)`` are scaled to the posterior covariance ``τ·Λ⁻¹``."""
        return self.kl_weighting ** 0.5

    def _covered(self) -> List[nn.Parameter]:
        return self.engine.params

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

    def _step_noise(self) -> List[Optional[Shift]]:
        """The weight samples of this rank's ``num_mc_samples`` draws at this step (None: no noise yet).

        Global sample ``s`` colours one standard normal ``z ~ N(0, I_P)`` over all covered
        parameters, drawn from a generator seeded with ``noise_seed(seed, step, s)``; block ``b``
        takes the slice of ``z`` at its offset (blocks in the engine's order). With fewer grad
        workers than ranks, each block's grad worker colours the samples its receivers need and
        broadcasts them (:meth:`Placement.share`).
        """
        m = self.num_mc_samples
        mine = self.grid.samples(self.comm.rank, m)
        if not self._decomposed and self.init_precision is None:
            return [None] * m
        step = self.num_steps
        draws: Dict[int, Tensor] = {}

        def z_of(s: int) -> Tensor:  # sample s's standard normal, drawn once per step on this rank
            if s not in draws:
                draws[s] = self._standard_normal(self._noise_streams.seeded(noise_seed(self.seed, step, s),
                                                                            self._noise_device))
            return draws[s]

        if not self._decomposed:  # isotropic init noise: needs no decomposition, drawn locally
            return [self._isotropic(z_of(s)) for s in mine]
        if not self.placement.active:  # one process: each block colours its slice here (no sharing)
            return [self._coloured_all(z_of(s)) for s in mine]
        shifts: List[Shift] = [([], [], None) for _ in mine]
        order: Dict[str, List[int]] = {}

        def needed(name: str, receivers: Tuple[int, ...]) -> List[int]:
            order[name] = sorted({s for r in receivers for s in self.grid.samples(r, m)})
            return order[name]

        def draw(name: str, blk: Any, receivers: Tuple[int, ...]) -> List[Tensor]:
            coloured = [self._coloured(name, blk, z_of(s)) for s in needed(name, receivers)]
            if len(coloured) == 1:  # the common case: no copy into a stack
                return [d.unsqueeze(0) for d in coloured[0]]
            return [torch.stack([d[i] for d in coloured]) for i in range(len(blk.layout.params))]

        def like(name: str, blk: Any, receivers: Tuple[int, ...]) -> List[Tensor]:
            k = len(needed(name, receivers))
            return [p.new_empty((k,) + tuple(p.shape)) for p in blk.layout.params]

        shared = self.placement.share(self.running.blocks, draw, like)
        for name, stacked in shared.items():
            for (params, eps, _), s in zip(shifts, mine):
                row = order[name].index(s)
                params.extend(self.running.blocks[name].layout.params)
                eps.extend(t[row] for t in stacked)
        return shifts

    def _standard_normal(self, generator: torch.Generator) -> Tensor:
        """``z ~ N(0, I_P)`` over all ``P`` covered parameters, ``[P]`` (float64 when the model or the
        decompositions are, else float32)."""
        return torch.randn(self._noise_numel, generator=generator, dtype=self._noise_dtype, device=self._noise_device)

    def _slice(self, z: Tensor, name: str) -> Tensor:
        """Block ``name``'s part of a draw over all covered parameters (a view)."""
        offset, numel = self._noise_spans[name]
        return z.narrow(0, offset, numel)

    def _coloured(self, name: str, blk: Any, z: Tensor) -> List[Tensor]:
        """Block ``name``'s part of the standard normal ``z`` coloured to ``N(0, τ·Λ⁻¹)``, in the
        parameters' dtypes (the slice of ``z`` is used as workspace)."""
        eps = blk.colour(self._slice(z, name))
        if self.kl_weighting != 1.0:
            for e in eps:
                e.mul_(self._noise_scale)
        return [like_dtype(e, p) for e, p in zip(eps, blk.layout.params)]

    def _coloured_all(self, z: Tensor) -> Shift:
        """The weight sample of the standard normal ``z`` (``[P]``): every block colours its slice.

        When every block is diagonal and of ``z``'s dtype (VOGN), the colouring ``z ⊙ √τ/√denom``
        is left to the shift itself (one ``torch._foreach_addcmul`` forms ``θ + z ⊙ 1/√denom``):
        the sample is the same up to rounding, with one op per step instead of one per block."""
        params: List[nn.Parameter] = []
        eps: List[Tensor] = []
        blocks = self.running.blocks
        if all(isinstance(b, DiagBlock) for b in blocks.values()):
            factors: List[Tensor] = []
            for name, blk in blocks.items():
                params.extend(blk.layout.params)
                eps.extend(blk.layout.unflatten(self._slice(z, name)))
                factors.extend(blk.inverse_sqrt_diagonal())
            if all(p.dtype == z.dtype and f.dtype == z.dtype for p, f in zip(params, factors)):
                if self.kl_weighting != 1.0:
                    z.mul_(self._noise_scale)
                return params, eps, factors
            params, eps = [], []
        for name, blk in blocks.items():
            params.extend(blk.layout.params)
            eps.extend(self._coloured(name, blk, z))
        return params, eps, None

    def _isotropic(self, z: Tensor) -> Shift:
        """The weight sample of ``z`` (``[P]``) before any curvature: ``ε = z / √init_precision``."""
        params: List[nn.Parameter] = []
        eps: List[Tensor] = []
        z.mul_(float(self.init_precision) ** -0.5)
        for name, lay in self.engine.layouts.items():
            params.extend(lay.params)
            eps.extend(like_dtype(e, p) for e, p in zip(lay.unflatten(self._slice(z, name)), lay.params))
        return params, eps, None

    def _draw_noise(self, generator: torch.Generator) -> Optional[Shift]:
        """``ε ~ N(0, τ·Λ⁻¹)`` for every covered parameter, or None before any curvature/init precision."""
        if self._decomposed:
            if self.placement.active:  # [issue #7]
                for name, blk in self.running.blocks.items():
                    if blk.decomposition is None:
                        raise RuntimeError(f"rank {self.comm.rank} holds no decomposition of block {name!r} "
                                           "(grad_worker_fraction < 1 keeps it on its grad workers); "
                                           "sample with grad_worker_fraction='comm_opt'")
            return self._coloured_all(self._standard_normal(generator))
        if self.init_precision is not None:
            return self._isotropic(self._standard_normal(generator))
        return None

    @contextlib.contextmanager
    def sampled_params(self, generator: Optional[torch.Generator] = None) -> Iterator[None]:
        """Temporarily replace the covered weights by one posterior sample (restored on exit)."""
        gen = generator if generator is not None else self.generator
        with self._perturbed(self._draw_noise(gen)):
            yield

    @staticmethod
    def _perturbed(shift: Optional[Shift]) -> ContextManager[None]:
        """Temporarily move the weights by a sample's ``shift`` (restored on exit; None: unchanged)."""
        if shift is None:
            return contextlib.nullcontext()
        return shifted_params(*shift)

    @torch.no_grad()
    def predict(self, x: Tensor, num_samples: int = 32, generator: Optional[torch.Generator] = None) -> Tensor:
        """Bayesian model average: mean over posterior samples of softmax(model(x)) (or of the output for mse)."""
        check_int("num_samples", num_samples)
        outs = []
        for _ in range(num_samples):
            with self.sampled_params(generator):
                out = self.engine.select_output(self.model(x))
            outs.append(torch.softmax(out, dim=-1) if self.engine.loss is LossType.CROSS_ENTROPY else out)
        return torch.stack(outs).mean(0)

    def posterior_precision(self) -> Tensor:
        """Dense ``[P, P]`` block-diagonal posterior precision ``(N·C + τδ + damping)/τ`` over the covered params."""
        if not self.running.blocks:
            raise RuntimeError("no curvature estimate yet: call step() first")
        mats = [blk.dense() * self.dataset_size for blk in self.running.blocks.values()]
        dense = torch.block_diag(*mats)
        return (dense + self.precision_shift * torch.eye(dense.shape[0], dtype=dense.dtype)) / self.kl_weighting

    # ---- the step ---------------------------------------------------------------------------------
    @full_precision_step  # the optimizer's math outside torch.autocast, the closure inside it
    def step(self, closure: Closure = None, targets: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:  # type: ignore[override]
        """One VI step (``num_mc_samples`` closure calls); returns the mean loss and the last output."""
        estimate = self.num_steps % self.curv_update_interval == 0
        trainable = [p for g in self.param_groups for p in g["params"]] if self.num_mc_samples > 1 else []
        grad_sum: Dict[int, Tensor] = {}
        curvature = BlockAverage() if estimate else None
        losses = []
        output = None
        for noise in self._step_noise():
            with self._perturbed(noise):
                loss, output, fresh = self._run_closure(closure, targets, estimate)
            losses.append(loss.detach())
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
        if self.num_mc_samples > 1:
            for p in trainable:  # the averaged gradient goes through p.grad (and the grad scaler, if any)
                p.grad = grad_sum[id(p)] / self.num_mc_samples if id(p) in grad_sum else None
        params, groups = params_with_grad(self.param_groups)
        mean_loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        if not self._unscale_grads():
            self.num_steps += 1
            return mean_loss, output
        grads = [p.grad for p in params]
        fresh = curvature.result() if curvature is not None else None
        agreed = self._average_over_ranks(grads, fresh, mean_loss)
        if not agreed or not self._batch_is_finite(mean_loss, grads, fresh):
            self._nonfinite("loss, gradient or curvature")
            self.num_steps += 1
            return mean_loss, output
        if fresh is not None:
            self.running.update(fresh, self.ema_decay)
        if self.num_steps % self.inv_update_interval == 0 or not self._decomposed:
            if not self._decompose(self.precision_shift, scale=float(self.dataset_size)) and not self._decomposed:
                self.num_steps += 1
                return mean_loss, output
        self._update_mean(params, groups, grads)
        self.num_steps += 1
        return mean_loss, output

    def _update_mean(self, params: List[nn.Parameter], groups: List[Dict[str, Any]], grads: List[Tensor]) -> None:
        """``m ← momentum·m + (g + τδ/N·μ)`` (the momentum of the mean loss's gradient; ``N·m`` is VOGN's
        ``m`` of the summed loss); ``μ ← μ − lr·Λ⁻¹ N·m`` (covered), ``μ ← μ − lr·m`` (others)."""
        n, tau_delta = float(self.dataset_size), self.kl_weighting * self.prior_precision
        plan = self._plans.get(params, groups, self.running.blocks)
        with torch.no_grad():
            bufs = natural_momentum_([self.state[p] for p in params], grads, params, tau_delta / n,
                                     plan.values("momentum"))
            if self.placement.active:  # [issue #7] each block solved by its grad workers
                covered = {blk.layout.name: blk for blk, _ in plan.blocks}
                direction = self._precondition(covered, {id(p): b for p, b in zip(params, bufs)})
                steps = [like_dtype(direction[id(p)] * n if inside else b, p)
                         for b, inside, p in zip(bufs, plan.in_block, params)]
                add_scaled_(params, steps, plan.values("lr"))
            else:
                preconditioned_descent_(plan, params, bufs, plan.values("lr"), n, 1.0)

    def _extra_state(self) -> Dict[str, Any]:
        return {"momentum": "mean-loss"}  # momentum buffers of the mean loss's gradient (since 2026-11-24)

    def _load_extra_state(self, state: Dict[str, Any]) -> None:
        if state.get("momentum") != "mean-loss":  # an older checkpoint kept N·m (VOGN's summed-loss momentum)
            with torch.no_grad():
                for p in (q for g in self.param_groups for q in g["params"]):
                    buf = self.state.get(p, {}).get("momentum_buffer")
                    if buf is not None:
                        buf.div_(self.dataset_size)
