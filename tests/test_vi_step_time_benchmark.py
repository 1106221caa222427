"""benchmarks/vi_step_time.py: --help, a quick run's JSON (every variant, ratios to the reference),
and its default output outside benchmarks/results."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import vi_step_time as bench

ROOT = Path(__file__).resolve().parents[1]


def test_help_runs():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vi_step_time.py"), "--help"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    assert "--out" in out.stdout and "--transformer-steps" in out.stdout


def test_default_out_is_not_the_published_results():
    args = bench.parse_args([])
    assert (ROOT / "benchmarks" / "results") not in args.out.resolve().parents
    assert args.steps >= 200 and args.transformer_steps >= 200 and args.threads == 1


def test_bad_counts_are_refused():
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "0"])


def test_quick_run_writes_every_variant(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "t.json"
    assert bench.main(["--quick", "--transformer-steps", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    digits = report["digits_mlp"]
    expected = {"adam", "sgd", "vi-diag-reparam", "vi-diag-reparam-general", "vi-diag-fisher_mc", "vi-kfac"}
    assert expected <= set(digits)
    assert ("ivon" in digits) != ("ivon" in report["skipped"])
    assert digits["adam"]["ratio_min"] == 1.0
    for name in expected - {"adam", "sgd"}:
        assert digits[name]["skipped"] == 0 and digits[name]["steps"] == 10
        assert digits[name]["ratio_min"] == pytest.approx(digits[name]["min_ms"] / digits["adam"]["min_ms"])
    assert set(report["transformer"]) == {"adamw", "vi-diag-reparam", "vi-diag-fisher_mc"}
    assert report["load_average_before"] is not None and report["load_average_after"] is not None
    printed = capsys.readouterr().out
    assert "| vi-diag-reparam |" in printed and "min / adamw" in printed
