"""The ranks of a data-parallel run as a ``data × samples`` grid, and how their random draws are seeded.

A world of ``W`` ranks with ``mc_parallel = R`` sample groups is a grid of ``D = W / R``
data ranks × ``R`` sample groups, laid out sample group by sample group::

    W = 4, R = 2  ->  D = 2         data rank   0   1
                      sample group 0: ranks     0   1
                      sample group 1: ranks     2   3

``data_rank = rank % D`` and ``sample_group = rank // D``. Ranks with the same data rank
read the same shard of the mini-batch (give the sampler ``num_replicas=D, rank=data_rank``);
ranks in different sample groups draw different weight samples of it. Gradients and
curvature are averaged over the whole grid, so the grid equals one process that runs
``R·m`` weight samples (``m = num_mc_samples`` per rank) on the whole batch.

Seeding (exact and reproducible from one seed): the noise of *global* sample ``s`` at step
``t`` colours one standard normal over all covered parameters, drawn from a ``torch.Generator``
seeded with ``noise_seed(seed, t, s)`` (a hash); each block colours its slice
(:func:`noise_spans`). Rank ``(d, k)`` draws the samples
``s = k·m, …, k·m + m − 1``; one process with ``num_mc_samples = R·m`` draws ``s = 0 … R·m − 1``
with the same seeds, hence the same noise. Data ranks of one sample group draw identical
noise (they evaluate the same weights on different shards). Label sampling (``fisher_mc``)
uses the optimizer's ``generator``, seeded per rank with :func:`rank_seed` so that ranks
draw independent labels.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch
from torch import nn

_MASK = (1 << 63) - 1


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (BLAKE2b of their decimal form; platform independent)."""
    text = ",".join(str(int(p)) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & _MASK


def noise_seed(seed: int, step: int, sample: int) -> int:
    """Seed of the weight noise of global MC sample ``sample`` at ``step`` (one standard normal over
    all covered parameters, see :func:`noise_spans`)."""
    return mix_seed(seed, 0x5EED, step, sample)


def noise_spans(layouts: Dict[str, Any]) -> Tuple[Dict[str, Tuple[int, int]], int]:
    """``({name: (offset, numel)}, P)``: where each block's parameters sit in a draw over all ``P``
    covered parameters — the blocks one after another in ``layouts``' order."""
    spans: Dict[str, Tuple[int, int]] = {}
    offset = 0
    for name, lay in layouts.items():
        spans[name] = (offset, lay.numel)
        offset += lay.numel
    return spans, offset


class NoiseStreams:
    """One generator per device, re-seeded with :func:`noise_seed` for every (step, sample)
    draw: the same numbers as a fresh generator with that seed (``manual_seed`` resets the whole
    state), without allocating a generator per block and step."""

    def __init__(self) -> None:
        self._generators: Dict[str, torch.Generator] = {}

    def seeded(self, seed: int, device: Any = "cpu") -> torch.Generator:
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = self._generators[key] = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen


def rank_seed(seed: int, rank: int) -> int:
    """Seed of a rank's own stream (label sampling): ``seed`` itself on rank 0, a hash elsewhere."""
    return int(seed) if rank == 0 else mix_seed(seed, 0x1ABE1, rank)


@dataclass(frozen=True)
class SampleGrid:
    """``world_size`` ranks as ``data_size × mc_parallel`` (see the module docstring)."""

    world_size: int
    mc_parallel: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.mc_parallel, bool) or not isinstance(self.mc_parallel, int) or self.mc_parallel < 1:
            raise ValueError(f"mc_parallel={self.mc_parallel!r} is invalid; expected an int >= 1")
        if self.world_size % self.mc_parallel != 0:
            raise ValueError(f"mc_parallel={self.mc_parallel} must divide the world size {self.world_size} "
                             "(the ranks form a data × sample grid)")

    @property
    def data_size(self) -> int:
        """Number of data-parallel shards ``D = W / R``."""
        return self.world_size // self.mc_parallel

    def data_rank(self, rank: int) -> int:
        """Which shard ``rank`` reads."""
        return rank % self.data_size

    def sample_group(self, rank: int) -> int:
        """Which sample group ``rank`` belongs to."""
        return rank // self.data_size

    def samples(self, rank: int, per_rank: int) -> Tuple[int, ...]:
        """Global MC sample indices drawn by ``rank`` when each rank draws ``per_rank``."""
        k = self.sample_group(rank)
        return tuple(range(k * per_rank, (k + 1) * per_rank))


def agree_on_start(comm: Any, model: nn.Module, seed: int) -> int:
    """Make every rank start equal: broadcast rank 0's parameters, buffers and ``seed``.

    Like ``DistributedDataParallel`` at construction. Returns rank 0's seed. With one rank,
    nothing happens.
    """
    if comm.world_size <= 1:
        return int(seed)
    state = [t.data for t in model.parameters()] + list(model.buffers())
    dev = state[0].device if state else torch.device("cpu")
    box = torch.tensor([int(seed)], dtype=torch.int64, device=dev)
    comm.broadcast(state + [box], src=0)
    return int(box.item())
