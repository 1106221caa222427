"""Every example and benchmark answers ``python <file> --help`` from any directory (argparse's usage,
exit 0): the scripts make the repository root importable themselves; helper modules say which
program uses them. Run in parallel subprocesses (each imports torch)."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: importable helpers with no command line of their own
LIBRARY_ONLY = {"__init__.py", "common.py"}


def _scripts():
    return sorted(p for d in ("examples", "benchmarks") for p in (ROOT / d).glob("*.py")
                  if p.name not in LIBRARY_ONLY and not p.name.startswith("_"))


def test_every_example_and_benchmark_answers_help_from_another_directory(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"

    def run(path: Path):
        proc = subprocess.run([sys.executable, str(path), "--help"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        return path, proc

    scripts = _scripts()
    assert len(scripts) > 20
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, scripts))
    failed = [f"{p.relative_to(ROOT)}: rc {proc.returncode}\n{proc.stderr[-800:]}" for p, proc in results
              if proc.returncode != 0 or "usage:" not in proc.stdout]
    assert not failed, "\n\n".join(failed)
