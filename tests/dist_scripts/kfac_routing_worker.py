"""Ranks routed through different registered layers, for tests/test_kfac_routing.py.

A trunk and three same-shaped heads; at each step each rank sends its shard through the head of
``ROUTE[step][rank]`` (a multi-task model under ``DistributedDataParallel(find_unused_parameters=True)``),
so some heads are used on one rank only, one of them first used on one rank only. The preconditioned
gradients must be identical on every rank and equal to one process that feeds the ranks' shards,
each through its head, as accumulated micro-batches.

gloo: ``main(rank, world_size, init_file, out_dir)`` (tests/dist_utils.run_gloo_ranks), model in DDP;
MPI: ``mpiexec -n 2 python kfac_routing_worker.py OUT_DIR``, gradients averaged with the communicator.
"""
from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from torchsso2.kfac import DistributedStrategy, KFACPreconditioner  # noqa: E402

DT = torch.float64
SHARD = 5
#: ROUTE[step][rank]: the heads rank ``rank`` sends its shard through at ``step``, in turn ("c" is first used
#: by rank 1 alone, at step 1; at step 4 rank 0 calls "a" twice, rank 1 once: a count-weighted mean)
ROUTE = [("a", "b"), ("a", "c"), ("b", "b"), ("c", "a"), ("aa", "ab")]
BASE = dict(damping=0.01, lr=0.1, kl_clip=0.01, factor_decay=0.9, inv_dtype=DT)
CONFIGS: Dict[str, Dict[str, Any]] = {
    "comm_opt-eigen": dict(grad_worker_fraction=DistributedStrategy.COMM_OPT),
    "mem_opt-inverse-sym": dict(grad_worker_fraction=DistributedStrategy.MEM_OPT, compute_method="inverse",
                                symmetry_aware=True),
    "comm_opt-nobucket-step-update": dict(grad_worker_fraction=DistributedStrategy.COMM_OPT,
                                          allreduce_bucket_cap_mb=0, update_factors_in_hook=False),
}


class MultiHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 6)
        self.heads = nn.ModuleDict({k: nn.Linear(6, 3) for k in "abc"})

    def forward(self, x: Tensor, heads: str) -> Tensor:
        """The mean of the outputs of ``heads`` (one letter each, in turn; a letter twice: the head called twice)."""
        h = torch.tanh(self.trunk(x))
        return sum(self.heads[k](h) for k in heads) / len(heads)


def build() -> nn.Module:
    torch.manual_seed(0)
    return MultiHead().to(DT)


def shard(step: int, rank: int) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(104729 * step + rank)
    return torch.randn(SHARD, 4, generator=g, dtype=DT), torch.randint(0, 3, (SHARD,), generator=g)


def flat_grads(model: nn.Module) -> Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()]).clone()


def train(model: nn.Module, pre: KFACPreconditioner, micro_batches: Callable[[int], List[Tuple[Tensor, Tensor, str]]],
          average: Optional[Callable[[nn.Module], None]] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """``len(ROUTE)`` steps; the preconditioned gradients ``[steps, P]`` and the final factors."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = []
    for step in range(len(ROUTE)):
        opt.zero_grad()
        batches = micro_batches(step)
        for x, y, head in batches:
            F.cross_entropy(model(x, head), y).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= len(batches)
        if average is not None:
            average(model)
        pre.step()
        rows.append(flat_grads(model))
        opt.step()
    factors = {name.replace("module.", "", 1) + f".{k}": f.clone()
               for name, layer in pre.layers.items() if layer.has_factors()
               for k, f in zip("AG", layer.factors())}
    return torch.stack(rows), factors


def run_rank(comm: Any, wrap: Callable[[nn.Module], nn.Module],
             average: Optional[Callable[[nn.Module], None]] = None) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    for name, cfg in CONFIGS.items():
        model = build()
        wrapped = wrap(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pre = KFACPreconditioner(wrapped, communicator=comm, **{**BASE, **cfg})
            grads, factors = train(wrapped, pre, lambda s: [shard(s, comm.rank) + (ROUTE[s][comm.rank],)], average)
        results[name] = dict(grads=grads, factors=factors, warnings=[str(w.message) for w in caught])
    return results


def single_process(name: str) -> Tuple[Tensor, Dict[str, Tensor]]:
    """One process feeding the ranks' shards, each through its rank's head, as accumulated micro-batches."""
    from torchsso2.distributed import LocalCommunicator

    world = len(ROUTE[0])
    model = build()
    pre = KFACPreconditioner(model, communicator=LocalCommunicator(), accumulation_steps=world,
                             **{**BASE, **CONFIGS[name]})
    return train(model, pre, lambda s: [shard(s, r) + (ROUTE[s][r],) for r in range(world)])


def main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """gloo rank: the model in DDP(find_unused_parameters=True)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        from torchsso2.distributed import get_communicator

        results = run_rank(get_communicator("auto"), lambda m: DDP(m, find_unused_parameters=True))
        torch.save(results, os.path.join(out_dir, f"torch_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def mpi_main(out_dir: str) -> None:
    """MPI rank: the gradients averaged with ``average_gradients`` (a head unused here contributes zeros, as under
    DDP; one no rank used keeps grad None)."""
    from torchsso2.distributed import MPICommunicator, average_gradients, get_communicator, install_abort_on_exception

    torch.set_num_threads(1)
    comm = get_communicator("auto")
    assert isinstance(comm, MPICommunicator), comm
    install_abort_on_exception(comm)

    def average(model: nn.Module) -> None:
        average_gradients(model.parameters(), comm)  # (the DDP-like mean: zeros where a head got no gradient)

    torch.save(run_rank(comm, lambda m: m, average), os.path.join(out_dir, f"mpi_rank{comm.rank}.pt"))


if __name__ == "__main__":
    mpi_main(sys.argv[1])
