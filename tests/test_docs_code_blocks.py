"""Every ```python block of README.md, docs/guide.md and docs/migrating.md runs.

The blocks of one file run in order in one namespace (a page reads top to bottom). A block that
cannot run here is marked on the line before it with ``<!-- docs-test: skip: <reason> -->``; the
marked blocks are listed in :data:`SKIPPED` so that a new skip is a visible change to this test.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FILES = ["README.md", "docs/guide.md", "docs/migrating.md"]
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
    for line, code, why in python_blocks(ROOT / name):
        if why:
            continue
        try:
            exec(compile(code, f"{name}:{line}", "exec"), namespace)
        except Exception as err:  # name the block in the failure
            raise AssertionError(f"{name}, block at line {line} failed: {type(err).__name__}: {err}") from err
