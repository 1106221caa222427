"""Shared by tests/test_distributed_learned_noise.py and its workers: ``VIOptimizer(loss="mse",
noise_variance="learned")`` (and ``curvature="reparam"``) on a tiny float64 regression MLP, one
process vs several.

Every rank trains for ``STEPS`` steps on its shard of a fixed global batch under each configuration of
:data:`CONFIGS` and records, after every step, the flat parameters and the learned ``σ²``; then it
saves a checkpoint, loads it into a fresh optimizer and records that optimizer's ``σ²``. The test
compares the records with ONE process on the whole batch (``num_mc_samples = mc_parallel·m``).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from torchsso2.optim import VIOptimizer  # noqa: E402

STEPS = 4
BATCH = 24  # the global batch; D data ranks read BATCH / D examples each
DT = torch.float64
BASE = dict(dataset_size=240, lr=0.1, momentum=0.9, curvature="fisher", prior_precision=1.0, init_precision=100.0,
            ema_decay=0.9, loss="mse", noise_variance="learned", seed=5)

#: name -> optimizer kwargs (``mc_parallel`` R: the world is W/R data ranks × R sample groups)
CONFIGS: Dict[str, Dict[str, Any]] = {
    "diag": dict(approx="diag"),
    "kfac-2samples": dict(approx="kfac", num_mc_samples=2),
    "diag-reparam": dict(approx="diag", curvature="reparam", curvature_init=1.0),
    "diag-reparam-mc2": dict(approx="diag", curvature="reparam", curvature_init=1.0, mc_parallel=2),
    "diag-reparam-given": dict(approx="diag", curvature="reparam", curvature_init=1.0, noise_variance=0.5),
    # the default curvature (None): "reparam" for diag, on one process and on several alike
    "diag-default": dict(approx="diag", curvature=None, curvature_init=1.0),
    "diag-mc2": dict(approx="diag", mc_parallel=2),
    "full-mc2": dict(approx="full", mc_parallel=2),
}


def configs(world_size: int) -> Dict[str, Dict[str, Any]]:
    """The configurations that fit ``world_size`` ranks (``mc_parallel`` must divide it)."""
    return {k: v for k, v in CONFIGS.items() if world_size % v.get("mc_parallel", 1) == 0}


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(DT)


def whole_batch(step: int):
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(BATCH, 3, generator=g, dtype=DT)
    y = (x[:, :1].sin() + 0.3 * torch.randn(BATCH, 1, generator=g, dtype=DT)) * 2.0  # σ² far from 1
    return x, y


def make(cfg: Dict[str, Any], model: nn.Module, comm: Any, single: bool) -> VIOptimizer:
    kw = dict(cfg)
    if single:
        kw["num_mc_samples"] = kw.get("num_mc_samples", 1) * kw.pop("mc_parallel", 1)
    return VIOptimizer(model, communicator=comm, **{**BASE, **kw})


def mse_closure(opt: VIOptimizer, model: nn.Module, x: Tensor, y: Tensor):
    """The closure of one step: ``½‖f(x) − y‖²`` averaged over the examples, returning ``(loss, output)``."""
    def closure():
        opt.zero_grad()
        out = model(x)
        loss = 0.5 * (out - y).pow(2).sum(-1).mean()
        loss.backward()
        return loss, out
    return closure


def flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def train(cfg: Dict[str, Any], comm: Any, single: bool = False) -> Dict[str, Any]:
    """``STEPS`` steps; ``params [STEPS, P]``, ``sigma2 [STEPS]`` and the ``σ²`` after a checkpoint round trip."""
    model = build()
    opt = make(cfg, model, comm, single)
    rows, sigma2 = [], []
    for step in range(STEPS):
        x, y = whole_batch(step)
        if not single:
            d, r = opt.data_parallel_size, opt.data_parallel_rank
            n = BATCH // d
            x, y = x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]
        opt.step(mse_closure(opt, model, x, y), targets=y)
        rows.append(flat(model))
        sigma2.append(opt.noise.variance)
    fresh = make(cfg, build(), comm, single)
    fresh.load_state_dict(opt.state_dict())
    return dict(params=torch.stack(rows), sigma2=torch.tensor(sigma2, dtype=DT), skipped=opt.num_skipped,
                reloaded_sigma2=fresh.noise.variance, reparam=opt.reparam)


#: unequal shards (2 ranks): rank 0 reads the first UNEQUAL_SPLIT examples, rank 1 the rest
UNEQUAL_SPLIT = 8


def first_sigma2(model: nn.Module, comm: Any, x: Tensor, y: Tensor) -> float:
    """The learned ``σ²`` after one step on ``(x, y)`` (approx="diag"): that step's mean squared residual."""
    opt = VIOptimizer(model, communicator=comm, **{**BASE, "approx": "diag"})
    opt.step(mse_closure(opt, model, x, y), targets=y)
    return opt.noise.variance


def run_rank(comm: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {name: train(cfg, comm) for name, cfg in configs(comm.world_size).items()}
    if comm.world_size == 2:
        x, y = whole_batch(0)
        part = slice(0, UNEQUAL_SPLIT) if comm.rank == 0 else slice(UNEQUAL_SPLIT, BATCH)
        out["unequal_first_sigma2"] = first_sigma2(build(), comm, x[part], y[part])
    try:  # reparam needs every decomposition on every rank: refused with fewer grad workers than ranks
        VIOptimizer(build(), communicator=comm, **{**BASE, "approx": "diag", "curvature": "reparam",
                                                   "curvature_init": 1.0, "grad_worker_fraction": "mem_opt"})
        out["mem_opt_reparam_error"] = None
    except NotImplementedError as err:
        out["mem_opt_reparam_error"] = str(err)
    # ... while the default curvature falls back to "fisher_mc" there
    out["mem_opt_default_reparam"] = VIOptimizer(build(), communicator=comm, **{
        **BASE, "approx": "diag", "curvature": None, "curvature_init": 1.0, "grad_worker_fraction": "mem_opt"}).reparam
    return out


def main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """A gloo rank (``file://`` init); saves ``torch_rank{r}.pt``."""
    from datetime import timedelta

    import torch.distributed as dist

    from torchsso2.distributed import get_communicator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=30))
    results = run_rank(get_communicator("auto", timeout=30))
    torch.save(results, os.path.join(out_dir, f"torch_rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":  # mpiexec -n W python learned_noise_common.py OUT_DIR
    from torchsso2.distributed import MPICommunicator, get_communicator, install_abort_on_exception

    torch.set_num_threads(1)
    comm = get_communicator("auto")
    assert isinstance(comm, MPICommunicator), comm
    install_abort_on_exception(comm)
    torch.save(run_rank(comm), os.path.join(sys.argv[1], f"mpi_rank{comm.rank}.pt"))
