"""SecondOrderOptimizer and VIOptimizer with real processes (issue #7).

Jobs (each runs every configuration of ``tests/dist_scripts/optim_common.py`` in one launch):
1 rank (in this process, a gloo group of one), 2 and 4 gloo ranks (``file://`` init, forkserver),
and ``mpiexec -n 2`` (skipped when mpi4py or mpiexec is missing). Checks:

(a) N ranks on N equal shards equal ONE process on the whole batch (float64, tight
    tolerance), for both optimizers, shapes full / diag / kfac, placements COMM_OPT,
    MEM_OPT, HYBRID_OPT and both assignment strategies;
(b) MC-sample parallel VI over R sample groups equals one process with
    ``num_mc_samples = R·m`` drawing the same samples;
(c) every rank ends with bit-identical parameters;
(d) the bytes each job sent follow the placement's cost model (docs/scaling.md), and
    mpiexec sends the same numbers and bytes as torch.distributed;
(e) a rank that raises makes the others fail within a bounded time: gloo raises on the
    surviving rank, MPI aborts the job (``install_abort_on_exception``).
"""
from __future__ import annotations

import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

SCRIPTS = Path(__file__).parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))

import optim_common as common  # noqa: E402
import optim_torch_worker  # noqa: E402

from torchsso2.distributed import LocalCommunicator  # noqa: E402
from torchsso2.distributed.assignment import grad_worker_count  # noqa: E402
from torchsso2.optim.grid import SampleGrid  # noqa: E402
from torchsso2.optim.placement import parse_grad_worker_fraction  # noqa: E402
from dist_utils import mpi_env, require_mpiexec, run_gloo_ranks  # noqa: E402

DEADLINE_S = 150.0
FAIL_BOUND_S = 45.0  # the surviving rank must have failed within this (gloo timeout: 30 s)
RTOL = 1e-9  # float64; the only differences come from the order of the sums


def _spawn(world_size: int, out_dir: Path) -> Dict[str, Any]:
    codes = run_gloo_ranks(optim_torch_worker, world_size, out_dir, DEADLINE_S)
    # rank 1 dies by the injected exception (exit code 1) after saving its results
    expected = [0] * world_size
    expected[1] = 1
    assert codes == expected, f"gloo ranks exited with {codes}, expected {expected} (None: killed)"
    return dict(results=[torch.load(out_dir / f"torch_rank{r}.pt") for r in range(world_size)],
                failure=torch.load(out_dir / "fail_rank0.pt"))




@pytest.fixture(scope="module")
def torch2(tmp_path_factory):
    return _spawn(2, tmp_path_factory.mktemp("optim_torch2"))


@pytest.fixture(scope="module")
def torch4(tmp_path_factory):
    return _spawn(4, tmp_path_factory.mktemp("optim_torch4"))


@pytest.fixture(scope="module")
def mpi2(tmp_path_factory):
    mpiexec = require_mpiexec()
    out = tmp_path_factory.mktemp("optim_mpi2")
    env = mpi_env()
    cmd = [mpiexec, "-n", "2", sys.executable, str(SCRIPTS / "optim_mpi_worker.py"), str(out), "fail"]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    elapsed = time.monotonic() - start
    missing = [r for r in range(2) if not (out / f"mpi_rank{r}.pt").exists()]
    assert not missing, f"mpiexec ({proc.returncode}) left no results for ranks {missing}:\n{proc.stdout}\n{proc.stderr}"
    return dict(results=[torch.load(out / f"mpi_rank{r}.pt") for r in range(2)], proc=proc, elapsed=elapsed)


