"""VIOptimizer's use of the posterior: weight samples in the model, the Bayesian model average
(:meth:`PosteriorUse.predict`) and the dense precision. A mixin of :class:`~torchsso2.optim.vi.VIOptimizer`,
which provides the noise draws (``_draw_noise``), the running curvature and the settings."""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Iterator, Literal, Optional, Tuple, Union, overload

import torch
from torch import Tensor, nn

from curvature.blocks import DiagBlock, KFACBlock
from curvature.options import LossType, check_generator

from .grid import mix_seed
from .misuse import eval_mode
from .validation import check_int
from .vi_shift import Shift, negated, shifted_params


class PosteriorUse:
    """Sampling from and predicting with the posterior (``VIOptimizer``'s public evaluation API)."""

    @contextlib.contextmanager
    def sampled_params(self, generator: Optional[torch.Generator] = None) -> Iterator[None]:
        """Temporarily replace the covered weights by one posterior sample (restored on exit).

        Without ``generator`` the sample comes from :meth:`sampling_generator`, which gives the **same**
        sample at every call between two steps (reproducible, apart from the training streams): for
        several samples pass one generator to all of them, as in
        ``g = torch.Generator().manual_seed(0)`` then ``with opt.sampled_params(generator=g): ...`` in a
        loop (or use :meth:`predict`). ``step()``, :meth:`predict` and another ``sampled_params()``
        inside the context are a ``RuntimeError``: the weights there are a sample, not the mean (a step
        taken there would be undone on exit)."""
        self._check_posterior("sampled_params()")
        check_generator(generator)
        self._check_not_sampling("sampled_params()")
        gen = generator if generator is not None else self.sampling_generator()
        with self._perturbed(self._draw_noise(gen)):
            self._sampling = "`with opt.sampled_params():`"  # where the weights are a sample (also a step's closure)
            try:
                yield
            finally:
                self._sampling = None

    def _check_step_call(self, closure: Any) -> None:
        """The step's checks (:class:`~torchsso2.optim.base.CurvatureOptimizer`), and none where the weights
        are a sample (:meth:`_check_not_sampling`)."""
        super()._check_step_call(closure)  # type: ignore[misc]
        self._check_not_sampling("step()")

    def __deepcopy__(self, memo: Dict[int, Any]) -> Any:
        """A copy (:class:`~torchsso2.optim.base.CurvatureOptimizer`), not where the weights are a sample:
        it would take the sample for its mean and keep a sampling mark no context clears."""
        place = self.__dict__.get("_sampling")
        if place:
            raise RuntimeError(f"copy.deepcopy of the optimizer inside {place}: the model's weights are a "
                               "posterior sample there, not the mean; copy outside it")
        return super().__deepcopy__(memo)  # type: ignore[misc]

    def _check_not_sampling(self, what: str) -> None:
        """RuntimeError where the weights are a posterior sample (inside :meth:`sampled_params` or a
        step's closure): ``step()``, :meth:`predict` and :meth:`sampled_params` need the mean there."""
        place = self.__dict__.get("_sampling")
        if place:
            raise RuntimeError(f"{what} inside {place}: the model's weights are a posterior sample there, not the "
                               "mean (a step taken there would be undone when the sample is replaced by the mean, "
                               "and predict() or sampled_params() would sample around the sample, doubling the "
                               "noise); call it outside")

    def _has_posterior(self) -> bool:
        """Whether there is a posterior to sample: a decomposition, or the isotropic start's precision."""
        return self._decomposed or self._first_precision is not None or \
            bool(self.__dict__.get("_loaded_undecomposed", False))  # decomposed at the next sample

    def _check_posterior(self, what: str) -> None:
        """RuntimeError when there is no posterior to sample (every sample would be the mean weights)."""
        if not self._has_posterior():
            if self.num_steps > 0 or self.running.blocks:  # (a failed first decomposition leaves num_steps at 0)
                raise RuntimeError(f"{what} after {self.num_steps + self.num_skipped} step() call(s) none of whose "
                                   "decompositions of the "
                                   "posterior precision succeeded (see the logged warnings): there is nothing to sample "
                                   "from. Increase damping or prior_precision (the curvature is not positive definite)")
            raise RuntimeError(f"{what} before the first step() with curvature_init=None and no init_precision: "
                               "there is no posterior yet, so every sample would be the mean weights (point "
                               "predictions). Call step() first, or pass init_precision=... (or keep the default "
                               "curvature_init) to sample from an isotropic Gaussian around the weights")

    def sampling_generator(self) -> torch.Generator:
        """The default generator of :meth:`predict` and :meth:`sampled_params`: seeded from ``seed`` and
        the step count, apart from the streams training draws from (``fisher_mc``'s labels, the weight
        noise), so evaluating between steps leaves the training run unchanged; at one step every call
        draws the same samples (reproducible; pass ``generator=`` for others)."""
        return torch.Generator(device=self._noise_device).manual_seed(mix_seed(self.seed, 0x9EED, self.num_steps))

    @staticmethod
    def _perturbed(shift: Optional[Shift]) -> ContextManager[None]:
        """Temporarily move the weights by a sample's ``shift`` (restored on exit; None: unchanged)."""
        if shift is None:
            return contextlib.nullcontext()
        return shifted_params(*shift)

    @overload
    def predict(self, x: Tensor, num_samples: int = ..., generator: Optional[torch.Generator] = ...,
                return_variance: Literal[False] = ..., antithetic: bool = ...) -> Tensor: ...

    @overload
    def predict(self, x: Tensor, num_samples: int = ..., generator: Optional[torch.Generator] = ..., *,
                return_variance: Literal[True], antithetic: bool = ...) -> Tuple[Tensor, Tensor]: ...

    @overload
    def predict(self, x: Tensor, num_samples: int = ..., generator: Optional[torch.Generator] = ...,
                return_variance: bool = ..., antithetic: bool = ...) -> Union[Tensor, Tuple[Tensor, Tensor]]: ...

    @torch.no_grad()
    def predict(self, x: Tensor, num_samples: int = 32, generator: Optional[torch.Generator] = None,
                return_variance: bool = False, antithetic: bool = True) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Bayesian model average: mean over posterior samples of softmax(model(x)) (of sigmoid(model(x)), the
        probability of each label, for ``loss="binary_cross_entropy"``; of the output for mse).

        With ``return_variance=True`` (``loss="mse"`` only) it returns ``(mean, variance)``, both of the
        output's shape (e.g. ``[B, K]``): the mean and the variance of the predictive mixture
        ``(1/S)·Σ_s N(f_s(x), σ²)``, i.e. ``mean_s f_s`` and ``mean_s (f_s − mean)² + σ²`` (the
        samples' population variance plus the observation noise ``σ²``, see ``noise_variance``).

        With ``antithetic=True`` (the default) the samples come in pairs ``μ + ε``, ``μ − ε`` from one
        draw of ``ε ~ N(0, τΛ⁻¹)`` (an odd ``num_samples`` ends with one unpaired draw). Every sample is
        still a posterior sample, so the average stays unbiased; a pair's average ``f(μ) + O(ε²)``
        cancels the part of the Monte-Carlo error that is linear in ``ε``, which is most of it for
        samples as narrow as the posterior's (on diabetes regression 32 antithetic samples match 1024
        independent ones, see docs/defaults.md). ``antithetic=False`` draws every sample independently.

        The model is evaluated in ``eval()`` mode (BatchNorm uses its running statistics and leaves them
        unchanged, dropout is off) and given back its own ``training`` flags. Before the first ``step()``
        it samples the isotropic start (``init_precision``, or the default ``curvature_init``'s); with
        neither it raises ``RuntimeError``. Without ``generator`` the samples come from
        :meth:`sampling_generator`: a call leaves the training streams, and so the run, unchanged."""
        check_int("num_samples", num_samples)
        check_generator(generator)
        if not isinstance(return_variance, bool):
            raise TypeError(f"return_variance must be a bool, got {type(return_variance).__name__} {return_variance!r}")
        if return_variance and self.engine.loss is not LossType.MSE:
            raise ValueError(f"predict(return_variance=True) is the predictive variance of loss='mse'; this optimizer's "
                             f"loss is {self.engine.loss.value!r}")
        self._check_posterior("predict()")
        self._check_not_sampling("predict()")
        if not isinstance(antithetic, bool):
            raise TypeError(f"antithetic must be a bool, got {type(antithetic).__name__} {antithetic!r}")
        gen = generator if generator is not None else self.sampling_generator()
        # running mean and sum of squared deviations (Welford): memory of one output, whatever num_samples
        mean: Optional[Tensor] = None
        m2: Optional[Tensor] = None
        shift: Optional[Shift] = None
        with eval_mode(self.model):
            for i in range(num_samples):
                shift = negated(shift) if antithetic and i % 2 == 1 else self._draw_noise(gen)
                with self._perturbed(shift):
                    out = self.engine.select_output(self.model(x))
                if self.engine.loss is LossType.CROSS_ENTROPY and out.dim() <= 1 \
                        and not (isinstance(x, Tensor) and x.dim() == 1):  # a 1-D x: one unbatched example
                    raise ValueError(
                        f"predict() with loss='cross_entropy' got outputs of shape {tuple(out.shape)}: no class "
                        "dimension, so the softmax would run over the examples. Return logits [B, C]; for a binary "
                        "classifier on one logit use loss='binary_cross_entropy' (predict() then averages "
                        "sigmoid(output))")
                if self.engine.loss is LossType.CROSS_ENTROPY and out.dim() > 1 and out.shape[-1] == 1:
                    raise ValueError(
                        f"predict() with loss='cross_entropy' got outputs of shape {tuple(out.shape)}: the softmax "
                        "over one logit is 1 everywhere. For a binary classifier on one logit use "
                        "loss='binary_cross_entropy' (predict() then averages sigmoid(output))")
                y = torch.softmax(out, dim=-1) if self.engine.loss is LossType.CROSS_ENTROPY else \
                    torch.sigmoid(out) if self.engine.loss is LossType.BINARY_CROSS_ENTROPY else out
                y = y.float() if y.dtype in (torch.float16, torch.bfloat16) else y  # sums in float32 at least
                if mean is None:
                    mean, dtype = y.clone(), out.dtype
                    m2 = torch.zeros_like(y) if return_variance else None
                    continue
                delta = y - mean
                mean.add_(delta, alpha=1.0 / (i + 1))
                if m2 is not None:
                    m2.addcmul_(delta, y - mean)
        assert mean is not None
        if return_variance:
            assert m2 is not None
            return mean.to(dtype), (m2 / num_samples + self.noise.variance).to(dtype)
        return mean.to(dtype)

    def posterior_variance(self) -> Dict[nn.Parameter, Tensor]:
        """The posterior variance of every covered weight, ``{parameter: tensor of its shape}``: the
        diagonal of ``posterior_precision()⁻¹`` without forming the dense ``[P, P]`` matrix (diagonal
        blocks ``τ/(N·C + τδ + damping)`` elementwise; K-FAC blocks from their factors' eigenvectors,
        ``(U∘U) D (V∘V)ᵀ`` over the parameter matrix, eigenvalues clamped at 0 as for the samples; full
        blocks the diagonal of their inverse), in float32 at least. For uncertainty per weight
        (signal-to-noise pruning, plots), from the running curvature as :meth:`posterior_precision`;
        before the first step the isotropic start's variance; 0 for a weight the samples leave alone: frozen
        after the optimizer was built, or covered but in no block yet (frozen before the first step, or
        not called at any curvature step so far; it gets one at the first curvature step that calls it), and an Embedding's ``padding_idx`` row (one frozen when the
        optimizer was built is not covered: no entry). RuntimeError without a posterior or for a block
        whose precision is not positive definite."""
        self._check_posterior("posterior_variance()")
        out: Dict[nn.Parameter, Tensor] = {}
        if not self.running.blocks:  # before the first step: the isotropic start predict() samples
            var = 1.0 / float(self._first_precision)  # type: ignore[arg-type]
            for p in self.engine.params:  # (a weight frozen since construction is not sampled: 0, below)
                out[p] = torch.full(p.shape, var if p.requires_grad else 0.0, dtype=_at_least_float32(p.dtype),
                                    device=p.device)
            self._zero_padding_rows(out)
            return out
        size, shift, tau = self.likelihood_size, self.precision_shift, self.kl_weighting
        for name, blk in self.running.blocks.items():
            lay = blk.layout
            if isinstance(blk, DiagBlock):
                denom = size * blk.diagonal.double() + shift
                _check_positive(denom, name)
                parts = lay.unflatten(tau / denom)
            elif isinstance(blk, KFACBlock):  # eigenvalues clamped at 0, as the sampler's decomposition clamps them
                (ea, ua), (eb, ub) = (_factor_eig(f) for f in (blk.left, blk.right))
                denom = size * torch.outer(ea, eb) + shift  # [rows, cols] in the factors' eigenbases
                _check_positive(denom, name)
                m = tau / denom
                if ua is not None:
                    m = ua.square() @ m
                if ub is not None:
                    m = m @ ub.square().t()
                parts = lay.family.from_matrix(lay.module, m, lay.param_names)
            else:
                dense = blk.dense().double() * size
                dense.diagonal().add_(shift)
                chol, info = torch.linalg.cholesky_ex(dense)
                if int(info) != 0:
                    raise RuntimeError(f"posterior_variance(): the posterior precision of block {name!r} is not "
                                       "positive definite; increase prior_precision or damping")
                parts = lay.unflatten(tau * torch.cholesky_inverse(chol).diagonal())
            for p, v in zip(lay.params, parts):
                # a weight frozen after construction is not sampled (vi_shift.unfrozen): its variance is 0
                v = v.reshape(p.shape) if p.requires_grad else torch.zeros(p.shape, dtype=v.dtype, device=v.device)
                out[p] = v.to(_at_least_float32(p.dtype))
        have = {id(q) for q in out}
        for p in self.engine.params:  # covered, but in no block yet (frozen before the first step): not sampled
            if id(p) not in have:
                out[p] = torch.zeros(p.shape, dtype=_at_least_float32(p.dtype), device=p.device)
        self._zero_padding_rows(out)
        return out

    def _zero_padding_rows(self, variances: Dict[nn.Parameter, Tensor]) -> None:
        """An Embedding's ``padding_idx`` row is never sampled (``vi_noise``): its variance is 0."""
        for p, v in variances.items():
            row = self._padding_rows.get(id(p))
            if row is not None:
                v[row] = 0.0

    def posterior_precision(self) -> Tensor:
        """Dense ``[P, P]`` block-diagonal posterior precision (``P²`` numbers: for per-weight variances on
        a model of any size use :meth:`posterior_variance`) ``(N·C + τδ + damping)/τ`` over the covered params,
        from the running curvature ``C``. The weight samples (``sampled_params``, ``predict``, the steps)
        use its last decomposition, redone every ``inv_update_interval`` steps: between two, ``C`` may
        have moved on (``curv_update_interval`` < ``inv_update_interval``) and the samples follow the
        precision of the last decomposition step."""
        if not self.running.blocks:
            raise RuntimeError("no curvature estimate yet: call step() first")
        mats = [blk.dense() * self.likelihood_size for blk in self.running.blocks.values()]
        dense = torch.block_diag(*mats)
        return (dense + self.precision_shift * torch.eye(dense.shape[0], dtype=dense.dtype, device=dense.device)
                ) / self.kl_weighting


def _factor_eig(f: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """``(eigenvalues clamped at 0, eigenvectors)`` of a K-FAC factor in float64 (a diagonal factor:
    itself, None): a float32 factor of rank below its size has eigenvalues a rounding below 0, which
    the sampler's decomposition clamps too (curvature/blocks/kfac.py)."""
    if f.dim() == 1:
        return f.double().clamp_min(0.0), None
    values, vectors = torch.linalg.eigh(f.double())
    return values.clamp_min_(0.0), vectors


def _check_positive(denom: Tensor, name: str) -> None:
    if not bool((denom > 0).all()):
        raise RuntimeError(f"posterior_variance(): the posterior precision of block {name!r} is not positive "
                           f"(smallest {float(denom.min()):.3e}); increase prior_precision or damping")


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
