"""VIOptimizer's weight noise: the samples ``ε ~ N(0, τΛ⁻¹)`` of a step, coloured block by block from
one standard normal per global sample (so ``R`` processes draw what one process would), the isotropic
start before the first decomposition, and the Embedding padding rows left unsampled. Mixin of
:class:`~torchsso2.optim.vi.VIOptimizer`."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from curvature.blocks import DiagBlock
from curvature.blocks.base import like_dtype

from .grid import noise_seed
from .vi_shift import Shift, unfrozen as _unfrozen

__all__ = ["WeightNoise"]


class WeightNoise:
    """Drawing the weight samples of :class:`~torchsso2.optim.vi.VIOptimizer` (see the module docstring)."""

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
        if not self._decomposed and self._first_precision is None:
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
        return [_unfrozen(shift) for shift in shifts]

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
        blocks = self._live_blocks()
        if all(isinstance(b, DiagBlock) for b in blocks.values()):
            factors: List[Tensor] = []
            for name, blk in blocks.items():
                params.extend(blk.layout.params)
                eps.extend(blk.layout.unflatten(self._slice(z, name)))
                factors.extend(blk.inverse_sqrt_diagonal())
            if all(p.dtype == z.dtype and f.dtype == z.dtype for p, f in zip(params, factors)):
                if self.kl_weighting != 1.0:
                    z.mul_(self._noise_scale)
                self._unsample_padding(params, eps)  # eps are views of z
                return _unfrozen((params, eps, factors))
            params, eps = [], []
        for name, blk in blocks.items():
            params.extend(blk.layout.params)
            eps.extend(self._coloured(name, blk, z))
        self._unsample_padding(params, eps)
        return _unfrozen((params, eps, None))

    def _unsample_padding(self, params: List[nn.Parameter], eps: List[Tensor]) -> None:
        """Zero the noise of every Embedding's padding row (``eps[i]`` the noise of ``params[i]``)."""
        if self._padding_rows:
            for p, e in zip(params, eps):
                row = self._padding_rows.get(id(p))
                if row is not None:
                    e[row].zero_()

    def _live_blocks(self) -> Dict[str, Any]:
        """The running blocks whose module has a trainable parameter (a module frozen with
        ``requires_grad_(False)`` after construction keeps its weights: it is not sampled)."""
        blocks = self.running.blocks
        if all(p.requires_grad for b in blocks.values() for p in b.layout.params):
            return blocks
        return {n: b for n, b in blocks.items() if any(p.requires_grad for p in b.layout.params)}

    def _isotropic(self, z: Tensor) -> Shift:
        """The weight sample of ``z`` (``[P]``) before any curvature: ``ε = z / √init_precision``."""
        params: List[nn.Parameter] = []
        eps: List[Tensor] = []
        z.mul_(float(self._first_precision) ** -0.5)
        for name, lay in self.engine.layouts.items():
            if not any(p.requires_grad for p in lay.params):  # frozen since construction: not sampled
                continue
            params.extend(lay.params)
            eps.extend(like_dtype(e, p) for e, p in zip(lay.unflatten(self._slice(z, name)), lay.params))
        self._unsample_padding(params, eps)
        return _unfrozen((params, eps, None))

    def _draw_noise(self, generator: torch.Generator) -> Optional[Shift]:
        """``ε ~ N(0, τ·Λ⁻¹)`` for every covered parameter, or None before any curvature/init precision."""
        self._decompose_loaded_here()  # a no-op in a step (the step decomposed it first)
        if self._decomposed:
            if self.placement.active:  # [issue #7]
                for name, blk in self.running.blocks.items():
                    if blk.decomposition is None:
                        raise RuntimeError(f"rank {self.comm.rank} holds no decomposition of block {name!r} "
                                           "(grad_worker_fraction < 1 keeps it on its grad workers); "
                                           "sample with grad_worker_fraction='comm_opt'")
            return self._coloured_all(self._standard_normal(generator))
        if self._first_precision is not None:
            return self._isotropic(self._standard_normal(generator))
        return None
