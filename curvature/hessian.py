"""Exact Hessian blocks of the mean loss, by double backward (Hessian-vector products).

The block of a module is ``∂²L/∂θ_m²`` for its covered parameters ``θ_m`` (cross-module
blocks are dropped, like every shape here). Cost of a full block: ``P_m`` Hessian-vector products
(batched through ``is_grads_batched``), so use it on small models or layers; a block needing
more than :data:`curvature.cost.HVP_WARN` products is announced with a logging warning first.
The diagonal of a Linear or convolution block needs only ``d_out·T`` products in the layer's output space
(:mod:`curvature.hessian_diag`) when no BatchNorm couples the examples and the checks there hold
(the parameters used only by that call, no coupling of the output's first dimension); other
diagonal blocks take the ``P_m`` rows and keep their diagonal.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Set

import torch
from torch import Tensor

from .blocks import Block, DiagBlock, FullBlock, Layout
from .blocks.base import compute_dtype
from .cost import warn_hessian_products
from .hvp import ProductRunner
from .hessian_diag import diag_block, output_space_count, supports, uses_only_through
from .options import Approx

_CHUNK = 256


def _hessian_rows(runner: ProductRunner, p: int, rows: range, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Rows ``rows`` of ``∂ flat_grad / ∂ params`` (``runner`` over them): ``[len(rows), P]``."""
    eye = torch.zeros(len(rows), p, dtype=dtype, device=device)
    eye[torch.arange(len(rows)), torch.tensor(list(rows))] = 1.0
    return torch.cat([h.reshape(len(rows), -1) for h in runner.run(eye)], dim=1)


def hessian_blocks(loss: Tensor, layouts: Dict[str, Layout], approx: Dict[str, Approx],
                   records: Optional[Mapping[str, object]] = None,
                   examples_independent: bool = False, announced: Optional[Set[Any]] = None) -> Dict[str, Block]:
    """Full or diagonal Hessian block of the scalar ``loss`` for every module in ``layouts``.

    ``records``: the capture's ``ModuleRecord`` per module (inputs, output in the graph); with
    ``examples_independent`` (nothing after a layer mixes the examples of the batch) the diagonal
    blocks of Linear and convolution layers come from :func:`curvature.hessian_diag.diag_block` when that
    needs fewer products than the ``P_m`` rows. ``announced``: the caller's set of blocks whose cost was
    announced already (each is logged once).
    """
    names = list(layouts)
    fast: Dict[str, Block] = {}
    for name in names:
        lay, rec = layouts[name], (records or {}).get(name)
        if approx[name] is not Approx.DIAG or rec is None or not examples_independent \
                or not supports(lay.module, lay.family, rec.output):
            continue
        p = sum(q.numel() for q in lay.params)
        count = output_space_count(lay.module, rec.output)
        if count >= p:
            continue
        if not uses_only_through(loss, rec.output, lay.params, rec.input_nodes):  # a tied or functional other use
            continue
        ran_with = {id(t) for t in rec.parameters}
        if any(id(q) not in ran_with for q in lay.params):  # called with other tensors (functional_call(m, {"weight": 2 * W}))
            continue
        diag = diag_block(loss, lay.module, lay.family, rec.inputs, rec.output, list(lay.param_names))
        if diag is None:  # the examples (rows of the output's first dimension) are coupled
            continue
        warn_hessian_products(name, count, p, "diagonal", announced)
        if diag.numel() == 0:
            diag = torch.zeros(p, dtype=loss.dtype, device=loss.device)
        fast[name] = DiagBlock(lay, diag.to(compute_dtype(diag.dtype)))
    names = [n for n in names if n not in fast]
    if not names:
        return fast
    params = [p for n in names for p in layouts[n].params]
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    blocks: Dict[str, Block] = {}
    i = 0
    for name in names:
        lay = layouts[name]
        mp = lay.params
        mg = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads[i:i + len(mp)], mp)]
        i += len(mp)
        flat = torch.cat([g.reshape(-1) for g in mg])
        p = flat.numel()
        warn_hessian_products(name, p, p, "full" if approx[name] is Approx.FULL else "diagonal", announced)
        if not flat.requires_grad:  # the loss does not depend on this module at second order
            h_rows = [torch.zeros(min(_CHUNK, p - s), p, dtype=flat.dtype) for s in range(0, p, _CHUNK)]
        else:
            runner = ProductRunner(flat, mp)
            h_rows = [_hessian_rows(runner, p, range(s, min(s + _CHUNK, p)), flat.dtype, flat.device)
                      for s in range(0, p, _CHUNK)]
        if approx[name] is Approx.FULL:
            h = torch.cat(h_rows, dim=0).detach()
            h = 0.5 * (h + h.t())
            blocks[name] = FullBlock(lay, h.to(compute_dtype(h.dtype)))
        else:
            diag = torch.cat([r[:, s:s + r.shape[0]].diagonal() for r, s in
                              zip(h_rows, range(0, p, _CHUNK))]).detach()
            blocks[name] = DiagBlock(lay, diag.to(compute_dtype(diag.dtype)))
    return {n: fast[n] if n in fast else blocks[n] for n in layouts}
