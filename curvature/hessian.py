"""Exact Hessian blocks of the mean loss, by double backward (Hessian-vector products).

The block of a module is ``∂²L/∂θ_m²`` for its covered parameters ``θ_m`` (cross-module
blocks are dropped, like every shape here). Cost: ``P_m`` Hessian-vector products per
module (batched through ``is_grads_batched``), so use it on small models or layers.
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import Tensor

from .blocks import Block, DiagBlock, FullBlock, Layout
from .blocks.base import compute_dtype
from .options import Approx

_CHUNK = 256


def _hessian_rows(flat_grad: Tensor, params: List[Tensor], rows: range) -> Tensor:
    """Rows ``rows`` of ``∂ flat_grad / ∂ params``: ``[len(rows), P]``."""
    p = flat_grad.numel()
    eye = torch.zeros(len(rows), p, dtype=flat_grad.dtype, device=flat_grad.device)
    eye[torch.arange(len(rows)), torch.tensor(list(rows))] = 1.0
    try:
        hv = torch.autograd.grad(flat_grad, params, grad_outputs=eye, is_grads_batched=True,
                                 retain_graph=True, allow_unused=True)
        parts = [h if h is not None else torch.zeros((len(rows),) + q.shape, dtype=flat_grad.dtype)
                 for h, q in zip(hv, params)]
        return torch.cat([h.reshape(len(rows), -1) for h in parts], dim=1)
    except RuntimeError:  # an op without batching rule: fall back to one HVP at a time
        out = []
        for i in range(len(rows)):
            hv = torch.autograd.grad(flat_grad, params, grad_outputs=eye[i], retain_graph=True, allow_unused=True)
            out.append(torch.cat([(h if h is not None else torch.zeros_like(q)).reshape(-1)
                                  for h, q in zip(hv, params)]))
        return torch.stack(out)


def hessian_blocks(loss: Tensor, layouts: Dict[str, Layout], approx: Dict[str, Approx]) -> Dict[str, Block]:
    """Full or diagonal Hessian block of the scalar ``loss`` for every module in ``layouts``."""
    names = list(layouts)
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
        if not flat.requires_grad:  # the loss does not depend on this module at second order
            h_rows = [torch.zeros(min(_CHUNK, p - s), p, dtype=flat.dtype) for s in range(0, p, _CHUNK)]
        else:
            h_rows = [_hessian_rows(flat, mp, range(s, min(s + _CHUNK, p))) for s in range(0, p, _CHUNK)]
        if approx[name] is Approx.FULL:
            h = torch.cat(h_rows, dim=0).detach()
            h = 0.5 * (h + h.t())
            blocks[name] = FullBlock(lay, h.to(compute_dtype(h.dtype)))
        else:
            diag = torch.cat([r[:, s:s + r.shape[0]].diagonal() for r, s in
                              zip(h_rows, range(0, p, _CHUNK))]).detach()
            blocks[name] = DiagBlock(lay, diag.to(compute_dtype(diag.dtype)))
    return blocks
