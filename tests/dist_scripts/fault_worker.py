"""A training script whose rank 1 fails, for tests/test_distributed_faults.py.

Run as ``mpiexec -n 2 python fault_worker.py FACE MODE`` (optionally ``python -m mpi4py``) or
``torchrun --nproc_per_node=2 fault_worker.py FACE MODE``. It trains a tiny MLP with
``FACE`` (``sso``: SecondOrderOptimizer, ``vi``: VIOptimizer, ``kfac``: KFACPreconditioner +
SGD), every face with its default ``communicator="auto"``; under MPI the script imports
``mpi4py`` itself first, as user scripts do (except in ``preinit`` mode). Rank 1 then:

  raise     raises ``RuntimeError("rank 1 fails on purpose")`` after step 1
  exit      calls ``sys.exit(3)`` after step 1
  hang      sleeps for 600 s after step 1
  preinit   calls ``sys.exit(3)`` before anything initializes MPI / torch.distributed
  mismatch  builds the optimizer with a different schedule (factor_update_steps /
            curv_update_interval = 2 instead of 1)
  freeze    freezes the first layer (requires_grad_(False)) after the optimizer is built, the
            other rank does not
  ok        nothing (the job must end normally)

Every rank prints ``rank R done`` when it finishes its 4 steps.
"""

from __future__ import annotations

import os
import sys
import time

FACE, MODE = sys.argv[1], sys.argv[2]
RANK = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0"))))
UNDER_MPI = "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ

if MODE == "preinit" and RANK == 1:
    sys.exit(3)
if UNDER_MPI and MODE != "preinit":
    from mpi4py import MPI  # noqa: F401  - the script initializes MPI itself

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from torchsso2 import SecondOrderOptimizer, VIOptimizer  # noqa: E402
from torchsso2.kfac import KFACPreconditioner  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    other = MODE == "mismatch" and RANK == 1
    if FACE == "sso":
        opt = SecondOrderOptimizer(model, lr=0.01, curv_update_interval=2 if other else 1)
    elif FACE == "vi":
        opt = VIOptimizer(model, dataset_size=64, curv_update_interval=2 if other else 1)
    elif FACE == "kfac":
        kfac = KFACPreconditioner(model, factor_update_steps=2 if other else 1, inv_update_steps=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        raise ValueError(f"unknown face {FACE!r}")
    if MODE == "freeze" and RANK == 1:
        model[0].requires_grad_(False)
    gen = torch.Generator().manual_seed(RANK)
    for step in range(4):
        x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)

        def closure() -> tuple:
            opt.zero_grad()
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            loss.backward()
            return loss, out

        if FACE == "kfac":
            closure()
            kfac.step()
            opt.step()
        else:
            opt.step(closure)
        if step == 1 and RANK == 1:
            if MODE == "raise":
                raise RuntimeError("rank 1 fails on purpose")
            if MODE == "exit":
                sys.exit(3)
            if MODE == "hang":
                time.sleep(600)
    print(f"rank {RANK} done", flush=True)


if __name__ == "__main__":
    main()
