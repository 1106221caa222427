"""Running (EMA) curvature over steps: the state every optimizer face keeps.

``RunningCurvature`` owns one block per covered module; :meth:`update` folds a batch's
fresh blocks in with ``C ← decay·C + (1 − decay)·C_batch`` (the first update copies),
:meth:`decompose` prepares ``(scale·C + damping·I)`` for :meth:`solve` / :meth:`sample`.
Communication (averaging statistics over ranks, placement of decompositions) is done by
the caller through :meth:`tensors`; the engine imports no distributed code.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .blocks import Block, FullBlock, KFACBlock
from .blocks.base import DerivedCache
from .linalg import LinalgError


class RunningCurvature:
    """EMA of per-module curvature blocks. Empty until the first :meth:`update`."""

    def __init__(self, psd: bool = False) -> None:
        self.blocks: Dict[str, Block] = {}
        self.num_updates = 0
        #: the blocks are positive semi-definite by construction (Fisher-type kinds): a full block's negative
        #: eigenvalues are round-off (:meth:`curvature.blocks.FullBlock.decompose`)
        self.psd = psd

    def update(self, fresh: Dict[str, Block], decay: float) -> None:
        """Fold ``fresh`` blocks into the running estimate (the first call copies them).

        ``C ← decay·C + (1 − decay)·C_batch`` for every statistic of every block in one
        ``torch._foreach_lerp_`` (per dtype), not two ops per tensor: the same EMA up to rounding,
        ~10 µs instead of ~40 for the four factors of a two-layer MLP."""
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay!r} must be in [0, 1)")
        pairs: Dict[torch.dtype, Tuple[List[Tensor], List[Tensor]]] = {}
        for name, blk in fresh.items():
            if name not in self.blocks or self.num_updates == 0:
                # copy the statistics: later in-place EMA updates must not alter the caller's block
                own = copy.copy(blk)
                own.__dict__.update({k: v.clone() for k, v in vars(blk).items() if isinstance(v, Tensor)})
                # and caches of their own (a shallow copy would share the fresh block's cache object)
                own.__dict__.update({k: DerivedCache() for k, v in vars(blk).items() if isinstance(v, DerivedCache)})
                own.decomposition = None if blk.decomposition is None else dict(blk.decomposition)
                self.blocks[name] = own
            else:
                for dst, src in zip(self.blocks[name].tensors(), blk.tensors()):
                    if dst.shape != src.shape:  # (a lerp would broadcast a diagonal [n] over an [n, n] matrix)
                        raise ValueError(f"block {name!r}: a fresh statistic of shape {tuple(src.shape)} cannot be "
                                         f"folded into the running one of shape {tuple(dst.shape)}")
                    dsts, srcs = pairs.setdefault(dst.dtype, ([], []))
                    dsts.append(dst)
                    srcs.append(src if src.dtype == dst.dtype else src.to(dst.dtype))
        for dsts, srcs in pairs.values():
            torch._foreach_lerp_(dsts, srcs, 1.0 - decay)
        self.num_updates += 1

    def is_finite(self) -> bool:
        return all(b.is_finite() for b in self.blocks.values())

    def tensors(self) -> List[Tensor]:
        """All statistics, in module order (for all-reduce and checkpointing)."""
        return [t for b in self.blocks.values() for t in b.tensors()]

    def decompose(self, damping: float, scale: float = 1.0, backend: Optional[str] = None,
                  dtype: Optional[torch.dtype] = None, names: Optional[Sequence[str]] = None,
                  kfac_method: str = "eigen", probe: Tuple[type, ...] = ()) -> None:
        """Decompose ``scale·C + damping·I`` of every block (or of ``names``); K-FAC blocks with
        ``kfac_method`` (``"eigen"``: exact damping; ``"inverse"``: factored, see :class:`KFACBlock`).

        All or nothing: when one block's decomposition fails (:class:`~curvature.linalg.LinalgError`,
        naming the block, is raised), every block keeps its previous decomposition, so a step never
        solves with a mix of the new curvature in some blocks and the old one in others. ``probe``: the
        block types whose shortfall a failure also takes (:func:`decompose_all_or_nothing`)."""
        todo = {name: self.blocks[name] for name in (names if names is not None else self.blocks)}
        decompose_all_or_nothing(todo, lambda blk: decompose_block(blk, damping, scale=scale, backend=backend,
                                                                   dtype=dtype, kfac_method=kfac_method, psd=self.psd),
                                 probe=probe)

    def state_dict(self) -> Dict[str, Any]:
        return {"num_updates": self.num_updates, "blocks": {n: b.state_dict() for n, b in self.blocks.items()}}

    def load_state_dict(self, state: Dict[str, Any], fresh_like: Dict[str, Block]) -> None:
        """Load ``state``; ``fresh_like`` gives blocks of the right type and layout to fill."""
        blocks = state.get("blocks", {})
        if set(blocks) != set(fresh_like):
            raise ValueError(f"checkpoint covers modules {sorted(blocks)}, this model covers {sorted(fresh_like)}")
        for name, blk in fresh_like.items():
            blk.load_state_dict(blocks[name])
        self.blocks = dict(fresh_like)
        self.num_updates = int(state.get("num_updates", 0))


def decompose_all_or_nothing(blocks: Dict[str, Block], decompose: Callable[[Block], None],
                             probe: Tuple[type, ...] = ()) -> None:
    """``decompose(block)`` for every block in order; when one raises :class:`~curvature.linalg.LinalgError`
    every block gets its previous decomposition back and the error is re-raised, naming the
    block. Its ``damping_shortfall`` is the largest of the failing block's (a diagonal or full block) and the
    ``probe`` blocks' after it (:func:`largest_shortfall`; the caller names the types where it reads the
    shortfall: a damping rule's raise then covers them all)."""
    old = {name: blk.decomposition for name, blk in blocks.items()}
    names = list(blocks)
    for at, (name, blk) in enumerate(blocks.items()):
        try:
            decompose(blk)
        except LinalgError as err:
            try:
                err.damping_shortfall = largest_shortfall(err, decompose, [blocks[n] for n in names[at + 1:]], probe)
            finally:
                for n, dec in old.items():
                    blocks[n].decomposition = dec
            if repr(name) in str(err):  # the block's own check names it; a backend's error does not
                raise
            wrapped = LinalgError(f"block {name!r}: {err}")
            wrapped.damping_shortfall = err.damping_shortfall
            raise wrapped from err


