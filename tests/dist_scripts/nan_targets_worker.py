"""Worker of tests/test_curvature_errors.py: NaN targets on one rank only, a masked loss, the empirical Fisher given
targets. ``python nan_targets_worker.py OUT_DIR`` under ``mpiexec -n 2``: each rank writes whether its step raised
ValueError (and the message's start) to ``OUT_DIR/rank<r>.pt``."""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))  # tests/: optim_helpers

import torch  # noqa: E402
from torch import nn  # noqa: E402

from torchsso2 import SecondOrderOptimizer  # noqa: E402
from torchsso2.distributed import get_communicator  # noqa: E402
from optim_helpers import masked_mse  # noqa: E402


def main() -> None:
    rank = get_communicator().rank
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = SecondOrderOptimizer(model, loss="mse", curvature="empirical_fisher", approx="diag", damping=1.0)
    gen = torch.Generator().manual_seed(rank)
    x, z = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
    if rank == 0:
        z[::3, 1] = float("nan")

    def closure():
        opt.zero_grad()
        loss = masked_mse(model(x), z)
        loss.backward()
        return loss
    result = {"raised": False, "message": ""}
    try:
        opt.step(closure, targets=z)
    except ValueError as err:
        result = {"raised": True, "message": str(err)[:200]}
    result["skipped"] = opt.num_skipped
    torch.save(result, os.path.join(sys.argv[1], f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
