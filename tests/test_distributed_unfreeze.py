"""Several ranks (``mpiexec -n 2``): a layer unfrozen after the first step joins the work assignment
(it raised 'blocks ['0'] were not in the work assignment' on every rank), and predict() on one rank
after loading a checkpoint under other posterior settings takes no collectives (it paired with the
other rank's barrier and aborted the job). A failed decomposition at the step the layer joins skips it
with the old assignment (one rank raised, the other hung in a broadcast). The replicas stay
bit-identical."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_utils import mpi_rank_results  # noqa: E402

SCRIPT = Path(__file__).parent / "dist_scripts" / "unfreeze_worker.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory):
    return mpi_rank_results(SCRIPT, tmp_path_factory.mktemp("unfreeze"))


@pytest.mark.parametrize("config", ["vi-diag", "vi-kfac", "sso-kfac-mem", "sso-fail-mem_opt", "sso-fail-comm_opt"])
def test_a_layer_unfrozen_later_is_covered_on_every_rank(ranks, config: str) -> None:
    (p0, blocks0), (p1, blocks1) = ranks[0][config], ranks[1][config]
    assert blocks0 == blocks1 == ["0", "2"]
    torch.testing.assert_close(p0, p1, rtol=0, atol=0)


def test_predict_on_one_rank_after_a_load_takes_no_collectives(ranks) -> None:
    torch.testing.assert_close(ranks[0]["vi-load-predict"][0], ranks[1]["vi-load-predict"][0], rtol=0, atol=0)
