"""``python -m benchmarks.run --quick`` never rewrites the published results.

A quick (smoke) run writes into a scratch directory; only a full run, ``--report-only`` or an
explicit ``--publish`` write ``benchmarks/results/*.json``, ``docs/results.md``, ``docs/*.png``
and README's results block.
"""
from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Dict

import pytest

from benchmarks import run as bench_run


def _published() -> Dict[str, str]:
    files = [bench_run.DEFAULT_README, *bench_run.DEFAULT_RESULTS.glob("*.json"),
             *bench_run.DEFAULT_DOCS.glob("*.md"), *bench_run.DEFAULT_DOCS.glob("*.png")]
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def test_quick_defaults_to_a_scratch_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = bench_run.parse_args(["--quick"])
    for d in (args.results_dir, args.docs_dir):
        assert tmp_path in d.resolve().parents
    assert bench_run.readme_target(args) is None
    out = bench_run.parse_args(["--quick", "--out", str(tmp_path / "o")])
    assert (out.results_dir, out.docs_dir) == (tmp_path / "o" / "results", tmp_path / "o" / "docs")
    # an explicit scratch results dir keeps the docs beside it, not in docs/
    only_results = bench_run.parse_args(["--full", "--results-dir", str(tmp_path / "r")])
    assert only_results.docs_dir == tmp_path / "r"
    # full and report-only runs publish
    for argv in (["--full"], ["--report-only"], []):
        a = bench_run.parse_args(argv)
        assert (a.results_dir, a.docs_dir) == (bench_run.DEFAULT_RESULTS, bench_run.DEFAULT_DOCS)
        assert bench_run.readme_target(a) == bench_run.DEFAULT_README
    published = bench_run.parse_args(["--quick", "--publish"])
    assert published.results_dir == bench_run.DEFAULT_RESULTS
    assert bench_run.readme_target(published) == bench_run.DEFAULT_README


def test_quick_into_published_dirs_needs_publish() -> None:
    with pytest.raises(ValueError, match="--publish"):
        bench_run.parse_args(["--quick", "--results-dir", str(bench_run.DEFAULT_RESULTS)])
    with pytest.raises(ValueError, match="--publish"):
        bench_run.parse_args(["--quick", "--out", "/tmp/x", "--readme", str(bench_run.DEFAULT_README)])


def test_quick_run_leaves_published_files_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real runner's quick path on its smallest setting (linalg, 8×8, one repeat)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = _published()
    assert bench_run.main(["--quick", "--only", "linalg", "--extra",
                           "linalg=--sizes 8 --repeats 1 --ops eigh --backends torch"]) == 0
    assert _published() == before
    [scratch] = list(tmp_path.glob("torchsso2-bench-quick-*"))
    assert (scratch / "results" / "linalg.json").exists()
    assert (scratch / "docs" / "results.md").exists()


def test_scaling_quick_writes_no_published_json(tmp_path: Path) -> None:
    """``benchmarks/scaling.py --quick`` wrote its smoke rows over the published scaling.json."""
    from benchmarks import scaling
    assert scaling.parse_args(["--quick"]).no_json
    full = scaling.parse_args([])
    assert not full.no_json and full.json == scaling.DEFAULT_JSON
    chosen = scaling.parse_args(["--quick", "--json", str(tmp_path / "s.json")])
    assert not chosen.no_json and chosen.json == tmp_path / "s.json"


def test_scaling_keeps_saved_rows_only_of_the_same_model_and_batch() -> None:
    """A run at another width kept the saved rows of the old width under the new run's title (a 1-rank row of
    one model beside a 2-rank row of another, and speed-ups between them)."""
    from benchmarks import scaling
    args = scaling.parse_args(["--ranks", "1", "--width", "32", "--global-batch", "64"])
    row = lambda ranks, ms: {"optimizer": "so", "shape": "kfac", "placement": "comm_opt", "ranks": ranks,  # noqa: E731
                             "step_ms": ms}
    config = {k: getattr(args, k) for k in scaling.SAME_RUN_KEYS}
    new = [row(1, 7.8)]
    same = {"config": dict(config), "rows": [row(1, 9.0), row(2, 20.8)]}
    assert scaling.merge_rows(same, new, args) == [row(2, 20.8), row(1, 7.8)]
    other = {"config": dict(config, width=256), "rows": [row(1, 9.0), row(2, 20.8)]}
    assert scaling.merge_rows(other, new, args) == new
    assert scaling.merge_rows(None, new, args) == new
