"""The benchmark harness runs end to end (so it never rots); the numbers are not asserted.

Runs ``benchmarks.run --quick`` on the peer benchmarks with tiny settings, in a temporary
results/docs directory, with every peer disabled (``BENCH_DISABLE_PEERS=all``) so the
skip paths run and the test never needs BackPACK, curvlinops, laplace-torch, IVON or
kfac_pytorch installed.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sklearn")  # peers_training trains on sklearn's digits

from benchmarks import run as bench_run  # noqa: E402

MINE = ("peers_curvature", "peers_training", "memory", "width_scaling")
TINY = [
    "peers_curvature=--models mlp-xs cnn-xs --budget 0.01 --batch 8",
    "peers_training=--optimizers sgd sso-kfac ivon kfac_pytorch --epochs 1 --batch-size 256",
    "memory=--optimizers sgd sso-kfac ivon --width 16 --in-features 16 --steps 1 --batch 8",
    "width_scaling=--widths 16 32 --budget 0.01 --batch 8",
]


def test_discover_finds_every_benchmark() -> None:
    names = bench_run.discover()
    for name in ("linalg", *MINE):
        assert name in names
    assert not {"common", "_peer_utils", "run", "__init__"} & set(names)


def test_quick_run_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_DISABLE_PEERS", "all")
    results, docs = tmp_path / "results", tmp_path / "docs"
    argv = ["--quick", "--results-dir", str(results), "--docs-dir", str(docs), "--only", *MINE]
    for e in TINY:
        argv += ["--extra", e]
    assert bench_run.main(argv) == 0
    for name in MINE:
        report = json.loads((results / f"{name}.json").read_text(encoding="utf-8"))
        assert report["machine"]["torch"]
        assert isinstance(report["results"], list) and report["results"]
    skipped = json.loads((results / "peers_training.json").read_text(encoding="utf-8"))["skipped"]
    assert set(skipped) == {"ivon", "kfac_pytorch"}
    assert "backpack" in json.loads((results / "peers_curvature.json").read_text(encoding="utf-8"))["skipped"]
    page = (docs / "results.md").read_text(encoding="utf-8")
    assert "# Benchmark results" in page and "|" in page
    assert (docs / "width_scaling.png").exists() or "matplotlib" not in page


def test_report_only_and_bad_module(tmp_path: Path) -> None:
    assert bench_run.main(["--only", "no_such_benchmark", "--results-dir", str(tmp_path)]) == 2
    assert bench_run.main(["--report-only", "--results-dir", str(tmp_path), "--docs-dir", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").exists()
