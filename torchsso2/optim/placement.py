"""KAISA placement of the native optimizers' decompositions: who decomposes, who uses them.

Every rank holds the same running curvature (the fresh statistics are mean-all-reduced at
every estimate, see :meth:`CurvatureOptimizer._average_over_ranks`). A
:class:`~torchsso2.distributed.WorkAssignment` built from the blocks' sizes then says, per
block (= per covered module, whatever its shape: ``full``, ``diag`` or ``kfac``):

* **inverse worker** — the one rank that decomposes it. All factors of a block stay on one
  rank (``colocate_factors=True``): the K-FAC eigen-decomposition needs the spectra of both
  factors for its denominator ``scale·λ_L λ_Rᵀ + damping``.
* **grad workers** — the ranks that hold the block's decomposition: the inverse worker
  broadcasts the tensors of ``block.decomposition`` to them (``COMM_OPT``: every rank;
  ``MEM_OPT``: nobody, the inverse worker is the only grad worker).
* **receivers** — with fewer grad workers than ranks, each grad worker computes what needs
  the decomposition (a preconditioned gradient; for VI also the weight noise) and
  broadcasts it to its receiver group (:meth:`Placement.share`).

Costs (``assignment_strategy``): a ``[n, n]`` matrix costs ``n³`` (``COMPUTE``) or ``n²``
(``MEMORY``); a diagonal ``[n]`` costs ``n`` under both.

Failures: a decomposition that fails (:class:`~curvature.linalg.LinalgError`) on its
inverse worker is announced to every rank by one tiny all-reduce, so that all ranks take
the same branch of the non-finite policy; on failure every block keeps its previous
decomposition (all or nothing). Broadcasts of different (source, group) pairs run in one
global sorted order on every rank, which keeps overlapping groups free of deadlocks.

With one rank every method reduces to the plain local computation (no collective).
"""
from __future__ import annotations

import logging
import numbers
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from curvature.blocks import Block, DiagBlock, FullBlock, KFACBlock
from curvature.linalg import LinalgError
from curvature.options import float_or_inf
from curvature.running import decompose_all_or_nothing, largest_shortfall

from ..distributed import AssignmentStrategy, DistributedStrategy, Group, WorkAssignment, parse_enum
from ..distributed.assignment import grad_worker_count
from .steps import precondition as local_precondition

logger = logging.getLogger(__name__)

Ranks = Tuple[int, ...]
#: compute(name, block, receivers) -> tensors; ``receivers`` are the ranks that will get them
Compute = Callable[[str, Block, Ranks], List[Tensor]]
#: like(name, block, receivers) -> empty tensors of the same shapes/dtypes as compute's
Like = Callable[[str, Block, Ranks], List[Tensor]]

def parse_assignment_strategy(value: Union[str, AssignmentStrategy]) -> AssignmentStrategy:
    """``AssignmentStrategy`` or ``"compute"`` / ``"memory"`` (case-insensitive)."""
    return parse_enum(value, AssignmentStrategy, "assignment_strategy")


def parse_grad_worker_fraction(value: Union[float, str, DistributedStrategy]) -> Union[float, DistributedStrategy]:
    """A float in ``(0, 1]``, a ``DistributedStrategy`` or ``"comm_opt" | "mem_opt" | "hybrid_opt"``."""
    if isinstance(value, (DistributedStrategy, str)):
        return parse_enum(value, DistributedStrategy, "grad_worker_fraction")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"grad_worker_fraction={value!r}; expected a float in (0, 1], a DistributedStrategy "
                        "or one of 'comm_opt', 'mem_opt', 'hybrid_opt'")
    fraction = float_or_inf(value)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"grad_worker_fraction must be in (0, 1], got {value!r}")
    return fraction


def block_work(blk: Block, strategy: AssignmentStrategy) -> Dict[str, float]:
    """``{statistic index: cost}`` of decomposing ``blk`` (matrices ``n³``/``n²``, diagonals ``n``)."""
    return {f"t{i}": float(t.shape[0]) if t.dim() == 1 else strategy.cost(int(t.shape[0]))
            for i, t in enumerate(blk.tensors())}