def largest_shortfall(error: LinalgError, decompose: Callable[[Block], None], later: Sequence[Block],
                      probe: Tuple[type, ...]) -> Optional[float]:
    """The largest ``damping_shortfall`` of ``error`` (a failed decomposition) and of ``decompose`` on the blocks
    of the ``probe`` types among ``later`` (the blocks a decomposition stopped before: a pass over each
    diagonal, an eigendecomposition of each full block, on a failure only; the caller restores their
    decompositions); None where none falls short (a K-FAC or backend failure alone)."""
    found = [error.damping_shortfall or 0.0]
    for block in later:
        if isinstance(block, probe):
            try:
                decompose(block)
            except LinalgError as err:
                found.append(err.damping_shortfall or 0.0)
    top = max(found)
    return top if top > 0 else None


def decompose_block(block: Block, damping: float, scale: float = 1.0, backend: Optional[str] = None,
                    dtype: Optional[torch.dtype] = None, kfac_method: str = "eigen", psd: bool = False) -> None:
    """``block.decompose(...)``, with ``method=kfac_method`` for a K-FAC block (the factored
    ``"inverse"`` method only exists for Kronecker factors; diagonal and full blocks are exact) and ``psd``
    for a full block (a positive semi-definite kind: negative eigenvalues are round-off)."""
    if isinstance(block, KFACBlock):
        block.decompose(damping, scale=scale, backend=backend, dtype=dtype, method=kfac_method)
    elif isinstance(block, FullBlock):
        block.decompose(damping, scale=scale, backend=backend, dtype=dtype, psd=psd)
    else:
        block.decompose(damping, scale=scale, backend=backend, dtype=dtype)
