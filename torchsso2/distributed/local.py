"""The one-process communicator: every collective is a no-op."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from torchsso2.distributed.communicator import BucketedCommunicator


class LocalCommunicator(BucketedCommunicator):
    """World of one rank (rank 0). Collectives check their arguments and change nothing.

    ``allreduce`` leaves every value as it is (the mean or sum over one rank),
    ``broadcast`` accepts only ``src=0``, ``new_group`` accepts only ``[0]`` and
    :attr:`bytes_sent` stays 0 because nothing is sent.
    """

    def __init__(self) -> None:
        super().__init__(rank=0, world_size=1)

    def barrier(self) -> None:
        """Nothing to wait for."""

    def _allreduce_sum_(self, buffer: Tensor) -> int:  # pragma: no cover - never reached
        return 0

    def _broadcast_(self, buffer: Tensor, src: int, members: tuple[int, ...], handle: Any) -> int:  # pragma: no cover
        return 0

    def _make_group_handle(self, ranks: tuple[int, ...]) -> Any:  # pragma: no cover - [0] is the world
        return None

    def __repr__(self) -> str:
        return "LocalCommunicator(rank=0, world_size=1)"