def decomposition_like(blk: Block, dtype: Optional[torch.dtype], kfac_method: str = "eigen") -> Dict[str, Any]:
    """Empty tensors shaped like what ``blk.decompose(..., dtype=dtype)`` produces (receive buffers).

    Full: ``evecs [P, P]``, ``denom [P]``; diag: ``denom [P]``; K-FAC, ``kfac_method="eigen"``:
    ``ql [n_L, n_L]`` (``None`` for a diagonal factor), ``qr``, ``denom [n_L, n_R]``; ``"inverse"``:
    ``linv``, ``rinv`` (``[n, n]``, or ``[n]`` for a diagonal factor).
    """
    stats = blk.tensors()[0]
    kw = dict(dtype=dtype or stats.dtype, device=stats.device)
    if isinstance(blk, FullBlock):
        p = blk.matrix.shape[0]
        return {"evecs": torch.empty(p, p, **kw), "denom": torch.empty(p, **kw)}
    if isinstance(blk, DiagBlock):
        return {"denom": torch.empty(blk.diagonal.shape[0], **kw)}
    if isinstance(blk, KFACBlock):
        nl, nr = blk.left.shape[0], blk.right.shape[0]
        if kfac_method == "inverse":
            return {"method": "inverse", "linv": torch.empty(blk.left.shape, **kw),
                    "rinv": torch.empty(blk.right.shape, **kw)}
        return {"method": "eigen",
                "ql": torch.empty(nl, nl, **kw) if blk.left.dim() == 2 else None,
                "qr": torch.empty(nr, nr, **kw) if blk.right.dim() == 2 else None,
                "denom": torch.empty(nl, nr, **kw)}
    raise TypeError(f"no decomposition layout known for block type {type(blk).__name__}")


def _tensors_of(dec: Dict[str, Any]) -> List[Tensor]:
    return [dec[k] for k in sorted(dec) if isinstance(dec[k], Tensor)]


def _check_like(name: str, got: Dict[str, Any], like: Dict[str, Any]) -> None:
    def sig(d: Dict[str, Any]) -> List[Any]:
        return [(k, tuple(v.shape), v.dtype) if isinstance(v, Tensor) else (k, v) for k, v in sorted(d.items())]

    if sig(got) != sig(like):
        raise RuntimeError(f"block {name!r}: decomposition {sig(got)} does not match the receive layout "
                           f"{sig(like)}; update torchsso2.optim.placement.decomposition_like")


