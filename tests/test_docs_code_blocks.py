"""Every ```python block of README.md and the docs pages with examples (:data:`FILES`) runs.

The blocks of one file run in order in one namespace (a page reads top to bottom). A block that
cannot run here is marked on the line before it with ``<!-- docs-test: skip: <reason> -->``; the
marked blocks are listed in :data:`SKIPPED` so that a new skip is a visible change to this test.
docs/scaling.md's ``train.py`` also runs on 2 processes under each launcher the page names.
docs/distributed.md and docs/linalg.md show signatures, not programs, and are not run.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import List, Tuple

import pytest
import torch
from dist_utils import launch, mpiexec_command, torchrun_command

ROOT = Path(__file__).resolve().parents[1]
FILES = ["README.md", "docs/guide.md", "docs/migrating.md", "docs/adaptive.md", "docs/kfac.md", "docs/scaling.md"]
SKIP = re.compile(r"<!--\s*docs-test:\s*skip:\s*(.+?)\s*-->")
#: (file, first line of the block) of every skipped block, with the reason given in the file
SKIPPED: List[Tuple[str, str]] = [
    ("docs/guide.md", "  accelerator = Accelerator()                         # no gradient_accumulation_steps"),
]


def python_blocks(path: Path) -> List[Tuple[int, str, str]]:
    """``(line number, code, skip reason or '')`` of each fenced python block of ``path``."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            j = start
            while lines[j].strip() != "```":
                j += 1
            prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            m = SKIP.search(prev)
            out.append((start + 1, "\n".join(lines[start:j]), m.group(1) if m else ""))
            i = j
        i += 1
    return out


def test_extraction_finds_blocks_and_skips_are_listed() -> None:
    found = {f: python_blocks(ROOT / f) for f in FILES}
    assert all(found[f] for f in FILES), {f: len(b) for f, b in found.items()}
    skipped = [(f, code.splitlines()[0]) for f, blocks in found.items() for _, code, why in blocks if why]
    assert skipped == SKIPPED


@pytest.mark.parametrize("name", FILES)
def test_code_blocks_run(name: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    torch.manual_seed(0)
    namespace: dict = {"__name__": f"docs_{Path(name).stem}"}
    kfac_modules = _kfac_modules()  # docs/kfac.md calls install_as_kfac(): undone after the page (and a
    for key in kfac_modules:        # kfac_pytorch another test imported is out of the way meanwhile)
        del sys.modules[key]
    try:
        for line, code, why in python_blocks(ROOT / name):
            if why:
                continue
            try:
                exec(compile(code, f"{name}:{line}", "exec"), namespace)
            except Exception as err:  # name the block in the failure
                raise AssertionError(f"{name}, block at line {line} failed: {type(err).__name__}: {err}") from err
    finally:
        for key in _kfac_modules():
            del sys.modules[key]
        sys.modules.update(kfac_modules)


def _kfac_modules() -> dict:
    return {k: m for k, m in sys.modules.items() if k == "kfac" or k.startswith("kfac.")}


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_scaling_train_py_runs_on_two_processes(launcher: str, tmp_path) -> None:
    """docs/scaling.md's ``train.py`` under the launchers the page names: every step, and the lines
    printed on rank 0 only."""
    (block,) = [code for _, code, _ in python_blocks(ROOT / "docs/scaling.md")]
    script = tmp_path / "train.py"
    script.write_text(block)
    command = mpiexec_command(str(script)) if launcher == "mpiexec" else torchrun_command(str(script))
    code, out, _ = launch(command, 120.0, TORCHSSO2_DIST_TIMEOUT="60")
    assert code == 0, out
    printed = re.findall(r"^(SecondOrderOptimizer|VIOptimizer): loss (\d+\.\d+)$", out, flags=re.M)
    assert [n for n, _ in printed] == ["SecondOrderOptimizer", "VIOptimizer"], out
    # trained from ln 4 = 1.39 (one process: 0.83 and 1.26; VIOptimizer at its default lr is slower)
    assert float(printed[0][1]) < 1.1 and float(printed[1][1]) < 1.33, out
