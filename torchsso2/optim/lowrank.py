"""Low-rank preconditioning of Linear K-FAC blocks from the user's own backward.

The gradient of a Linear layer over a batch is ``∇[W | b] = gᵀã`` with ``g [R, n]`` the
gradients w.r.t. the layer's output and ``ã = [a, 1]`` ``[R, m']`` its inputs (``R`` = batch ×
positions): its rank is at most ``R``. The eigen-basis preconditioner
``Q_G [(Q_Gᵀ ∇ Q_A) ⊘ D] Q_Aᵀ`` can then rotate the gradient into the eigenbasis as
``(g Q_G)ᵀ (ã Q_A)`` at ``2R(n² + m'² + n·m')`` FLOPs instead of ``2n·m'(n + m')`` — the same
numbers up to rounding, fewer FLOPs whenever ``R`` is small against the layer's width (K-FAC's
costliest regime: small batches on wide layers). The rotation back stays dense.

Safety: ``p.grad`` is what the optimizer must precondition, and a closure may change it after
``backward()`` (clipping, noise, accumulation). Each use is guarded by a probe: for a random
vector ``r``, ``∇ r`` must equal ``gᵀ(ã r)`` up to rounding: ``eps·(√R + √m')·‖|g|ᵀ(|ã| |r|)‖`` in the
coarsest dtype of ``g``, ``ã`` and the gradient, times ``PROBE_BOUND`` (a bound on both sides' rounding;
clean gradients reach ~0.05 of it), and at least 8 units
of a half-precision gradient's rounding relative to ``‖∇ r‖`` (bfloat16 6e-2, float16 8e-3); otherwise
(or when the hooks saw no single clean backward) the block takes the dense path. A residual that is
orthogonal to ``r`` or within that rounding would go unnoticed; the probe is redrawn every step from
the solver's own generator, so the optimizer's sampling stream is untouched.
"""
from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from curvature.blocks import KFACBlock
from curvature.capture import Capture
from curvature.modules.linear import LinearFamily

from .grid import mix_seed

logger = logging.getLogger(__name__)

#: the probe's least tolerance, in units of the gradient dtype's rounding relative to ``‖∇ r‖`` (half precision)
PROBE_HALF_UNITS = 8.0
#: the probe's tolerance as a fraction of ``eps·(√R + √m')·‖|g|ᵀ(|ã| |r|)‖``, a bound on both sides' rounding
#: (clean float32/float64 gradients reach at most ~0.05 of it, also when the batch's gradients cancel)
PROBE_BOUND = 0.25
#: the low-rank rotation is used when its FLOPs are below this fraction of the dense rotation's
COST_FRACTION = 0.75
#: layers whose dense rotation ``n·m·(n + m)`` multiply-adds is below this are never hooked: there
#: the hooks, the probe and the extra kernel launches (~0.1 ms a step on CPU) cost more than the
#: FLOPs they could save (a 64→64 layer's dense rotation is ~0.05 ms)
MIN_DENSE_WORK = 2_000_000


def low_rank_pays(rows: int, n: int, m: int) -> bool:
    """Whether rotating ``gᵀã`` (``rows`` = R) beats rotating the dense ``[n, m]`` gradient."""
    return n * m * (n + m) >= MIN_DENSE_WORK and rows * (n * n + m * m + n * m) < COST_FRACTION * n * m * (n + m)


def worth_recording(module: nn.Linear) -> bool:
    """Whether the layer is wide enough for the low-rank path to pay at some batch size."""
    n, m = module.out_features, module.in_features + (module.bias is not None)
    return n * m * (n + m) >= MIN_DENSE_WORK


def pays_for_call(name: str, module: nn.Module, inputs: Tuple[object, ...]) -> bool:
    """Whether this forward call's batch (``R`` = rows of the input) is small enough for the
    low-rank path to pay; calls that cannot pay are not recorded at all (at B=512 on a
    784-512-512-10 MLP the output clones and gradient hooks cost ~10% of a K-FAC step)."""
    x = inputs[0] if inputs else None
    if not isinstance(x, Tensor) or not isinstance(module, nn.Linear) or module.in_features < 1 \
            or x.shape[-1:] != (module.in_features,):
        return False
    return low_rank_pays(x.numel() // module.in_features, module.out_features,
                         module.in_features + (module.bias is not None))


def recorder(modules: Dict[str, nn.Module]) -> Capture:
    """A capture of each module's input and, through a tensor hook on its output, of the output
    gradient of the user's ``backward()`` — for the calls whose batch lets the low-rank path pay
    (:func:`pays_for_call`); repeated calls (accumulation) are counted, not refused."""
    return Capture(modules, record_backward=True, on_reuse="count", select=pays_for_call)