class Placement:
    """Decomposition and preconditioning of a set of blocks, spread over ``comm``'s ranks.

    Args:
        comm: a :class:`~torchsso2.distributed.Communicator`.
        grad_worker_fraction: fraction of ranks holding each block's decomposition, a float
            in ``(0, 1]`` or a :class:`DistributedStrategy` (``COMM_OPT`` = 1, ``MEM_OPT`` =
            1/W, ``HYBRID_OPT`` = 1/2), validated against the world size here.
        assignment_strategy: cost model balancing the decompositions, ``COMPUTE`` (``n³``)
            or ``MEMORY`` (``n²``).

    The :class:`WorkAssignment` and the communication groups are made at the first
    :meth:`decompose` (every rank reaches it at the same step), from the blocks given then.
    """

    def __init__(self, comm: Any, grad_worker_fraction: Union[float, str, DistributedStrategy] =
                 DistributedStrategy.COMM_OPT,
                 assignment_strategy: Union[str, AssignmentStrategy] = AssignmentStrategy.COMPUTE) -> None:
        self.comm = comm
        self.grad_worker_fraction = parse_grad_worker_fraction(grad_worker_fraction)
        self.strategy = parse_assignment_strategy(assignment_strategy)
        grad_worker_count(comm.world_size, self.grad_worker_fraction)  # validate now, not at step 1
        self.assignment: Optional[WorkAssignment] = None
        self._groups: Dict[Ranks, Group] = {}

    @property
    def active(self) -> bool:
        """Whether there is more than one rank (otherwise every method is local)."""
        return self.comm.world_size > 1

    # ---- the assignment ---------------------------------------------------------------------
    def assign(self, blocks: Dict[str, Block]) -> WorkAssignment:
        """The assignment of ``blocks``: made at the first call, and made again over all of them when a
        block appears that it does not place (a layer unfrozen, or first called, after the first
        decomposition); collective then (``new_group``): every rank meets the same blocks at the same
        step. A new block comes with a decomposition of every block (``decompose``), which places them
        anew (a failed one gives the old assignment back with the old decompositions), or, with every
        rank a grad worker (``reparam``'s diagonal), decomposed on every rank."""
        if self.assignment is None or any(n not in self.assignment.work for n in blocks):
            if self.assignment is not None:
                logger.debug("work assignment made again: new blocks %s",
                             [n for n in blocks if n not in self.assignment.work])
            work = {name: block_work(blk, self.strategy) for name, blk in blocks.items()}
            self.assignment = WorkAssignment(work, self.comm.world_size, self.grad_worker_fraction,
                                             strategy=self.strategy, colocate_factors=True)
            self._groups.update({ranks: self.comm.new_group(list(ranks))
                                 for ranks in self.assignment.communication_groups() if ranks not in self._groups})
        return self.assignment

    def held(self, names: Collection[str]) -> List[str]:
        """The blocks among ``names`` whose decompositions this rank holds (it is one of their grad workers), and
        those the assignment does not know yet (a block first seen at this step: no rank holds one)."""
        wa, rank = self.assignment, self.comm.rank
        return [n for n in names if wa is None or n not in wa.work or rank in wa.grad_workers(n)]

    def inv_worker(self, name: str) -> int:
        assert self.assignment is not None
        return self.assignment.inv_worker(name, "t0")

    def _group(self, ranks: Ranks) -> Optional[Group]:
        if ranks == tuple(range(self.comm.world_size)):
            return None
        return self._groups[ranks]

    def _broadcast_all(self, pending: Dict[Tuple[int, Ranks], List[Tensor]]) -> None:
        """One (bucketed) broadcast per (source, group), in the same global order on every rank."""
        for (src, ranks) in sorted(pending):
            if pending[(src, ranks)]:
                self.comm.broadcast(pending[(src, ranks)], src=src, group=self._group(ranks))

    # ---- decomposition ------------------------------------------------------------------------
    def decompose(self, blocks: Dict[str, Block], decompose: Callable[[Block], None],
                  dtype: Optional[torch.dtype] = None, kfac_method: str = "eigen", probe: Tuple[type, ...] = ()
                  ) -> Optional[LinalgError]:
        """Decompose every block on its inverse worker and broadcast it to its grad workers.

        ``decompose(block)`` runs the block's own damped decomposition. Returns ``None`` on
        success, else a :class:`~curvature.linalg.LinalgError` naming the failed block, the same on
        every rank in its ``damping_shortfall`` (the largest of the ranks' failed diagonal or full blocks, each
        rank's ``probe`` blocks after its failing one included, or None); then every block on every rank keeps its
        previous decomposition.
        """
        if not self.active:
            try:
                decompose_all_or_nothing(blocks, decompose, probe)
            except LinalgError as err:
                return err
            return None
        if not blocks:  # nothing covered: nothing to place (every rank sees the same empty set)
            return None
        previous = self.assignment  # given back with the old decompositions if a decomposition fails
        wa = self.assign(blocks)
        rank = self.comm.rank
        old = {n: b.decomposition for n, b in blocks.items()}
        error: Optional[str] = None
        shortfall = 0.0
        mine = [(name, blk) for name, blk in blocks.items() if self.inv_worker(name) == rank]
        for at, (name, blk) in enumerate(mine):
            try:
                decompose(blk)
            except LinalgError as err:
                error = f"block {name!r} (decomposed on rank {rank}): {err}"
                # with its own probe blocks after it, as one process does (running.decompose_all_or_nothing)
                shortfall = largest_shortfall(err, decompose, [b for _, b in mine[at + 1:]], probe) or 0.0
                break
        first = next(iter(blocks.values()))
        device = first.tensors()[0].device
        flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64, device=device)
        self.comm.allreduce([flag], op="sum")
        if float(flag) > 0:
            for n, b in blocks.items():
                b.decomposition = old[n]
            self.assignment = previous  # the old decompositions sit where the old assignment placed them
            # every rank's shortfall, each in its own slot (a rare second collective): the largest, on every rank
            slots = torch.zeros(self.comm.world_size, dtype=torch.float64, device=device)
            slots[rank] = shortfall
            self.comm.allreduce([slots], op="sum")
            failure = LinalgError(error or f"a decomposition failed on another rank ({int(float(flag))} rank(s) "
                                           "failed)")
            largest = float(slots.max())
            failure.damping_shortfall = largest if largest > 0 else None
            return failure
        pending: Dict[Tuple[int, Ranks], List[Tensor]] = {}
        for name, blk in blocks.items():
            src, workers = self.inv_worker(name), tuple(wa.grad_workers(name))
            if rank not in workers:
                blk.decomposition = None  # MEM_OPT / HYBRID_OPT: not needed on this rank
                continue
            if not wa.broadcast_inverses():
                continue
            like = decomposition_like(blk, dtype, kfac_method)
            if rank == src:
                assert blk.decomposition is not None
                # the receivers get contiguous tensors: give the source the same memory layout, so
                # that every rank runs the same BLAS kernels and the replicas stay bit-identical
                blk.decomposition = {k: v.contiguous() if isinstance(v, Tensor) else v
                                     for k, v in blk.decomposition.items()}
                _check_like(name, blk.decomposition, like)
            else:
                blk.decomposition = like
            pending.setdefault((src, workers), []).extend(_tensors_of(blk.decomposition))
        self._broadcast_all(pending)
        return None

    # ---- use -------------------------------------------------------------------------------------
    def share(self, blocks: Dict[str, Block], compute: Compute, like: Like) -> Dict[str, List[Tensor]]:
        """``compute`` on each block's grad workers, then broadcast to the ranks that lack it.

        Returns ``{name: tensors}`` on every rank. With every rank a grad worker
        (``COMM_OPT`` or one rank) ``compute(name, block, (rank,))`` runs locally; otherwise
        the grad worker ``src`` serving this rank computes for its receiver group ``ranks``
        and broadcasts, and the other members receive into ``like(name, block, ranks)``.
        """
        rank = self.comm.rank
        if not self.active or not blocks or not self.assign(blocks).broadcast_gradients():
            return {name: compute(name, blk, (rank,)) for name, blk in blocks.items()}
        wa = self.assign(blocks)
        out: Dict[str, List[Tensor]] = {}
        pending: Dict[Tuple[int, Ranks], List[Tensor]] = {}
        for name, blk in blocks.items():
            src = wa.src_grad_worker(rank, name)
            ranks = tuple(wa.grad_receivers(name)[src])
            out[name] = compute(name, blk, ranks) if rank == src else like(name, blk, ranks)
            pending.setdefault((src, ranks), []).extend(out[name])
        self._broadcast_all(pending)
        return out

    def precondition(self, blocks: Dict[str, Block], grads: Dict[int, Tensor]) -> Dict[int, Tensor]:
        """:func:`torchsso2.optim.steps.precondition`, with each block solved by its grad workers."""
        if not self.active:
            return local_precondition(blocks, grads)

        def solve(name: str, blk: Block, ranks: Ranks) -> List[Tensor]:
            return blk.solve([grads[id(p)] for p in blk.layout.params])

        def empty(name: str, blk: Block, ranks: Ranks) -> List[Tensor]:
            return [torch.empty_like(grads[id(p)]) for p in blk.layout.params]

        out = dict(grads)
        for name, solved in self.share(blocks, solve, empty).items():
            for p, s in zip(blocks[name].layout.params, solved):
                out[id(p)] = s
        return out

    def summary(self) -> str:
        """The assignment's table (after the first decomposition), or a one-line note."""
        if self.assignment is None:
            return f"Placement(world_size={self.comm.world_size}): no assignment yet (made at the first decomposition)"
        return self.assignment.summary()
