"""Helpers shared by the tests that launch real processes."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Optional


def mpiexec_path() -> Optional[str]:
    """The ``mpiexec`` next to this Python (``pip install mpich``) or on PATH; None if absent."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")
