"""Helpers shared by the tests that launch real processes."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def mpiexec_path() -> Optional[str]:
    """The ``mpiexec`` next to this Python (``pip install mpich``) or on PATH; None if absent."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def require_mpiexec() -> str:
    """``mpiexec``'s path, or skip the test when mpi4py or mpiexec is missing."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed (pip install mpich mpi4py)")
    found = mpiexec_path()
    if found is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    return found


def mpi_env() -> dict:
    """The environment for an ``mpiexec`` job: this one, with the repository importable."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def mpi_rank_results(script: Path, out: Path, ranks: int = 2, timeout: float = 300.0) -> List[dict]:
    """Run ``mpiexec -n ranks python script out`` (skipped without MPI) and load each rank's
    ``out/rank<r>.pt`` (``weights_only``); the job must exit 0."""
    mpiexec = require_mpiexec()
    proc = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, str(script), str(out)], env=mpi_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"mpiexec failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(ranks)]


def start_ranks(target: Callable[..., None], world_size: int, args: tuple, preload: Sequence[str],
                deadline_s: float, wait_ranks: Optional[Sequence[int]] = None) -> List[Optional[int]]:
    """Run ``target(rank, *args)`` on ``world_size`` processes; return their exit codes (None: killed).

    The processes come from a forkserver that preloads torch and ``preload`` (a fresh
    interpreter, so no OpenMP state is forked; a job starts in about a second). Waits up to
    ``deadline_s`` in total for the ranks in ``wait_ranks`` (default: all), then kills whatever
    still runs. Unlike ``torch.multiprocessing.spawn`` one failing rank does not kill the others,
    so failure tests can observe how they end.
    """
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", *preload])
    procs = [ctx.Process(target=target, args=(rank, *args), daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    for rank in range(world_size) if wait_ranks is None else wait_ranks:
        procs[rank].join(max(0.0, end - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    return codes


def run_gloo_ranks(worker: ModuleType, world_size: int, out_dir: Path, deadline_s: float) -> List[Optional[int]]:
    """Run ``worker.main(rank, world_size, init_file, out_dir)`` on ``world_size`` processes
    (:func:`start_ranks`, preloading ``worker``); all must finish within ``deadline_s``."""
    return start_ranks(worker.main, world_size, (world_size, str(out_dir / "init"), str(out_dir)),
                       [worker.__name__], deadline_s)


#: gloo's teardown race (pytorch/pytorch#179291: a worker thread still holding work objects when the
#: interpreter finalizes aborts the process) hits a rank *after* the script finished, rarely (once in
#: ~20 torchrun runs here, after shutdown() had destroyed the group)
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun_script(tmp_path: Path, name: str, text: str, *args: str, ranks: int = 2,
                    timeout: float = 240.0) -> Tuple[int, str]:
    """Write ``text`` to ``tmp_path/name`` and run it with ``args`` on ``ranks`` gloo ranks under torchrun
    (one OpenMP thread, the repository importable, a 60 s collective timeout); ``(exit code, stdout + stderr)``."""
    script = tmp_path / name
    script.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                           str(script), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                               "TMPDIR": str(tmp_path),  # torchrun's torchelastic_* log dir goes there
                               "TORCHSSO2_DIST_TIMEOUT": "60"})
    return proc.returncode, proc.stdout + proc.stderr


def launch_example(prefix: Sequence[str], script: str, *args: str, timeout: float = 180.0,
                   finished_marker: str = "final test accuracy", env: Optional[Dict[str, str]] = None) -> str:
    """Run ``[*prefix, REPO/script, *args]`` with 1 OpenMP thread and return its stdout; assert exit 0.

    A run that printed ``finished_marker`` and then died of :data:`GLOO_TEARDOWN_ABORT` (upstream,
    after the training finished) is run once more, with a warning; any other failure, or that
    abort twice in a row, fails the test. ``env``: more environment variables for the run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    cmd = [*prefix, str(REPO / script), *args]
    for attempt in (1, 2):
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        teardown = (proc.returncode != 0 and GLOO_TEARDOWN_ABORT in proc.stderr
                    and finished_marker in proc.stdout)
        if not teardown or attempt == 2:
            break
        warnings.warn(f"{script}: a rank aborted in gloo's teardown after finishing; running it once more")
    assert proc.returncode == 0, f"{list(prefix)} {script} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def assert_replicas_equal_one_process(out: str, tolerance: float = 1e-12) -> None:
    """For a 2-rank worker printing ``REPLICAS <max difference to rank 0>`` on every rank and ``MAXDIFF
    <difference to one process>`` on rank 0 (lines that may interleave): identical replicas, and one
    process within ``tolerance``."""
    import re
    number = r"(\d\.\d{3}e[+-]\d{2})"
    replicas = [float(v) for v in re.findall("REPLICAS " + number, out)]
    diff = [float(v) for v in re.findall("MAXDIFF " + number, out)]
    assert len(replicas) == 2 and max(replicas) == 0.0, out
    assert len(diff) == 1 and diff[0] < tolerance, out


def launch(cmd: List[str], bound_s: float, **env: str) -> Tuple[int, str, float]:
    """Run ``cmd`` (1 OpenMP thread, ``env`` added); return (exit code, stdout+stderr, seconds).

    Fails the test if the job is still running after ``bound_s`` + 30 s (then it is killed)."""
    full = dict(mpi_env(), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env)
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=full, capture_output=True, text=True, timeout=bound_s + 30.0)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"{cmd} still ran after {bound_s + 30:.0f} s (hung)\n{out[-3000:]}")
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def mpiexec_command(*args: str, python_m_mpi4py: bool = False, ranks: int = 2) -> List[str]:
    """``mpiexec -n ranks python [-m mpi4py] args…`` (skips the test without mpiexec)."""
    prefix = [require_mpiexec(), "-n", str(ranks), sys.executable]
    return prefix + (["-m", "mpi4py"] if python_m_mpi4py else []) + list(args)


def torchrun_command(*args: str) -> List[str]:
    """torchrun on 2 local processes running ``args``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
