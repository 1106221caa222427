"""A checkpoint saved on one rank and loaded on every rank (``mpiexec -n 2``; an audit found VI's
first resumed step drawing the isotropic start's noise, and every rank replaying rank 0's labels).

* VIOptimizer resumes exactly as the uninterrupted run (K-FAC and diag under COMM_OPT, K-FAC under
  MEM_OPT with decompositions every step: the missing ones are redone before the noise is drawn);
* the ranks' fisher_mc label streams stay different after the load (independent draws);
* each rank loading its own checkpoint (one file per rank) resumes exactly, fisher_mc's labels included.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_utils import mpi_rank_results  # noqa: E402

SCRIPT = Path(__file__).parent / "dist_scripts" / "resume_worker.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory):
    return mpi_rank_results(SCRIPT, tmp_path_factory.mktemp("resume"))


@pytest.mark.parametrize("config", ["vi-kfac", "vi-diag", "vi-kfac-mem"])
def test_vi_resumes_exactly_on_several_ranks(ranks, config: str) -> None:
    for rank in ranks:
        resumed, straight, _ = rank[config]
        torch.testing.assert_close(resumed, straight, rtol=0, atol=0)


def test_label_streams_stay_independent_after_a_load(ranks) -> None:
    assert not torch.equal(ranks[0]["sso-mc"][2], ranks[1]["sso-mc"][2])
    torch.testing.assert_close(ranks[0]["sso-mc"][0], ranks[1]["sso-mc"][0], rtol=0, atol=0)  # replicas agree


@pytest.mark.parametrize("config", ["sso-mc", "vi-kfac-mc", "vi-kfac", "vi-diag", "vi-kfac-mem"])
def test_each_ranks_own_checkpoint_resumes_exactly(ranks, config: str) -> None:
    """The checkpoint records the rank whose label stream it holds: a rank loading its own continues it."""
    for rank in ranks:
        resumed, straight, _ = rank[config + "-own"]
        torch.testing.assert_close(resumed, straight, rtol=0, atol=0)


def test_rank_zeros_checkpoint_on_every_rank_is_not_exact_for_monte_carlo_labels(ranks) -> None:
    """(What the docs say: rank 1 draws new labels from rank 0's stream, the same distribution.)"""
    assert not torch.equal(ranks[1]["sso-mc"][0], ranks[1]["sso-mc"][1])
