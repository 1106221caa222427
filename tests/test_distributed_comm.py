"""Communicators: unit checks in-process, collectives with real gloo and MPI processes.

The multi-process jobs run once per module (fixtures); their ranks save what the
collectives produced (see tests/dist_scripts/comm_checks.py) and the tests below compare
it with the same computation done locally on every rank's inputs.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import types
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from torchsso2.distributed import (
    Communicator,
    DistributedStrategy,
    Group,
    LocalCommunicator,
    WorkAssignment,
    get_communicator,
)
from torchsso2.distributed.bucketing import (
    flatten_bucket,
    pack_symmetric,
    plan_buckets,
    symmetric_numel,
    unflatten_bucket_,
    unpack_symmetric_,
)
from torchsso2.distributed.mpi_backend import mpi_launch_size
from torchsso2.distributed.torch_backend import torchrun_world_size

SCRIPTS = Path(__file__).parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))

import comm_checks as cc  # noqa: E402
import torch_worker  # noqa: E402
from dist_utils import mpi_env, mpiexec_path, start_ranks  # noqa: E402

JOB_DEADLINE_S = 120.0


# ---------------------------------------------------------------------------------------
# helpers to run real processes
# ---------------------------------------------------------------------------------------
def _spawn(
    target: Any,
    world_size: int,
    args: tuple,
    deadline_s: float = JOB_DEADLINE_S,
    wait_ranks: list[int] | None = None,
) -> list[int | None]:
    """Start ``world_size`` processes running ``target(rank, *args)``; return their exit codes
    (:func:`dist_utils.start_ranks`, preloading ``torch_worker``; None: still running, killed)."""
    return start_ranks(target, world_size, args, ["torch_worker"], deadline_s, wait_ranks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mpi_missing_reason() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install mpi4py mpich)"
    if mpiexec_path() is None:
        return "mpiexec not found next to python or on PATH (pip install mpich)"
    return None


def _run_mpi(world_size: int, mode: str, out_dir: Path, timeout_s: float) -> subprocess.CompletedProcess:
    env = mpi_env()
    cmd = [mpiexec_path(), "-n", str(world_size), sys.executable, str(SCRIPTS / "mpi_worker.py"), mode, str(out_dir)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)


def _load(out_dir: Path, tag: str, world_size: int) -> list[dict[str, Any]]:
    return [torch.load(out_dir / f"{tag}_rank{r}.pt") for r in range(world_size)]


@pytest.fixture(scope="module")
def torch2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """2 gloo ranks, file:// init."""
    out = tmp_path_factory.mktemp("torch2")
    codes = _spawn(torch_worker.checks_file_init, 2, (2, str(out / "init"), str(out)))
    assert codes == [0, 0], f"gloo workers exited with {codes}"
    return _load(out, "torch", 2)


@pytest.fixture(scope="module")
def torch4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """4 gloo ranks initialized by get_communicator('auto') from a torchrun-like env."""
    out = tmp_path_factory.mktemp("torch4")
    codes = _spawn(torch_worker.checks_env_init, 4, (4, _free_port(), str(out)))
    assert codes == [0] * 4, f"gloo workers exited with {codes}"
    return _load(out, "torchenv", 4)


def _mpi_results(tmp_path_factory: pytest.TempPathFactory, world_size: int) -> list[dict[str, Any]]:
    reason = _mpi_missing_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp(f"mpi{world_size}")
    proc = _run_mpi(world_size, "checks", out, timeout_s=JOB_DEADLINE_S)
    assert proc.returncode == 0, f"mpiexec failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return _load(out, "mpi", world_size)


