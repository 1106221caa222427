"""The ``Communicator`` protocol and the bucketed base class every backend shares.

A communicator is the only thing the optimizers know about distribution. Three backends
implement it: :class:`~torchsso2.distributed.local.LocalCommunicator` (one process, no-op),
:class:`~torchsso2.distributed.torch_backend.TorchCommunicator` (``torch.distributed``) and
:class:`~torchsso2.distributed.mpi_backend.MPICommunicator` (``mpi4py``).

Every collective is *in place* on a list of tensors and is called by every rank of the
world (or of the group) with the same list of shapes, dtypes and devices, in the same
order. The base class :class:`BucketedCommunicator` does the bucketing (see
:mod:`~torchsso2.distributed.bucketing`), the argument checks and the byte counting once,
so a backend only implements three primitives on one flat buffer.

Counting model for :attr:`Communicator.bytes_sent` (the same for every backend):

* ``allreduce``: each rank adds the payload bytes of every bucket buffer it contributes,
  i.e. ``sum(numel) * element_size`` of what it reduces (the upper triangles only when
  ``symmetric=True``). This is the logical payload, not the traffic of a particular
  algorithm (a ring all-reduce puts about ``2 (W - 1) / W`` times that on the wire).
* ``broadcast``: only the source rank adds the payload bytes; receivers add nothing.
* nothing is counted when no collective runs: a world (or group) of one rank, or a rank
  that is not a member of the broadcast group.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from torchsso2.distributed.bucketing import (
    MIB,
    check_symmetric_shapes,
    flatten_bucket,
    plan_buckets,
    unflatten_bucket_,
)

logger = logging.getLogger(__name__)


class ReduceOp(str, Enum):
    """Reduction of :meth:`Communicator.allreduce`."""

    MEAN = "mean"
    SUM = "sum"

    @classmethod
    def parse(cls, op: str | ReduceOp) -> ReduceOp:
        """Return the enum member for ``op``; ``ValueError`` naming it if unknown."""
        try:
            return cls(op)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"unknown reduce op {op!r}; expected one of {choices}") from None


@dataclass(frozen=True)
class Group:
    """A subset of the world's ranks, made by :meth:`Communicator.new_group`.

    Attributes:
        ranks: the member ranks (ranks of the world), ascending.
        handle: the backend's object (a ``torch.distributed`` process group, an
            ``mpi4py`` communicator) or ``None`` on ranks that are not members, on the
            local backend, and for the whole world.
    """

    ranks: tuple[int, ...]
    handle: Any = field(default=None, compare=False, repr=False)

    def __contains__(self, rank: object) -> bool:
        return rank in self.ranks

    @property
    def size(self) -> int:
        """Number of member ranks."""
        return len(self.ranks)


@runtime_checkable
class Communicator(Protocol):
    """What the optimizers call to communicate; see the module docstring for the contract."""

    @property
    def rank(self) -> int:
        """Rank of this process in the world, ``0 <= rank < world_size``."""
        ...

    @property
    def world_size(self) -> int:
        """Number of processes in the world."""
        ...

    @property
    def bytes_sent(self) -> int:
        """Running total of payload bytes this rank contributed to collectives."""
        ...

    def reset_counters(self) -> None:
        """Set :attr:`bytes_sent` back to zero."""
        ...

    def allreduce(
        self,
        tensors: list[Tensor],
        op: str = "mean",
        bucket_cap_mb: float = 25.0,
        symmetric: bool = False,
    ) -> None:
        """Reduce ``tensors`` over all ranks, in place.

        Args:
            tensors: same shapes, dtypes, devices and order on every rank.
            op: ``"mean"`` or ``"sum"``.
            bucket_cap_mb: largest bucket payload in MiB; one collective per bucket; a
                tensor larger than the cap is a bucket of its own.
            symmetric: every tensor is a symmetric ``[n, n]`` matrix; only the upper
                triangle (diagonal included) is sent, then mirrored back.
        """
        ...

    def broadcast(
        self,
        tensors: list[Tensor],
        src: int,
        group: Group | None = None,
        *,
        bucket_cap_mb: float = 25.0,
        symmetric: bool = False,
    ) -> None:
        """Copy ``tensors`` of rank ``src`` to every rank of ``group`` (the world if ``None``).

        ``src`` is a world rank and must be a member of ``group``. On a rank outside
        ``group`` the call does nothing, so a loop over groups may be run by every rank.
        """
        ...

    def new_group(self, ranks: list[int]) -> Group:
        """Make a group of ``ranks``; every rank of the world calls it, in the same order."""
        ...

    def barrier(self) -> None:
        """Wait until every rank of the world reaches this call."""
        ...


class BucketedCommunicator(ABC):
    """Shared implementation of :class:`Communicator` over three flat-buffer primitives.

    Subclasses set ``rank`` and ``world_size`` and implement :meth:`_allreduce_sum_`,
    :meth:`_broadcast_` and :meth:`_make_group_handle` (plus :meth:`barrier`). Each
    primitive returns the number of bytes it handed to the collective, which feeds
    :attr:`bytes_sent`.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank {rank} for world_size {world_size}")
        self._rank = rank
        self._world_size = world_size
        self._bytes_sent = 0
        self._num_collectives = 0

    # -- the protocol -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """Rank of this process in the world."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes in the world."""
        return self._world_size

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank contributed to collectives (see module docstring)."""
        return self._bytes_sent

    @property
    def num_collectives(self) -> int:
        """Running count of collectives this rank ran (one per bucket; not in the protocol)."""
        return self._num_collectives

    def reset_counters(self) -> None:
        """Set :attr:`bytes_sent` and :attr:`num_collectives` back to zero."""
        self._bytes_sent = 0
        self._num_collectives = 0

    def allreduce(
        self,
        tensors: list[Tensor],
        op: str | ReduceOp = "mean",
        bucket_cap_mb: float = 25.0,
        symmetric: bool = False,
    ) -> None:
        """Reduce ``tensors`` over all ranks, in place (see :class:`Communicator`)."""
        reduce_op = ReduceOp.parse(op)
        cap_bytes = _cap_bytes(bucket_cap_mb)
        _check_tensors(tensors, symmetric)
        if reduce_op is ReduceOp.MEAN:
            for i, t in enumerate(tensors):
                if not (t.is_floating_point() or t.is_complex()):
                    raise TypeError(f"op='mean' needs floating tensors; tensor {i} has dtype {t.dtype}")
        if self._world_size == 1:  # nothing to reduce with: values stay as they are
            return
        for bucket in plan_buckets(tensors, cap_bytes, symmetric):
            buffer = flatten_bucket(tensors, bucket, symmetric)
            self._bytes_sent += self._allreduce_sum_(buffer)
            self._num_collectives += 1
            if reduce_op is ReduceOp.MEAN:
                buffer.div_(self._world_size)
            unflatten_bucket_(buffer, tensors, bucket, symmetric)
        logger.debug("rank %d: allreduce(%s) of %d tensors", self._rank, reduce_op.value, len(tensors))

    def broadcast(
        self,
        tensors: list[Tensor],
        src: int,
        group: Group | None = None,
        *,
        bucket_cap_mb: float = 25.0,
        symmetric: bool = False,
    ) -> None:
        """Copy ``tensors`` of world rank ``src`` to the members of ``group``, in place."""
        cap_bytes = _cap_bytes(bucket_cap_mb)
        _check_tensors(tensors, symmetric)
        members = tuple(range(self._world_size)) if group is None else group.ranks
        if src not in members:
            raise ValueError(f"broadcast source rank {src} is not in the group {list(members)}")
        if self._rank not in members:
            return
        if len(members) == 1:
            return
        handle = None if group is None else group.handle
        for bucket in plan_buckets(tensors, cap_bytes, symmetric):
            if self._rank == src:
                buffer = flatten_bucket(tensors, bucket, symmetric)
            else:
                buffer = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
            sent = self._broadcast_(buffer, src, members, handle)
            self._num_collectives += 1
            if self._rank == src:
                self._bytes_sent += sent
            else:
                unflatten_bucket_(buffer, tensors, bucket, symmetric)

    def new_group(self, ranks: list[int]) -> Group:
        """Make a :class:`Group`; every rank of the world calls it, in the same order."""
        members = tuple(sorted(int(r) for r in ranks))
        if not members:
            raise ValueError("a group needs at least one rank, got []")
        if len(set(members)) != len(members):
            raise ValueError(f"group ranks must be distinct, got {list(ranks)}")
        bad = [r for r in members if not 0 <= r < self._world_size]
        if bad:
            raise ValueError(f"group ranks {bad} outside [0, {self._world_size}) in {list(ranks)}")
        if members == tuple(range(self._world_size)):
            return Group(members, None)
        return Group(members, self._make_group_handle(members))

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank of the world reaches this call."""

    # -- what a backend implements ------------------------------------------------------
    @abstractmethod
    def _allreduce_sum_(self, buffer: Tensor) -> int:
        """Sum the contiguous 1-D ``buffer`` over the world in place; return bytes sent."""

    @abstractmethod
    def _broadcast_(self, buffer: Tensor, src: int, members: tuple[int, ...], handle: Any) -> int:
        """Broadcast ``buffer`` from world rank ``src`` over ``members``; return bytes sent.

        ``handle`` is the group's backend object, ``None`` for the world.
        """

    @abstractmethod
    def _make_group_handle(self, ranks: tuple[int, ...]) -> Any:
        """Collective over the world: the backend object of a group of ``ranks``.

        Return ``None`` on ranks outside ``ranks``.
        """


def _cap_bytes(bucket_cap_mb: float) -> int:
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    return max(1, int(bucket_cap_mb * MIB))


def _check_tensors(tensors: Sequence[Tensor], symmetric: bool) -> None:
    if isinstance(tensors, Tensor):
        raise TypeError("pass a list of tensors, not a single tensor")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"item {i} is a {type(t).__name__}, expected a torch.Tensor")
    if symmetric:
        check_symmetric_shapes(tensors)


def tensor_nbytes(tensors: Sequence[Tensor]) -> int:
    """Total bytes of ``tensors`` (``numel * element_size``); handy for cost models."""
    return sum(t.numel() * t.element_size() for t in tensors)


__all__ = ["BucketedCommunicator", "Communicator", "Group", "ReduceOp", "tensor_nbytes"]
