"""The packages ship py.typed (PEP 561), so users' type checkers check their code against our
annotations: documented-valid code must type-check. mypy runs on ``tests/typing_cases/documented_usage.py``
(the README quick tour's result API, ``VIOptimizer.predict``, ``approx=`` dicts, ``step(closure=...)``,
KFACPreconditioner's kfac_pytorch argument forms and attributes), errors in the packages themselves
silenced (``--follow-imports=silent``): only the public annotations are under test."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install mypy)")
def test_documented_usage_type_checks(tmp_path: Path) -> None:
    case = ROOT / "tests" / "typing_cases" / "documented_usage.py"
    run = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
                          "--no-incremental", "--cache-dir", str(tmp_path), "--no-error-summary", str(case)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
