"""KAISA communication for the preconditioner: factor all-reduce, inverse and gradient broadcasts.

Placement comes from :class:`torchsso2.distributed.WorkAssignment`; the collectives go
through a :class:`torchsso2.distributed.Communicator`. Every rank calls every method with the
same layers in the same order (ranks outside a broadcast group return at once).

Per K-FAC step, with ``W`` ranks, ``g`` grad workers per layer and ``b`` bytes per element
(payload a rank contributes, as counted by ``Communicator.bytes_sent``):

* factor step: every rank all-reduces ``32·L`` bytes (four float64 per registered layer: how many
  contributions it folded into A and G, and their squares) and then ``Σ_layers (n_A² + n_G²)·b`` over the factors
  updated on any rank (``n(n+1)/2`` per factor with ``symmetry_aware``);
* inverse step, only if ``g > 1``: the inverse worker of each factor broadcasts it to its
  ``g − 1`` peers: eigen ``n² + n`` (``Q``, ``λ``; with the eigenvalue outer product ``Q_A``
  and ``Q_G`` + ``n_G·n_A``), inverse ``n²`` (``n(n+1)/2`` with ``symmetry_aware``);
* every step, only if ``g < W``: each grad worker broadcasts the ``n_G·n_A`` preconditioned
  gradient of each of its layers to its ``W/g − 1`` receivers.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Set, Tuple

import torch
from torch import Tensor

from torchsso2.distributed import Communicator, Group, WorkAssignment

from .enums import ComputeMethod
from .layer import FACTORS, KFACLayer

__all__ = ["KAISAComm"]


class KAISAComm:
    """The collectives of one preconditioner.

    Args:
        comm: the communicator.
        assignment: KAISA placement of the registered layers (by name).
        bucket_cap_mb: all-reduce bucket size in MiB; ``0`` all-reduces each factor on its own.
        symmetry_aware: send only the upper triangle of symmetric matrices (factors and,
            with the inverse method, inverses).
    """

    def __init__(self, comm: Communicator, assignment: WorkAssignment, bucket_cap_mb: float,
                 symmetry_aware: bool) -> None:
        self.comm = comm
        self.assignment = assignment
        self.bucket_cap_mb = bucket_cap_mb
        self.symmetry_aware = symmetry_aware
        # every rank makes the same groups in the same order
        self.groups: Dict[Tuple[int, ...], Group] = {
            ranks: comm.new_group(list(ranks)) for ranks in assignment.communication_groups()
        }

    @property
    def rank(self) -> int:
        return self.comm.rank

    def _group(self, ranks: Sequence[int]) -> Group:
        key = tuple(sorted(ranks))
        return self.groups[key] if key in self.groups else Group(key)

    def allreduce_factors(self, layers: Sequence[KFACLayer], updated: Set[str]) -> Set[str]:
        """Average the running factors updated in this factor step over the ranks, weighted by how many
        contributions each rank folded into them.

        Every rank calls it at every factor step with all registered ``layers`` (the same list on
        every rank) and the names of the layers whose factors it folded in this step
        (``KFACLayer.fold_counts``: its forwards for ``A``, backwards for ``G``). With several ranks one
        all-reduce of those counts and their squares (``4·len(layers)`` float64) comes first, so that the ranks agree on
        which factors travel and with what weight: a factor is replaced by ``Σ_r c_r F_r / Σ_r c_r`` over
        the ranks ``r`` that folded ``c_r > 0`` contributions into it (the others contribute zeros and take
        the result; with equal counts on every rank it is the plain mean, kfac_pytorch's, bit for bit). So ranks
        routed through different layers (multi-task heads under ``DistributedDataParallel(
        find_unused_parameters=True)``), or through a layer a different number of times, end with the
        factors of one process that feeds the ranks' shards as accumulated micro-batches. A factor no rank
        updated is left alone.

        Returns:
            the names of the layers whose factors changed in this step on any rank (the same set on
            every rank).
        """
        if self.comm.world_size == 1 or not layers:
            return {layer.name for layer in layers if layer.name in updated}
        world = self.comm.world_size
        mine = [float(layer.fold_counts[key]) if layer.name in updated else 0.0 for layer in layers for key in FACTORS]
        # (c, c²) per factor: W·Σc² = (Σc)² exactly when every rank folded the same count (integers: exact in float64)
        stats = torch.tensor([v for c in mine for v in (c, c * c)], dtype=torch.float64,
                             device=layers[0].params[0].device)
        self.comm.allreduce([stats], op="sum", bucket_cap_mb=self._cap())
        sums = [int(round(v)) for v in stats.tolist()]
        entries: List[Tuple[KFACLayer, str, float, int, bool]] = []
        for i, layer in enumerate(layers):
            for j, key in enumerate(FACTORS):
                k = 2 * (2 * i + j)
                total, squares = sums[k], sums[k + 1]
                if total > 0:
                    entries.append((layer, key, mine[2 * i + j], total, world * squares == total * total))
        tensors: List[Tensor] = []
        for layer, key, count, _, equal in entries:
            if count > 0:
                t = layer.factor(key)
                assert t is not None
                if not equal:
                    t.mul_(count)  # (the fold's own new tensor: the factor before it is kept for a skipped step)
                tensors.append(t)
            else:
                tensors.append(layer.zero_factor(key))
        self._allreduce(tensors, "sum")
        for (layer, key, count, total, equal), t in zip(entries, tensors):
            t.div_(world if equal else total)  # equal counts: the plain mean over ranks (kfac_pytorch's), bit for bit
            if count == 0:
                layer.adopt_factor(key, t)
        return {entry[0].name for entry in entries}

    def _allreduce(self, tensors: List[Tensor], op: str) -> None:
        if not tensors:
            return
        if self.bucket_cap_mb > 0:
            self.comm.allreduce(tensors, op=op, bucket_cap_mb=self.bucket_cap_mb, symmetric=self.symmetry_aware)
        else:
            for t in tensors:
                self.comm.allreduce([t], op=op, symmetric=self.symmetry_aware)

    def compute_and_share_inverses(self, layer: KFACLayer, damping: float) -> None:
        """Decompose ``layer``'s factors on their inverse workers; share within the grad workers."""
        for factor in FACTORS:
            src = self.assignment.inv_worker(layer.name, factor)
            if self.rank == src:
                layer.compute(factor, damping)
            if self.assignment.broadcast_inverses():
                workers = self.assignment.grad_workers(layer.name)
                if self.rank in workers:
                    symmetric = self.symmetry_aware and layer.method is ComputeMethod.INVERSE
                    self.comm.broadcast(layer.inverse_tensors(factor, receive=self.rank != src), src,
                                        self._group(workers),
                                        bucket_cap_mb=self._cap(), symmetric=symmetric)
        layer.inv_ready = True

    def is_grad_worker(self, layer: KFACLayer) -> bool:
        return self.assignment.is_grad_worker(self.rank, layer.name)

    def share_gradient(self, layer: KFACLayer, buffer: Tensor) -> None:
        """Broadcast the preconditioned gradient ``buffer`` from each grad worker to its receivers."""
        if not self.assignment.broadcast_gradients():
            return
        for src, ranks in self.assignment.grad_receivers(layer.name).items():
            if self.rank in ranks:
                self.comm.broadcast([buffer], src, self._group(ranks), bucket_cap_mb=self._cap())

    def _cap(self) -> float:
        return self.bucket_cap_mb if self.bucket_cap_mb > 0 else 25.0
