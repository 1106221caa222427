"""benchmarks/vi_paired.py: the paired extra of benchmarks/vi.py (VI diag against IVON and Adam over more
seeds at the lrs the protocol chose), its rendering, and the long run's issue-27 seed count."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from benchmarks import _readme_summary as summary
from benchmarks import vi
from benchmarks import vi_paired as vp
from benchmarks import vi_quality as q


def _rows(values: dict) -> list:
    return [{"seed": s, "accuracy": a, "nll": n, "ece": e} for s, (a, n, e) in values.items()]


def test_paired_differences_are_the_per_seed_differences_with_their_standard_error() -> None:
    per_seed = {"vi-diag": _rows({0: (0.9, 0.20, 0.010), 1: (0.8, 0.30, 0.030), 2: (0.7, 0.10, 0.020)}),
                "ivon": _rows({2: (0.6, 0.15, 0.010), 0: (0.9, 0.25, 0.020), 1: (0.9, 0.30, 0.010)}),
                "adam": _rows({1: (0.5, 0.40, 0.050)})}  # shares seed 1 only
    d = vp.paired_differences(per_seed)
    ece = [0.010 - 0.020, 0.030 - 0.010, 0.020 - 0.010]  # matched by seed, not by position
    assert d["ivon"]["ece"]["mean"] == pytest.approx(statistics.fmean(ece))
    assert d["ivon"]["ece"]["stderr"] == pytest.approx(statistics.stdev(ece) / math.sqrt(3))
    assert d["ivon"]["nll"]["mean"] == pytest.approx((-0.05 + 0.0 - 0.05) / 3)
    assert d["ivon"]["ece"]["n"] == 3
    assert d["adam"]["accuracy"] == {"mean": pytest.approx(0.3), "stderr": 0.0, "n": 1}
    with pytest.raises(ValueError, match="share no seed"):
        vp.paired_differences({"vi-diag": _rows({0: (1, 1, 1)}), "ivon": _rows({1: (1, 1, 1)})})
    with pytest.raises(ValueError, match="'vi-diag' is not one of"):
        vp.paired_differences({"ivon": _rows({0: (1, 1, 1)})})


def test_run_paired_keeps_the_protocol_seeds_and_trains_the_rest_at_the_chosen_lr(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The protocol's test rows are reused as they are; only the missing seeds are trained, each method at
    its ``chosen_lr`` (never re-chosen), and evaluated on the test split."""
    calls = []

    def fake_train(task, method, split, lr, seed, epochs, batch, ivon_mod):  # noqa: ANN001
        calls.append((method, lr, seed, epochs))
        return q.Trained(method, lr, seed, torch.nn.Linear(1, 1), None, [1e-3], 0, 0.0)

    def fake_evaluate(run, split, which, num_samples):  # noqa: ANN001
        assert which == "test"
        return {"accuracy": 0.9, "nll": run.lr + run.seed, "ece": 0.01 * run.seed, "brier": 0.1}

    monkeypatch.setattr(q, "train", fake_train)
    monkeypatch.setattr(q, "evaluate", fake_evaluate)
    protocol = {"vi-diag": ({"seed": 0, "accuracy": 1.0, "nll": 7.0, "ece": 0.5, "brier": 0.0}, 0.1),
                "adam": ({"seed": 0, "accuracy": 1.0, "nll": 8.0, "ece": 0.25, "brier": 0.0}, 1e-3),
                "sgd": ({"seed": 0, "accuracy": 1.0, "nll": 9.0, "ece": 0.0, "brier": 0.0}, 0.03)}
    res = {"methods": {m: {"chosen_lr": lr, "seeds": [row], "summary": {}} for m, (row, lr) in protocol.items()}}
    args = vi.parse_args(["--quick"])
    out = vp.run_paired("digits-mlp", res, args, None, 3)
    assert sorted(calls) == sorted((m, lr, s, args.epochs["digits-mlp"])
                                   for m, lr in (("vi-diag", 0.1), ("adam", 1e-3)) for s in (1, 2))  # no sgd
    assert out["seeds"] == 3 and set(out["methods"]) == {"vi-diag", "adam"}
    vi_rows = out["methods"]["vi-diag"]["seeds"]
    assert vi_rows[0] == protocol["vi-diag"][0] and [r["seed"] for r in vi_rows] == [0, 1, 2]
    assert out["methods"]["vi-diag"]["summary"]["nll"]["mean"] == pytest.approx((7.0 + 1.1 + 2.1) / 3)
    assert out["differences"]["adam"]["ece"]["mean"] == pytest.approx((0.5 - 0.25) / 3)
    assert vp.run_paired("digits-mlp", res, args, None, 1) == {}  # no more seeds than the protocol's


def test_quick_run_records_the_paired_extra_and_the_readme_states_it(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    out = tmp_path / "v.json"
    vi.main(["--quick", "--skip-timing", "--tasks", "digits-mlp", "--methods", "vi-diag", "adam", "--seeds", "1",
             "--paired-seeds", "2", "--mc-samples", "2", "--long-epochs", "0", "--grid", "0.01", "--json", str(out)])
    report = json.loads(out.read_text())
    res = report["quality"]["digits-mlp"]
    paired = res["paired"]
    assert report["config"]["paired_seeds"] == 2 and paired["seeds"] == 2
    for m in ("vi-diag", "adam"):
        assert paired["methods"][m]["seeds"][0] == res["methods"][m]["seeds"][0]  # the protocol's seed-0 run
        assert [r["seed"] for r in paired["methods"][m]["seeds"]] == [0, 1]
    d = [v["ece"] - a["ece"] for v, a in zip(paired["methods"]["vi-diag"]["seeds"], paired["methods"]["adam"]["seeds"])]
    assert paired["differences"]["adam"]["ece"]["mean"] == pytest.approx(statistics.fmean(d))
    text = vp.paired_text(paired)
    assert f"VI diag − Adam: ECE {100 * statistics.fmean(d):+.2f}" in text
    assert text in "\n".join(summary._vi_quality_table(res, summary.VI_LABELS))
    assert text in vi.format_tables(report)


def test_long_run_has_the_issues_five_seeds_by_default() -> None:
    """Issue 27's protocol is 5 seeds for every setting, the 200-epoch run included."""
    assert vi.parse_args([]).long_seeds == 5
    assert vi.parse_args([]).paired_seeds == 20
    with pytest.raises(SystemExit):
        vi.parse_args(["--paired-seeds", "-1"])