@lru_cache(maxsize=None)
def _reference(world: int, name: str) -> Dict[str, Any]:
    """One process, whole batch (and all MC samples), LocalCommunicator."""
    return common.train(common.configs(world)[name], LocalCommunicator(), single=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _expected_bytes(world: int, name: str, res: Dict[str, Any]) -> int:
    """Payload bytes summed over all ranks for one configuration (cost model of docs/scaling.md)."""
    cfg = common.configs(world)[name]
    g = grad_worker_count(world, parse_grad_worker_fraction(cfg.get("grad_worker_fraction", "comm_opt")))
    grid = SampleGrid(world, cfg.get("mc_parallel", 1))
    m = cfg.get("num_mc_samples", 1)
    e, steps = 8, common.STEPS
    numel = sum(res["numel"].values())
    stat = 0  # all-reduced statistics per estimate: triangles of the matrices, whole diagonals
    dec = 0  # decomposition broadcast per decomposition (each block once, by its inverse worker)
    for shapes in res["stats"].values():
        stat += sum(s[0] * (s[0] + 1) // 2 if len(s) == 2 else s[0] for s in shapes)
        if len(shapes) == 1:  # full [P, P] -> evecs + denom; diag [P] -> denom
            p = shapes[0][0]
            dec += p * p + p if len(shapes[0]) == 2 else p
        else:  # kfac: ql, qr (2-D factors) + denom [n_L, n_R]
            dec += sum(s[0] * s[0] for s in shapes if len(s) == 2) + shapes[0][0] * shapes[1][0]
    tensors = len(list(common.build(cfg["face"]).parameters()))  # which parameters have a gradient, in the flag
    blocks = len(res["stats"])  # (every step estimates): which covered modules each rank called, in the flag
    kfac = sum(1 for shapes in res["stats"].values() if len(shapes) == 2)  # the rows of each K-FAC A
    # grads + flag (skip mark, the parameter count and size and their digest, the param groups' two settings digests, the
    # covered modules called, which parameters have a gradient), statistics (with K-FAC's rows), decomposition flag
    total = world * steps * ((numel + 6 + blocks + tensors) + stat + kfac + 1) * e
    if g > 1:
        total += steps * dec * e
    if g < world:  # each of the g grad workers of a block broadcasts to its receiver group
        total += steps * g * numel * e  # preconditioned gradients
        if cfg["face"] == "vi":  # weight noise of the samples the receivers need, from step 1 on
            receivers = [tuple(range(i, world, g)) for i in range(g)]
            needed = sum(len({grid.sample_group(r) for r in group}) * m for group in receivers)
            total += (steps - 1) * needed * numel * e
    if cfg.get("adaptive_damping"):
        interval = cfg["damping_adaptation_interval"]
        total += world * e * sum(1 for s in range(steps) if (s + 1) % interval == 0)
        if cfg["approx"] == "kfac" and cfg.get("kfac_method", "eigen") == "eigen" and world > 1:
            # each damping change re-damps the K-FAC eigen decompositions in place on every rank, and one flag
            # agrees that every rank's stayed positive (optim/redamp.py)
            d = res["dampings"]
            total += world * e * sum(1 for a, b in zip(d, d[1:]) if a != b)
    return total


def _check_job(results: List[Dict[str, Any]], world: int) -> None:
    for name in common.configs(world):
        # (c) bit-identical on every rank
        for r in range(1, world):
            assert torch.equal(results[r][name]["params"], results[0][name]["params"]), (name, r)
        # (a), (b) equal to one process on the whole batch
        ref = _reference(world, name)
        err = _rel(results[0][name]["params"], ref["params"])
        assert err < RTOL, (name, err)
        assert results[0][name]["skipped"] == ref["skipped"] == 0, name
        # (d) the cost model
        sent = sum(results[r][name]["bytes"] for r in range(world))
        assert sent == _expected_bytes(world, name, results[0][name]), (name, sent)
    # the optimizer moved the weights: the comparison is not trivial
    first = results[0][next(iter(common.configs(world)))]["params"]
    assert (first[-1] - first[0]).abs().max() > 1e-4


def test_one_rank_is_the_plain_optimizer(tmp_path):
    """A gloo world of one: no collective runs, and the result is the one-process run."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        from torchsso2.distributed import TorchCommunicator, get_communicator

        comm = get_communicator("auto")
        assert isinstance(comm, TorchCommunicator) and comm.world_size == 1
        for name in ("so-kfac-comm_opt", "vi-full-mem_opt", "so-diag-empirical"):
            res = common.train(common.configs(2)[name], comm)
            assert res["bytes"] == 0
            assert torch.equal(res["params"], _reference(2, name)["params"]), name
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_equal_one_process(torch2):
    _check_job(torch2["results"], 2)
    assert torch2["results"][0]["so-full-mem_opt"]["grad_workers"] == 1
    assert torch2["results"][0]["so-full-comm_opt"]["grad_workers"] == 2


def test_four_gloo_ranks_equal_one_process(torch4):
    _check_job(torch4["results"], 4)
    assert torch4["results"][0]["vi-kfac-mc2-hybrid"]["grad_workers"] == 2


def test_mpiexec_equals_torch_distributed(mpi2, torch2):
    _check_job(mpi2["results"], 2)
    for name in common.configs(2):
        assert torch.equal(mpi2["results"][0][name]["params"], torch2["results"][0][name]["params"]) or \
            _rel(mpi2["results"][0][name]["params"], torch2["results"][0][name]["params"]) < RTOL, name
        assert mpi2["results"][0][name]["bytes"] == torch2["results"][0][name]["bytes"], name


def test_failing_rank_stops_gloo_peers(torch2):
    seen = torch2["failure"]
    assert seen["error"] is not None, "rank 0 finished although rank 1 had died"
    assert seen["seconds"] < FAIL_BOUND_S, seen


def test_failing_rank_aborts_mpi_job(mpi2):
    proc = mpi2["proc"]
    assert proc.returncode != 0, "the MPI job succeeded although rank 1 raised"
    # the raising rank's summary line comes first: MPI_Abort may cut the rest of its stderr
    # (seen: a traceback cut after its second frame)
    assert "[rank 1] uncaught RuntimeError" in proc.stderr, proc.stderr[-2000:]
    assert "failing run returned" not in proc.stdout
    assert mpi2["elapsed"] < DEADLINE_S


def test_mc_parallel_needs_a_dividing_world():
    from torchsso2.optim import VIOptimizer

    model = common.build("vi")
    with pytest.raises(ValueError, match="mc_parallel=2 must divide the world size 1"):
        VIOptimizer(model, dataset_size=10, communicator=LocalCommunicator(), mc_parallel=2)
    with pytest.raises(ValueError, match="grad_worker_fraction"):
        VIOptimizer(model, dataset_size=10, communicator=LocalCommunicator(), grad_worker_fraction="bad")


def test_mc_parallel_seeding_matches_more_samples():
    """The grid's sample indices tile 0..R·m-1, so R groups draw exactly one process's R·m samples."""
    grid = SampleGrid(world_size=6, mc_parallel=3)
    assert grid.data_size == 2
    drawn = sorted(s for r in range(6) if grid.data_rank(r) == 0 for s in grid.samples(r, 2))
    assert drawn == list(range(6))
    assert [grid.sample_group(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [grid.data_rank(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