@pytest.fixture(scope="module")
def mpi2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _mpi_results(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def mpi4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _mpi_results(tmp_path_factory, 4)


JOBS = ["torch2", "torch4", "mpi2", "mpi4"]


@pytest.fixture(params=JOBS)
def job(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return request.getfixturevalue(request.param)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = 1e-12 if actual.dtype == torch.float64 else 1e-6
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------------------
# multi-process collectives
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_allreduce_matches_local_computation(job: list[dict[str, Any]], op: str) -> None:
    world = len(job)
    inputs = [cc.make_tensors(r) for r in range(world)]
    for i, like in enumerate(inputs[0]):
        stacked = torch.stack([inputs[r][i].double() for r in range(world)])
        expected = (stacked.mean(0) if op == "mean" else stacked.sum(0)).to(like.dtype)
        for res in job:
            assert res["type"] in ("TorchCommunicator", "MPICommunicator")
            _close(res[f"allreduce_{op}"][i], expected)
            if op == "mean":
                _close(res["allreduce_default"][i], expected)
    for res in job:
        # one collective per bucket, several buckets under the tiny cap, payload counted once
        assert res[f"allreduce_{op}_collectives"] == res["expected_buckets"] >= 4
        assert res["allreduce_default_collectives"] == 2  # one bucket per dtype
        assert res[f"allreduce_{op}_bytes"] == _nbytes(cc.make_tensors(0))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_symmetric_allreduce_equals_full_and_sends_upper_triangle(job: list[dict[str, Any]], dtype: str) -> None:
    world = len(job)
    torch_dtype = getattr(torch, dtype)
    esize = torch.empty((), dtype=torch_dtype).element_size()
    for i, n in enumerate(cc.SYM_SIZES):
        expected = torch.stack([cc.make_symmetric(r, torch_dtype)[i].double() for r in range(world)]).mean(0)
        for res in job:
            packed, full = res[f"sym_packed_{dtype}"][i], res[f"sym_full_{dtype}"][i]
            _close(packed, full)
            _close(packed, expected.to(torch_dtype))
            assert torch.equal(packed, packed.T)
    for res in job:
        assert res[f"sym_packed_{dtype}_bytes"] == sum(symmetric_numel(n) for n in cc.SYM_SIZES) * esize
        assert res[f"sym_full_{dtype}_bytes"] == sum(n * n for n in cc.SYM_SIZES) * esize


def test_broadcast_from_every_source(job: list[dict[str, Any]]) -> None:
    world = len(job)
    for src in range(world):
        expected = cc.make_tensors(src)
        for res in job:
            for got, exp in zip(res[f"bcast_world_{src}"], expected):
                assert torch.equal(got, exp)
    for res in job:  # each rank is the source once and counts only that
        assert res["bcast_world_bytes"] == _nbytes(cc.make_tensors(0))
        for got, exp in zip(res["bcast_sym"], cc.make_symmetric(world - 1)):
            torch.testing.assert_close(got, exp, rtol=0, atol=0)


def test_broadcast_within_subgroups(job: list[dict[str, Any]]) -> None:
    world = len(job)
    for ranks in cc.subgroups_for(world):
        name = "-".join(map(str, ranks))
        for src in ranks:
            for rank, res in enumerate(job):
                owner = src if rank in ranks else rank  # non-members keep their own values
                for got, exp in zip(res[f"bcast_group_{name}_src{src}"], cc.make_tensors(owner)):
                    assert torch.equal(got, exp)


def test_kaisa_communication_flow(job: list[dict[str, Any]]) -> None:
    """Inverse broadcasts in grad-worker groups + gradient broadcasts in receiver groups give
    every rank every layer's gradient; the bytes follow the documented cost model."""
    world = len(job)
    expected = {
        layer: cc.kaisa_gradient({f: cc.kaisa_value(layer, f, n) for f, n in factors.items()})
        for layer, factors in cc.KAISA_SIZES.items()
    }
    for strategy in (DistributedStrategy.COMM_OPT, DistributedStrategy.MEM_OPT, DistributedStrategy.HYBRID_OPT):
        key = f"kaisa_{strategy.name}"
        if key not in job[0]:
            continue
        for res in job:
            for layer, grad in expected.items():
                torch.testing.assert_close(res[key][layer], grad, rtol=1e-12, atol=1e-12)
        wa = WorkAssignment.from_sizes(cc.KAISA_SIZES, world, strategy)
        g = wa.grad_workers_per_layer
        inv_bytes = sum(symmetric_numel(n) * 8 for f in cc.KAISA_SIZES.values() for n in f.values()) if g > 1 else 0
        grad_bytes = g * sum(f["A"] * f["G"] * 8 for f in cc.KAISA_SIZES.values()) if g < world else 0
        assert sum(res[f"{key}_bytes"] for res in job) == inv_bytes + grad_bytes


@pytest.mark.parametrize("world", [2, 4])
def test_torch_and_mpi_agree(request: pytest.FixtureRequest, world: int) -> None:
    t = request.getfixturevalue(f"torch{world}")
    m = request.getfixturevalue(f"mpi{world}")
    for rt, rm in zip(t, m):
        assert rt.keys() == rm.keys()
        for key, vt in rt.items():
            vm = rm[key]
            if key == "type":
                continue
            if isinstance(vt, list):
                for a, b in zip(vt, vm):
                    _close(a, b)
            elif isinstance(vt, dict):
                for layer in vt:
                    _close(vt[layer], vm[layer])
            else:
                assert vt == vm, key


# ---------------------------------------------------------------------------------------
# failures: a rank that raises or hangs must not hang the others
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_torch_failure_is_bounded(tmp_path: Path, mode: str) -> None:
    timeout_s = 3.0
    start = time.monotonic()
    codes = _spawn(torch_worker.failing, 2, (2, str(tmp_path / "init"), str(tmp_path), mode, timeout_s),
                   deadline_s=60.0, wait_ranks=[0] if mode == "hang" else None)
    elapsed = time.monotonic() - start
    assert codes[0] not in (0, None), f"rank 0 should have failed, exit codes {codes}"
    report = (tmp_path / "rank0_error.txt").read_text()
    waited, message = report.split("\n", 2)[:2]
    assert float(waited) < 30.0, report
    assert message.strip(), "rank 0 raised an exception without a message"
    if mode == "raise":
        assert codes[1] not in (0, None)
    else:
        assert "Timed out" in message or "timeout" in message.lower(), message
    assert elapsed < 60.0


def test_mpi_abort_on_exception(tmp_path: Path) -> None:
    reason = _mpi_missing_reason()
    if reason:
        pytest.skip(reason)
    start = time.monotonic()
    try:
        proc = _run_mpi(2, "raise", tmp_path, timeout_s=60.0)
    except subprocess.TimeoutExpired:
        pytest.fail("mpiexec hung although install_abort_on_exception() was installed")
    said = f"rc={proc.returncode}\n--- stdout:\n{proc.stdout}\n--- stderr:\n{proc.stderr}"
    assert proc.returncode != 0, said
    assert "rank 1 fails on purpose" in proc.stderr + proc.stdout, said
    # get_communicator installed the hook already; the script's own install_abort_on_exception adds none
    assert (proc.stderr + proc.stdout).count("[rank 1] uncaught RuntimeError") == 1, said
    assert time.monotonic() - start < 60.0, said


# ---------------------------------------------------------------------------------------
# in-process: bucketing, local communicator, selection
# ---------------------------------------------------------------------------------------
def test_plan_buckets_cap_order_and_dtype_split() -> None:
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(100), torch.zeros(3, dtype=torch.float64), torch.zeros(5)]
    buckets = plan_buckets(ts, cap_bytes=80)
    assert [b.indices for b in buckets] == [(0, 1), (2,), (4,), (3,)]  # 100 floats > cap: alone
    assert [b.numel for b in buckets] == [20, 100, 5, 3]
    assert sorted(i for b in buckets for i in b.indices) == list(range(len(ts)))
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(ts, cap_bytes=0)


def test_flatten_unflatten_roundtrip_keeps_layout() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    ts = [base.t(), torch.arange(5.0), torch.zeros(0)]  # non-contiguous, plain, empty
    buckets = plan_buckets(ts, cap_bytes=1 << 20)
    assert [b.indices for b in buckets] == [(0, 1)]
    buf = flatten_bucket(ts, buckets[0])
    assert buf.is_contiguous() and buf.numel() == 17
    buf.mul_(2)
    unflatten_bucket_(buf, ts, buckets[0])
    assert torch.equal(base, 2 * torch.arange(12.0).reshape(3, 4)) and torch.equal(ts[1], 2 * torch.arange(5.0))


def test_pack_unpack_symmetric_roundtrip() -> None:
    x = torch.randn(6, 6, dtype=torch.float64)
    s = x + x.T
    v = pack_symmetric(s)
    assert v.shape == (symmetric_numel(6),)
    out = torch.full((6, 6), float("nan"), dtype=torch.float64)
    unpack_symmetric_(v, out)
    assert torch.equal(out, s)


def test_local_communicator_is_a_noop() -> None:
    comm = get_communicator("none")
    assert isinstance(comm, LocalCommunicator) and isinstance(comm, Communicator)
    assert (comm.rank, comm.world_size) == (0, 1)
    ts = cc.make_tensors(0)
    before = [t.clone() for t in ts]
    comm.allreduce(ts, op="mean", bucket_cap_mb=cc.TINY_CAP_MB)
    comm.allreduce(ts, op="sum")
    comm.broadcast(ts, src=0)
    comm.broadcast(ts, src=0, group=comm.new_group([0]))
    sym = cc.make_symmetric(0)
    comm.allreduce(sym, symmetric=True)
    comm.barrier()
    assert all(torch.equal(a, b) for a, b in zip(ts, before))
    assert comm.bytes_sent == 0


def test_argument_errors_name_the_bad_value() -> None:
    comm = LocalCommunicator()
    with pytest.raises(ValueError, match="'max'"):
        comm.allreduce([torch.zeros(2)], op="max")
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        comm.allreduce([torch.zeros(2, 3)], symmetric=True)
    with pytest.raises(TypeError, match="int64"):
        comm.allreduce([torch.zeros(2, dtype=torch.int64)], op="mean")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        comm.allreduce([torch.zeros(2)], bucket_cap_mb=0)
    with pytest.raises(ValueError, match="source rank 1"):
        comm.broadcast([torch.zeros(2)], src=1)
    with pytest.raises(ValueError, match=r"\[3\]"):
        comm.new_group([0, 3])
    with pytest.raises(TypeError, match="list of tensors"):
        comm.allreduce(torch.zeros(2))  # type: ignore[arg-type]
    assert Group((0, 2)).size == 2 and 2 in Group((0, 2))


needs_no_process_group = pytest.mark.skipif(
    torch.distributed.is_available() and torch.distributed.is_initialized(),
    reason="another test left torch.distributed initialized in this process",
)


@needs_no_process_group
def test_get_communicator_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="'nccl'.*'auto', 'none', 'torch', 'mpi'"):
        get_communicator("nccl")
    with pytest.raises(ValueError, match="timeout"):
        get_communicator("none", timeout=0)
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        get_communicator("torch")
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # make `import mpi4py` fail
    with pytest.raises(ImportError, match=r"pip install mpi4py mpich"):
        get_communicator("mpi")
    # mpi4py 4 installed without an MPI library raises RuntimeError("cannot load MPI library") at import
    broken = types.ModuleType("mpi4py")

    def no_library(name: str) -> None:
        raise RuntimeError("cannot load MPI library")
    broken.__getattr__ = no_library  # type: ignore[attr-defined]  # (PEP 562: `from mpi4py import MPI`)
    monkeypatch.setitem(sys.modules, "mpi4py", broken)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    with pytest.raises(ImportError, match=r"pip install mpi4py mpich.*cannot load MPI library"):
        get_communicator("mpi")


