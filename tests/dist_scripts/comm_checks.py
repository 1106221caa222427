"""Collective checks run by every rank, under any backend; results saved for the test to judge.

Used by ``torch_worker.py`` (spawned with torch.multiprocessing) and ``mpi_worker.py``
(launched with mpiexec). Inputs are deterministic functions of ``(rank, index)`` so the test
process can rebuild every rank's inputs and compute the expected results locally.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from torchsso2.distributed import Communicator, DistributedStrategy, Group, WorkAssignment
from torchsso2.distributed.bucketing import plan_buckets

TINY_CAP_MB = 600 / (1 << 20)  # 600 bytes: many buckets for the tensors below
SHAPES: list[tuple[int, ...]] = [(3,), (7, 5), (1,), (40,), (4, 4, 2), (200,), (9,), (2, 3), (13, 11), (6,)]
SYM_SIZES: list[int] = [1, 3, 8, 17, 5]


def make_tensors(rank: int) -> list[torch.Tensor]:
    """Mixed float64 / float32 tensors, one list per rank (a few hundred bytes each)."""
    out = []
    for i, shape in enumerate(SHAPES):
        g = torch.Generator().manual_seed(1000 * rank + i)
        dtype = torch.float64 if i % 3 else torch.float32
        out.append(torch.randn(shape, generator=g, dtype=torch.float64).to(dtype))
    return out


def make_symmetric(rank: int, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """Exactly symmetric ``[n, n]`` matrices of sizes ``SYM_SIZES``."""
    out = []
    for i, n in enumerate(SYM_SIZES):
        g = torch.Generator().manual_seed(5000 + 1000 * rank + i)
        x = torch.randn(n, n, generator=g, dtype=torch.float64)
        # elementwise only (no BLAS): bitwise reproducible in every process; exactly symmetric
        out.append(((x + x.T) / 2 + n * torch.eye(n, dtype=torch.float64)).to(dtype))
    return out


def subgroups_for(world_size: int) -> list[list[int]]:
    """Subgroups exercised by the broadcast check (created in this order on every rank)."""
    if world_size == 2:
        return [[0], [1], [0, 1]]
    return [[0, 1], [2, 3], [0, 2], [1, 3], [1, 2, 3], [3]]


def run_checks(comm: Communicator, out_dir: str, tag: str) -> None:
    """Run every collective check and ``torch.save`` the results to ``out_dir``."""
    rank, world = comm.rank, comm.world_size
    res: dict[str, Any] = {"rank": rank, "world_size": world, "type": type(comm).__name__}

    for op in ("mean", "sum"):
        tensors = make_tensors(rank)
        comm.reset_counters()
        comm.allreduce(tensors, op=op, bucket_cap_mb=TINY_CAP_MB)
        res[f"allreduce_{op}"] = tensors
        res[f"allreduce_{op}_bytes"] = comm.bytes_sent
        res[f"allreduce_{op}_collectives"] = comm.num_collectives
        res["expected_buckets"] = len(plan_buckets(make_tensors(rank), int(TINY_CAP_MB * (1 << 20))))

    # default cap: a single bucket per dtype
    tensors = make_tensors(rank)
    comm.reset_counters()
    comm.allreduce(tensors)
    res["allreduce_default"] = tensors
    res["allreduce_default_collectives"] = comm.num_collectives

    # symmetric mode vs full mode
    for dtype in (torch.float64, torch.float32):
        name = str(dtype).split(".")[-1]
        full = make_symmetric(rank, dtype)
        comm.reset_counters()
        comm.allreduce(full, op="mean", bucket_cap_mb=TINY_CAP_MB)
        res[f"sym_full_{name}"] = full
        res[f"sym_full_{name}_bytes"] = comm.bytes_sent
        packed = make_symmetric(rank, dtype)
        comm.reset_counters()
        comm.allreduce(packed, op="mean", bucket_cap_mb=TINY_CAP_MB, symmetric=True)
        res[f"sym_packed_{name}"] = packed
        res[f"sym_packed_{name}_bytes"] = comm.bytes_sent

    # broadcast over the world from every source
    comm.reset_counters()
    for src in range(world):
        tensors = make_tensors(rank)
        comm.broadcast(tensors, src=src, bucket_cap_mb=TINY_CAP_MB)
        res[f"bcast_world_{src}"] = tensors
    res["bcast_world_bytes"] = comm.bytes_sent

    # symmetric broadcast
    tensors = make_symmetric(rank)
    comm.broadcast(tensors, src=world - 1, symmetric=True)
    res["bcast_sym"] = tensors

    # broadcast within subgroups; every rank loops over every group (non-members: no-op)
    groups: list[Group] = [comm.new_group(ranks) for ranks in subgroups_for(world)]
    for group in groups:
        for src in group.ranks:
            tensors = make_tensors(rank)
            comm.broadcast(tensors, src=src, group=group, bucket_cap_mb=TINY_CAP_MB)
            res[f"bcast_group_{'-'.join(map(str, group.ranks))}_src{src}"] = tensors

    res.update(kaisa_flow(comm))
    comm.barrier()
    torch.save(res, os.path.join(out_dir, f"{tag}_rank{rank}.pt"))


KAISA_SIZES: dict[str, dict[str, int]] = {
    "fc1": {"A": 6, "G": 4}, "fc2": {"A": 5, "G": 3}, "fc3": {"A": 3, "G": 2}, "conv": {"A": 7, "G": 2},
}


def kaisa_value(layer: str, factor: str, n: int) -> torch.Tensor:
    """The 'inverse' the inverse worker computes: a deterministic symmetric [n, n] matrix."""
    seed = sum(map(ord, layer + factor))
    x = torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (x + x.T) / 2 + n * torch.eye(n, dtype=torch.float64)  # exactly symmetric, no BLAS


def kaisa_gradient(inverses: dict[str, torch.Tensor]) -> torch.Tensor:
    """The 'preconditioned gradient' of a layer: G^-1-like @ grad @ A^-1-like, grad = ones."""
    a, g = inverses["A"], inverses["G"]
    return g @ torch.ones(g.shape[0], a.shape[0], dtype=torch.float64) @ a


def kaisa_flow(comm: Communicator) -> dict[str, Any]:
    """Drive a K-FAC step's communication from a WorkAssignment; every rank must end with
    every layer's gradient. Records per-strategy results and bytes sent."""
    out: dict[str, Any] = {}
    world = comm.world_size
    strategies = [DistributedStrategy.COMM_OPT, DistributedStrategy.MEM_OPT]
    if world >= 4:
        strategies.append(DistributedStrategy.HYBRID_OPT)
    for strategy in strategies:
        wa = WorkAssignment.from_sizes(KAISA_SIZES, world, strategy)
        groups = {ranks: comm.new_group(list(ranks)) for ranks in wa.communication_groups()}
        comm.reset_counters()
        grads = {}
        for layer in wa.layers:
            workers = tuple(wa.grad_workers(layer))
            inverses = {}
            for factor, n in KAISA_SIZES[layer].items():
                src = wa.inv_worker(layer, factor)
                inv = kaisa_value(layer, factor, n) if comm.rank == src else torch.zeros(n, n, dtype=torch.float64)
                if wa.broadcast_inverses() and comm.rank in workers:
                    comm.broadcast([inv], src=src, group=groups[workers], symmetric=True)
                inverses[factor] = inv
            n_a, n_g = KAISA_SIZES[layer]["A"], KAISA_SIZES[layer]["G"]
            if wa.is_grad_worker(comm.rank, layer):
                grad = kaisa_gradient(inverses)
            else:
                grad = torch.zeros(n_g, n_a, dtype=torch.float64)
            if wa.broadcast_gradients():
                for src, ranks in wa.grad_receivers(layer).items():
                    if comm.rank in ranks and len(ranks) > 1:
                        comm.broadcast([grad], src=src, group=groups[tuple(ranks)])
                        assert wa.src_grad_worker(comm.rank, layer) == src
            grads[layer] = grad
        out[f"kaisa_{strategy.name}"] = grads
        out[f"kaisa_{strategy.name}_bytes"] = comm.bytes_sent
    return out
