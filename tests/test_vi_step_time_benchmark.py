"""benchmarks/vi_step_time.py: --help, a quick run's JSON (every variant, ratios to the reference),
and its default output outside benchmarks/results."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import vi_step_time as bench
from fake_clock import FakeClock

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


def test_round_robin_statistics_and_ratios_from_hand_chosen_step_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """round_robin + with_ratios, 3 rounds of two variants (order adam, vi; vi, adam; adam, vi) under a
    fake perf_counter: adam steps take 2, 4, 9 ms, vi 3, 10, 5 ms. By hand: adam min / median / mean
    2 / 4 / 5 ms, vi 3 / 5 / 6 ms; vi / adam: 1.5 (min), 1.25 (median), 1.2 (mean); adam's ratios are 1."""
    import types

    import torch

    def step_variant():
        return lambda x, y: torch.zeros(())

    adam, vi = [2e-3, 4e-3, 9e-3], [3e-3, 10e-3, 5e-3]
    clock = FakeClock([adam[0], vi[0], vi[1], adam[1], adam[2], vi[2]])
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=clock))
    res = bench.with_ratios(bench.round_robin([("adam", step_variant), ("vi", step_variant)], [(None, None)], 3, 0),
                            "adam")
    assert clock.calls == 12
    a, v = res["adam"], res["vi"]
    assert (a["min_ms"], a["median_ms"], a["mean_ms"]) == pytest.approx((2, 4, 5))
    assert (v["min_ms"], v["median_ms"], v["mean_ms"]) == pytest.approx((3, 5, 6))
    assert (v["ratio_min"], v["ratio_median"], v["ratio_mean"]) == pytest.approx((1.5, 1.25, 1.2))
    assert a["ratio_min"] == a["ratio_median"] == a["ratio_mean"] == 1.0
    assert a["steps"] == v["steps"] == 3 and a["skipped"] is None
