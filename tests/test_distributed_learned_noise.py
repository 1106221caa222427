"""``VIOptimizer(loss="mse", noise_variance="learned")`` with real processes.

W ranks on W equal shards (gloo with 2 and 4 ranks, ``mpiexec -n 2``) learn the same ``σ²``
trajectory and take the same steps as ONE process on the whole batch (float64, tight tolerance),
also with ``mc_parallel=2`` (the ranks of a shard draw different weight samples: one process with
twice the samples); every rank holds the same ``σ²``, and a checkpoint keeps it. The same holds
for ``curvature="reparam"`` (IVON's ĥ from each rank's shard gradient, averaged over the ranks
like the other curvature kinds) with ``grad_worker_fraction="comm_opt"``, learned or given ``σ²``,
and it is the default curvature of ``approx="diag"`` there as on one process.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

SCRIPTS = Path(__file__).parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))

import learned_noise_common as common  # noqa: E402

from torchsso2.distributed import LocalCommunicator  # noqa: E402
from dist_utils import mpi_env, require_mpiexec, run_gloo_ranks  # noqa: E402

DEADLINE_S = 150.0
RTOL = 1e-9  # float64; the only differences come from the order of the sums


@pytest.fixture(scope="module")
def reference() -> Dict[str, Dict[str, Any]]:
    return {name: common.train(cfg, LocalCommunicator(), single=True) for name, cfg in common.CONFIGS.items()}


def _gloo(world_size: int, out: Path) -> List[Dict[str, Any]]:
    codes = run_gloo_ranks(common, world_size, out, DEADLINE_S)
    assert codes == [0] * world_size, f"gloo ranks exited with {codes} (None: killed)"
    return [torch.load(out / f"torch_rank{r}.pt") for r in range(world_size)]


@pytest.fixture(scope="module")
def gloo2(tmp_path_factory):
    return _gloo(2, tmp_path_factory.mktemp("noise_gloo2"))


@pytest.fixture(scope="module")
def gloo4(tmp_path_factory):
    return _gloo(4, tmp_path_factory.mktemp("noise_gloo4"))


@pytest.fixture(scope="module")
def mpi2(tmp_path_factory):
    mpiexec = require_mpiexec()
    out = tmp_path_factory.mktemp("noise_mpi2")
    cmd = [mpiexec, "-n", "2", sys.executable, str(SCRIPTS / "learned_noise_common.py"), str(out)]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=DEADLINE_S)
    missing = [r for r in range(2) if not (out / f"mpi_rank{r}.pt").exists()]
    assert not missing, f"mpiexec ({proc.returncode}) left no results for ranks {missing}:\n{proc.stdout}\n{proc.stderr}"
    return [torch.load(out / f"mpi_rank{r}.pt") for r in range(2)]


def test_the_reference_learns_a_sigma2_far_from_one(reference):
    for name, ref in reference.items():
        assert ref["skipped"] == 0, name
        if common.CONFIGS[name].get("noise_variance", "learned") != "learned":
            assert ref["sigma2"].tolist() == [common.CONFIGS[name]["noise_variance"]] * common.STEPS
            continue
        assert not torch.allclose(ref["sigma2"], torch.ones_like(ref["sigma2"]), rtol=0.1), (name, ref["sigma2"])
        assert len(set(ref["sigma2"].tolist())) == common.STEPS, (name, ref["sigma2"])  # it moves every step


@pytest.mark.parametrize("job", ["gloo2", "gloo4", "mpi2"])
def test_ranks_on_shards_learn_the_sigma2_and_steps_of_one_process(job, reference, request):
    ranks = request.getfixturevalue(job)
    names = set(common.configs(len(ranks)))
    assert {"diag", "diag-mc2", "diag-reparam", "diag-reparam-given", "diag-default"} <= names
    # the default curvature of approx="diag" is IVON's estimator on one process and on several alike
    assert reference["diag-default"]["reparam"] and all(res["diag-default"]["reparam"] for res in ranks), job
    for r, res in enumerate(ranks):  # reparam with fewer grad workers than ranks: still refused, with a reason
        assert "grad_worker_fraction='comm_opt'" in res["mem_opt_reparam_error"], (job, r)
        assert res["mem_opt_default_reparam"] is False, (job, r)  # the default falls back to "fisher_mc" there
    for name in names:
        ref = reference[name]
        for r, res in enumerate(ranks):
            got = res[name]
            assert got["skipped"] == 0, (job, name, r)
            torch.testing.assert_close(got["sigma2"], ref["sigma2"], rtol=RTOL, atol=0.0, msg=f"{job} {name} rank {r} σ²")
            torch.testing.assert_close(got["params"], ref["params"], rtol=RTOL, atol=1e-12,
                                       msg=f"{job} {name} rank {r} parameters")
            # every rank holds the same σ², bit for bit, and a checkpoint keeps it
            assert got["sigma2"].tolist() == ranks[0][name]["sigma2"].tolist(), (job, name, r)
            assert got["reloaded_sigma2"] == got["sigma2"][-1].item(), (job, name, r)


def test_one_shard_alone_learns_another_sigma2(reference):
    """The check above can fail: a rank that averaged only its own residuals would learn this σ²."""
    x, y = common.whole_batch(0)
    sigma2 = common.first_sigma2(common.build(), LocalCommunicator(), x[:common.BATCH // 2], y[:common.BATCH // 2])
    assert abs(sigma2 - reference["diag"]["sigma2"][0].item()) > 1e-3 * reference["diag"]["sigma2"][0].item()


@pytest.mark.parametrize("job", ["gloo2", "mpi2"])
def test_unequal_shards_count_equally(job, request):
    """As in the gradient average, every rank's mean counts once: the first σ² of 2 ranks on 8 and
    16 examples is the mean of the two shards' own first σ², not the mean over the 24 examples."""
    ranks = request.getfixturevalue(job)
    x, y = common.whole_batch(0)
    k = common.UNEQUAL_SPLIT
    alone = [common.first_sigma2(common.build(), LocalCommunicator(), x[:k], y[:k]),
             common.first_sigma2(common.build(), LocalCommunicator(), x[k:], y[k:])]
    whole = common.first_sigma2(common.build(), LocalCommunicator(), x, y)
    expected = sum(alone) / 2
    assert abs(expected - whole) > 1e-3 * whole  # the two definitions differ on this batch
    for r, res in enumerate(ranks):
        assert res["unequal_first_sigma2"] == pytest.approx(expected, rel=1e-12), (job, r)
