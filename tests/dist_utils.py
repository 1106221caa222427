"""Helpers shared by the tests that launch real processes."""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import List, Optional

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


def run_gloo_ranks(worker: ModuleType, world_size: int, out_dir: Path, deadline_s: float) -> List[Optional[int]]:
    """Run ``worker.main(rank, world_size, init_file, out_dir)`` on ``world_size`` processes.

    Processes come from a forkserver that preloads torch and ``worker`` (cheap start-up); all
    must finish within ``deadline_s`` in total, the rest are killed. Returns the exit codes
    (None: killed).
    """
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", worker.__name__])
    init = out_dir / "init"
    procs = [ctx.Process(target=worker.main, args=(r, world_size, str(init), str(out_dir)), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    return codes
