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
vector ``r``, ``∇ r`` must equal ``gᵀ(ã r)`` to a relative ``PROBE_RTOL``; otherwise (or when
the hooks saw no single clean backward) the block takes the dense path. A residual that is
orthogonal to ``r`` or below ``PROBE_RTOL`` of the gradient would go unnoticed; the probe is
redrawn every step from the recorder's own generator, so the optimizer's sampling stream is
untouched.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from curvature.blocks import KFACBlock
from curvature.modules.linear import LinearFamily

logger = logging.getLogger(__name__)

#: relative mismatch between ``∇ r`` and ``gᵀ(ã r)`` above which the dense path is taken
PROBE_RTOL = 1e-3
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


class GradientRecorder:
    """Forward hooks recording each eligible Linear's input and, through a tensor hook on its
    output, the output gradient of the user's ``backward()`` (one forward per closure). The
    module's output is replaced by a clone (``[R, n]``, cheap next to the layer's matmul)."""

    def __init__(self, modules: Dict[str, nn.Module]) -> None:
        self.modules = modules
        self.inputs: Dict[str, List[Tensor]] = {}
        self.grads: Dict[str, List[Tensor]] = {}
        self._handles: List[RemovableHandle] = []

    def __enter__(self) -> "GradientRecorder":
        self.inputs.clear()
        self.grads.clear()
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Optional[Tensor]:
            if not torch.is_grad_enabled() or not isinstance(output, Tensor) or not output.requires_grad:
                return None
            self.inputs.setdefault(name, []).append(inputs[0].detach())
            output.register_hook(lambda g: self.grads.setdefault(name, []).append(g.detach()))
            # the model continues with a clone: an in-place op after the layer (ReLU(inplace=True))
            # then leaves the hooked tensor alone (its hook would otherwise never fire)
            return output.clone()
        return hook

    def factors(self, name: str) -> Optional[Tuple[Tensor, Tensor]]:
        """``(g [R, n], a [R, m])`` of the module's single forward/backward, or None."""
        ins, gs = self.inputs.get(name, []), self.grads.get(name, [])
        if len(ins) != 1 or not gs:  # several forwards (accumulation) or no backward
            return None
        # the last backward through the output is the user's (a curvature backward of the
        # optimizer runs at the end of the forward, before it); the probe checks it anyway
        a, g = ins[0], gs[-1]
        if a.shape[:-1] != g.shape[:-1]:
            return None
        return g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1])


class LowRankSolver:
    """Preconditions the eligible Linear K-FAC blocks of one step from a :class:`GradientRecorder`."""

    def __init__(self, blocks_modules: Dict[str, nn.Module], seed: int = 0) -> None:
        self.recorder = GradientRecorder({n: m for n, m in blocks_modules.items()
                                          if isinstance(m, nn.Linear) and worth_recording(m)})
        self.generator = torch.Generator().manual_seed(seed)
        self.num_low_rank = 0   # blocks solved on the low-rank path
        self.num_rejected = 0   # blocks whose probe failed (gradient changed after backward)

    def solve(self, blocks: Dict[str, "KFACBlock"], grads: Dict[int, Tensor]) -> Dict[str, List[Tensor]]:
        """``{block name: preconditioned gradients}`` for the blocks that took the low-rank path."""
        out: Dict[str, List[Tensor]] = {}
        for name, blk in blocks.items():
            if not self._eligible(blk):
                continue
            rec = self.recorder.factors(name)
            if rec is None:
                continue
            g, a = rec
            names = blk.layout.param_names
            if "bias" in names:
                a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
            n, m = g.shape[1], a.shape[1]
            if not low_rank_pays(g.shape[0], n, m):
                continue
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
        dt = torch.promote_types(g.dtype, a.dtype)
        r = torch.randn(a.shape[1], generator=self.generator, dtype=torch.float64).to(dt)
        by_name = dict(zip(names, vecs))
        w = by_name["weight"].reshape(g.shape[1], -1).to(dt)
        u = w @ r[:w.shape[1]]
        if "bias" in by_name:
            u = u + by_name["bias"].to(dt) * r[-1]
        v = g.to(dt).t() @ (a.to(dt) @ r)
        scale = max(float(u.norm()), float(v.norm()))
        return bool(torch.isfinite(u).all()) and float((u - v).norm()) <= PROBE_RTOL * scale