@needs_no_process_group
def test_auto_is_local_without_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS",
                "PMIX_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert isinstance(get_communicator("auto"), LocalCommunicator)


def test_launcher_detection_reads_only_the_environment() -> None:
    assert mpi_launch_size({}) == 0
    assert mpi_launch_size({"PMI_SIZE": "4"}) == 4
    assert mpi_launch_size({"OMPI_COMM_WORLD_SIZE": "2"}) == 2
    assert torchrun_world_size({"WORLD_SIZE": "8", "RANK": "0", "MASTER_ADDR": "h"}) == 8
    assert torchrun_world_size({"WORLD_SIZE": "8"}) == 0


def test_bucket_cap_mb_counts_mebibytes() -> None:
    """bucket_cap_mb is in MiB (2**20 bytes, as DistributedDataParallel and bucketing.MIB): two float32
    tensors of 2**17 elements (2 × 0.5 MiB = exactly 1 MiB) fit one bucket at bucket_cap_mb=1, one element
    more does not; on a fake 2-rank world whose other rank holds the same values the mean is unchanged.
    Reference: the byte count by hand (a 10**6-byte "MB" would split the first pair too)."""
    from torchsso2.distributed.communicator import BucketedCommunicator

    class TwoIdenticalRanks(BucketedCommunicator):  # the sum over 2 equal ranks is 2 × the local values
        def __init__(self) -> None:
            super().__init__(0, 2)

        def barrier(self) -> None:
            pass

        def _allreduce_sum_(self, buffer: torch.Tensor) -> int:
            buffer.mul_(2)
            return buffer.numel() * buffer.element_size()

        def _broadcast_(self, buffer, src, members, handle) -> int:  # noqa: ANN001
            return buffer.numel() * buffer.element_size()

        def _make_group_handle(self, ranks):  # noqa: ANN001, ANN202
            return None

    g = torch.Generator().manual_seed(0)
    for n, collectives in ((2 ** 17, 1), (2 ** 17 + 1, 2)):
        comm = TwoIdenticalRanks()
        ts = [torch.randn(2 ** 17, generator=g), torch.randn(n, generator=g)]
        ref = [t.clone() for t in ts]
        comm.allreduce(ts, op="mean", bucket_cap_mb=1.0)
        assert comm.num_collectives == collectives, n
        assert comm.bytes_sent == 4 * (2 ** 17 + n)
        assert all(torch.equal(a, b) for a, b in zip(ts, ref))