def recorded_factors(capture: Capture, name: str) -> Optional[Tuple[Tensor, Tensor]]:
    """``(g [R, n], a [R, m])`` of the module's single forward/backward, or None."""
    rec = capture.records.get(name)
    if rec is None or capture.calls.get(name) != 1 or not rec.backward_grads:  # accumulation, or no backward
        return None
    # the last backward through the output is the user's (a curvature backward of the optimizer
    # runs at the end of the forward, before it); the probe checks it anyway
    a, g = rec.inputs[0], rec.backward_grads[-1]
    if not isinstance(a, Tensor) or a.shape[:-1] != g.shape[:-1]:
        return None
    return g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1])


def low_rank_seed(seed: int) -> int:
    """The seed of the solver's probe stream, derived from the optimizer's ``seed`` (not the label stream's)."""
    return mix_seed(seed, 0x10A7)


class LowRankSolver:
    """Preconditions the eligible Linear K-FAC blocks of one step from the capture of
    :meth:`record` (a :class:`~curvature.capture.Capture` with ``record_backward=True,
    on_reuse="count"``)."""

    def __init__(self, blocks_modules: Dict[str, nn.Module], seed: int = 0) -> None:
        #: the Linear layers wide enough to be worth recording
        self.modules = {n: m for n, m in blocks_modules.items() if isinstance(m, nn.Linear) and worth_recording(m)}
        self.capture: Optional[Capture] = None
        self.generator = torch.Generator().manual_seed(seed)
        self.num_low_rank = 0   # blocks solved on the low-rank path
        self.num_rejected = 0   # blocks whose probe failed (the gradient changed after backward)

    def record(self) -> Capture:
        """The capture to run the step's closure in (kept for :meth:`solve`)."""
        self.capture = recorder(self.modules)
        return self.capture

    def solve(self, blocks: Dict[str, "KFACBlock"], grads: Dict[int, Tensor]) -> Dict[str, List[Tensor]]:
        """``{block name: preconditioned gradients}`` for the blocks that took the low-rank path."""
        out: Dict[str, List[Tensor]] = {}
        capture, self.capture = self.capture, None
        if capture is None:
            return out
        for name, blk in blocks.items():
            if not self._eligible(blk):
                continue
            rec = recorded_factors(capture, name)
            if rec is None:
                continue
            g, a = rec
            names = blk.layout.param_names
            if not low_rank_pays(g.shape[0], g.shape[1], a.shape[1] + ("bias" in names)):
                continue
            if "bias" in names:
                a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
            vecs = [grads[id(p)] for p in blk.layout.params]
            if not self._probe(vecs, names, g, a):
                self.num_rejected += 1
                logger.debug("block %r: gradient differs from g^T a (changed after backward); dense path", name)
                continue
            out[name] = blk.solve_low_rank(g, a, vecs)
            self.num_low_rank += 1
        return out

    @staticmethod
    def _eligible(blk: object) -> bool:
        return isinstance(blk, KFACBlock) and isinstance(blk.layout.family, LinearFamily) \
            and "weight" in blk.layout.param_names and blk.decomposition is not None \
            and blk.decomposition.get("method") == "eigen"

    def _probe(self, vecs: Sequence[Tensor], names: Sequence[str], g: Tensor, a: Tensor) -> bool:
        by_name = dict(zip(names, vecs))
        # the tolerance's rounding unit: the coarsest of the recorded g, ã and the gradient (under autocast a
        # float32 gradient carries bfloat16's rounding); the probe itself runs in float32 or wider (a bfloat16
        # probe's own rounding, ~4e-3, would swamp the tolerance)
        eps = max(torch.finfo(t).eps for t in (g.dtype, a.dtype, by_name["weight"].dtype))
        dt = torch.promote_types(torch.promote_types(g.dtype, a.dtype), torch.float32)
        r = torch.randn(a.shape[1], generator=self.generator, dtype=torch.float64).to(dt)
        w = by_name["weight"].reshape(g.shape[1], -1).to(dt)
        u = w @ r[:w.shape[1]]
        if "bias" in by_name:
            u = u + by_name["bias"].to(dt) * r[-1]
        g, a = g.to(dt), a.to(dt)
        v = g.t() @ (a @ r)
        if not (bool(torch.isfinite(u).all()) and bool(torch.isfinite(v).all())):
            return False
        # the rounding of both sides is bounded by |g|ᵀ(|ã| |r|) (sums of R terms, then of m'): a mismatch
        # above PROBE_BOUND·eps·(√R + √m')·that is a change of the gradient, not rounding (clean gradients stay
        # below ~5% of the bound, also when the batch's gradients cancel); a half-precision gradient also gets
        # at least 8 of its units relative to ‖∇r‖, else every bfloat16 block is refused. Norms in float64: a
        # float32 norm of 1e20-sized entries overflows (tolerance inf)
        bound_vec = g.abs().t() @ (a.abs() @ r.abs())
        scale = max(float(u.double().norm()), float(v.double().norm()))
        bound = float(bound_vec.double().norm())
        tol = max(PROBE_HALF_UNITS * eps * scale,
                  PROBE_BOUND * eps * (math.sqrt(g.shape[0]) + math.sqrt(a.shape[1])) * bound)
        return math.isfinite(tol) and float((u - v).double().norm()) <= tol
