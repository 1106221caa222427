"""Tied parameters: one block per parameter, its contributions summed over the modules using it.

A parameter held by several covered modules (``head.weight = emb.weight``) has the gradient
``Σ_u ∇_u`` summed over its uses ``u``, per example too. Its block belongs to the first module
holding it (its :class:`~curvature.blocks.Layout`; the other uses are ``layout.tied``).

* **diag / full** (exact): the per-example gradient of the parameter is the sum of the per-use
  per-example gradients (same backpropagated vector ``k``, same example ``n``), and the block is
  built from those sums: ``(1/N) Σ_{k,n} (Σ_u ∇_u)(Σ_u ∇_u)ᵀ``. That keeps the cross terms
  ``∇_u ∇_{u'}ᵀ`` between uses, which a sum of per-use blocks would miss.
* **K-FAC** (an approximation): every use gives a Kronecker pair over the parameter's matrix
  ``[rows, cols]`` (Linear ``G ⊗ A``, Embedding ``diag(A) ⊗ G``: both row factor ⊗ column factor),
  and the block is ``(Σ_u L_u) ⊗ (Σ_u R_u) / U``. This is exact for one use and whenever the uses
  share one of the two factors (all ``L_u`` equal or all ``R_u`` equal: then it is ``Σ_u L_u ⊗ R_u``);
  like K-FAC itself it leaves out the cross terms between uses. Needs the owner's K-FAC matrix to be
  the tied parameter alone (e.g. an Embedding, or a bias-free Linear), in one matrix layout, with K-FAC for every
  use (:func:`tied_kfac_undefined`); otherwise the selection gives the block the diagonal where K-FAC came by
  default or by layer type, and :func:`check_kfac_tied` raises NotImplementedError where a key named it.

A *functional* use (``F.linear(h, emb.weight)``) is not a module call and cannot be recorded, so the
capture refuses it with a ``ValueError`` (:mod:`curvature.uses`) instead of building blocks that
miss its contribution. Write the use as a module sharing the parameter
(``head = nn.Linear(D, V, bias=False); head.weight = emb.weight``). The Hessian needs no recording and
is exact either way.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .blocks import Layout
from .modules.base import flat_per_example
from .options import Approx

#: a use of a tied parameter: (family, module, names, normal-form input, normal-form output gradient)
Use = Tuple[object, object, Tuple[str, ...], Tensor, Tensor]


def tied_kfac_undefined(layout: Layout) -> Optional[str]:
    """Why K-FAC is not defined for ``layout``'s tied block, or None: a use without K-FAC (a grouped
    convolution), a use holding the parameter in another matrix layout (a Conv2d's weight used by a
    ConvTranspose2d: its ``M`` swaps the weight's channel dimensions, so the uses' factors do not describe one
    matrix), or a K-FAC matrix holding more than the tied parameter (a Linear's bias beside its tied weight)."""
    params = {u.owner_param for u in layout.tied}
    undefined = [f"{u.name!r}: {u.family.kfac_undefined(u.module)}" for u in layout.tied
                 if u.family.kfac_undefined(u.module) is not None]
    if undefined:
        return f"a use of its tied parameter has none ({'; '.join(undefined)})"
    other = [u.name for u in layout.tied if u.family.matrix_layout != layout.family.matrix_layout]
    if other:
        return (f"modules {other} hold its tied parameter in another matrix layout (a convolution's weight used by "
                "a transposed convolution: one swaps the channel dimensions of the other)")
    if tuple(layout.param_names) != tuple(params):
        return (f"its K-FAC matrix would hold more than the tied parameter (it has {list(layout.param_names)}): the "
                "tied parameter must be the module's only covered one")
    return None


def check_kfac_tied(layout: Layout) -> None:
    """NotImplementedError naming :func:`tied_kfac_undefined`'s reason, where there is one."""
    reason = tied_kfac_undefined(layout)
    if reason is not None:
        raise NotImplementedError(
            f"K-FAC of module {layout.name!r} ({type(layout.module).__name__}), whose parameters "
            f"{sorted({u.owner_param for u in layout.tied})} are tied to modules {[u.name for u in layout.tied]}, is "
            f"not defined: {reason}; use approx='full' or 'diag' for it")


def tied_per_example_sum(layout: Layout, shape: Approx, uses: Sequence[Use], chunk: int) -> Tensor:
    """``Σ_{k,n}`` of the squared (diag, ``[P]``) or outer (full, ``[P, P]``) per-example gradients of
    ``layout``'s parameters, each gradient summed over ``uses``: the first is the owner module with
    ``layout.param_names``, then one per ``layout.tied`` entry (names ``(use.param,)``)."""
    n_examples = uses[0][3].shape[0]
    bad = [(u.name, use[3].shape[0]) for u, use in zip(layout.tied, uses[1:]) if use[3].shape[0] != n_examples]
    if bad:
        raise ValueError(f"tied parameter of module {layout.name!r} ({n_examples} examples) is used by modules "
                         f"with other batch sizes {bad}; per-example gradients cannot be summed")
    targets = [None] + [u.owner_param for u in layout.tied]
    total = None
    for s in range(0, n_examples, chunk):
        pe: Dict[str, Tensor] = {}
        for (fam, mod, names, a, g), target in zip(uses, targets):
            part = fam.per_example_grads(mod, a[s:s + chunk], g[:, s:s + chunk], names)
            for local, t in part.items():
                key = local if target is None else target
                pe[key] = pe[key] + t if key in pe else t
        flat = flat_per_example(pe, layout.param_names).reshape(-1, layout.numel)
        part_sum = flat.pow(2).sum(0) if shape is Approx.DIAG else flat.t() @ flat
        total = part_sum if total is None else total + part_sum
    assert total is not None
    return total


def combine_kfac(factors: Sequence[Sequence[Tensor]]) -> Tuple[Tensor, Tensor]:
    """``(Σ_u L_u, Σ_u R_u / U)`` from the per-use ``(L_u, R_u)`` (diagonal ``[n]`` factors made dense
    when summed with a matrix)."""
    if len(factors) == 1:
        return factors[0][0], factors[0][1]

    def total(fs: List[Tensor]) -> Tensor:
        if all(f.dim() == 1 for f in fs):
            return sum(fs[1:], fs[0].clone())
        dense = [torch.diag(f) if f.dim() == 1 else f for f in fs]
        return sum(dense[1:], dense[0].clone())
    left = total([f[0] for f in factors])
    right = total([f[1] for f in factors]).div_(len(factors))
    return left, right


__all__ = ["check_kfac_tied", "tied_kfac_undefined", "tied_per_example_sum", "combine_kfac"]
