"""KAISA communication for the preconditioner: factor all-reduce, inverse and gradient broadcasts.

Placement comes from :class:`torchsso2.distributed.WorkAssignment`; the collectives go
through a :class:`torchsso2.distributed.Communicator`. Every rank calls every method with the
same layers in the same order (ranks outside a broadcast group return at once).

Per K-FAC step, with ``W`` ranks, ``g`` grad workers per layer and ``b`` bytes per element
(payload a rank contributes, as counted by ``Communicator.bytes_sent``):

* factor step: every rank all-reduces ``Σ_layers (n_A² + n_G²)·b`` (``n(n+1)/2`` per factor
  with ``symmetry_aware``);
* inverse step, only if ``g > 1``: the inverse worker of each factor broadcasts it to its
  ``g − 1`` peers: eigen ``n² + n`` (``Q``, ``λ``; with the eigenvalue outer product ``Q_A``
  and ``Q_G`` + ``n_G·n_A``), inverse ``n²`` (``n(n+1)/2`` with ``symmetry_aware``);
* every step, only if ``g < W``: each grad worker broadcasts the ``n_G·n_A`` preconditioned
  gradient of each of its layers to its ``W/g − 1`` receivers.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

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

    def allreduce_factors(self, layers: Sequence[KFACLayer]) -> None:
        """Average the running factors of ``layers`` over all ranks (in place)."""
        if self.comm.world_size == 1 or not layers:
            return
        tensors: List[Tensor] = [t for layer in layers for t in layer.factors()]
        if self.bucket_cap_mb > 0:
            self.comm.allreduce(tensors, op="mean", bucket_cap_mb=self.bucket_cap_mb,
                                symmetric=self.symmetry_aware)
        else:
            for t in tensors:
                self.comm.allreduce([t], op="mean", symmetric=self.symmetry_aware)
        # the reduced tensors replace the factors in place, nothing else to do

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
