"""Every factual claim README.md makes, checked against the generated results and the code.

* The results block (between the ``results:`` markers) is exactly what
  :func:`benchmarks._readme_summary.render` makes of ``benchmarks/results/*.json``: every number and
  every sentence in it (step time, time to accuracy, VI, predictive entropy, peers, scaling) comes
  from the JSONs, none is hand-written.
* The predictive-entropy sentence states, per method, exactly which out-of-distribution sets have a
  higher mean entropy than the test digits in the JSON.
* The reliability diagram the README links is the one drawn by the run whose table it shows.
* The curvature feature list (which kinds come as full / diagonal / K-FAC blocks) is what
  ``curvature.compute`` does.
* "agrees with BackPACK, curvlinops, laplace-torch and ASDL to ≤ X" holds in ``peers_curvature.json``.
* "matches kfac_pytorch 0.4.2 to ≤ X" is the tolerance the kfac_pytorch comparison test asserts.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import curvature
from benchmarks import _readme_summary as summary

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
RESULTS = ROOT / "benchmarks" / "results"


def _block(text: str) -> str:
    return text[text.index(summary.BEGIN) + len(summary.BEGIN):text.index(summary.END)].strip("\n")


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_results_block_is_generated_from_the_jsons() -> None:
    assert _block(README) == summary.render(RESULTS).strip("\n"), \
        "README's results block differs from the JSONs: run `python -m benchmarks.run --report-only`"


def _quality() -> dict:
    src = summary._vi_source(summary.load_sources(RESULTS, "vi*.json"))
    assert src is not None, "benchmarks/results holds benchmarks/vi.py's JSON"
    return src[1]


def test_entropy_sentence_states_what_the_json_shows() -> None:
    report = _quality()
    entropies = summary.vi_entropies(report)
    verdicts = summary.entropy_verdicts(entropies)
    assert {"vi-diag", "vi-kfac"} <= set(verdicts), "the quality run records predictive entropies"
    text = _flat(_block(README))
    labels = {"vi-diag": summary.VI_LABELS["vi-diag"], "vi-kfac": summary.VI_LABELS["vi-kfac"]}
    for method, label in labels.items():
        low = [o for o, higher in verdicts[method].items() if not higher]
        said = "higher on all of them" if not low else f"not higher on {', '.join(low)}"
        assert f"{label}: {said}" in text
        q = entropies[method]
        for o in low:  # the claim is the numbers: an OOD entropy at or below the test-digit entropy
            assert q["entropy_ood"][o] <= q["entropy_test"]
    assert "higher than on test digits for both VI methods" not in text or \
        all(all(v.values()) for k, v in verdicts.items() if k in labels)


def test_reliability_png_comes_from_the_table_run() -> None:
    report = _quality()
    block = _block(README)
    if "reliability_digits.png" in block:
        assert Path(report["config"]["plot"]).name == "reliability_digits.png"
        assert (ROOT / "docs" / "reliability_digits.png").exists()


def _curvature_claim() -> str:
    m = re.search(r"\*\*`curvature`\*\* — (.*?)(?:\n\* )", README, re.S)
    assert m, "README lists what curvature computes"
    return _flat(m.group(1))


def test_curvature_kinds_and_shapes_are_what_readme_says() -> None:
    claim = _curvature_claim()
    assert "Fisher (exact = GGN, Monte-Carlo) and empirical Fisher, each as a full, diagonal or K-FAC block" in claim
    assert "the Hessian as a full or diagonal block" in claim and "K-FAC of the Hessian raises `NotImplementedError`" \
        in claim
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    for kind in ("fisher", "fisher_mc", "empirical_fisher"):
        for approx in ("full", "diag", "kfac"):
            curvature.compute(model, x, y, loss="cross_entropy", kind=kind, approx=approx)
    for approx in ("full", "diag"):
        curvature.compute(model, x, y, loss="cross_entropy", kind="hessian", approx=approx)
    with pytest.raises(NotImplementedError):
        curvature.compute(model, x, y, loss="cross_entropy", kind="hessian", approx="kfac")


def test_peer_agreement_bound_holds_in_the_json() -> None:
    m = re.search(r"agrees\s+with BackPACK, curvlinops, laplace-torch and ASDL to ≤ ([0-9.e-]+)", README)
    assert m, "README states a bound on the agreement with the peers"
    bound = float(m.group(1))
    rows = json.loads((RESULTS / "peers_curvature.json").read_text(encoding="utf-8"))["results"]
    diffs = [r["max_rel_diff"] for r in rows if r.get("max_rel_diff") is not None
             and r["peer"] in ("backpack", "curvlinops", "laplace", "asdl")]
    assert diffs and max(diffs) <= bound
    assert {r["peer"] for r in rows if r.get("max_rel_diff") is not None} >= {"backpack", "curvlinops", "laplace",
                                                                              "asdl"}


def test_kfac_pytorch_bound_is_the_tested_tolerance() -> None:
    m = re.search(r"matches\s+kfac_pytorch 0\.4\.2 to ≤ ([0-9.e-]+)", README)
    assert m, "README states a bound on the agreement with kfac_pytorch"
    src = (ROOT / "tests" / "test_kfac_preconditioner.py").read_text(encoding="utf-8")
    test = src[src.index("def test_matches_kfac_pytorch"):]
    test = test[:test.index("\ndef ")]
    tol = re.search(r"assert worst <= ([0-9.e-]+)", test)
    assert tol and float(tol.group(1)) <= float(m.group(1))


def test_vi_table_states_the_json_numbers_and_targets() -> None:
    """Each VI diag quality cell of README is the JSON's mean, and each target verdict is the JSON's."""
    report = _quality()
    text = _flat(_block(README))
    for task, res in report["quality"].items():
        s = res["methods"]["vi-diag"]["summary"]
        assert f"{s['nll']['mean']:.3f} ± {s['nll']['std']:.3f}" in text, task
        for key, v in res["targets"].items():
            if isinstance(v, dict):
                assert summary._target_text(key, v) in text, (task, key)


def test_reliability_png_uses_the_table_predictions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/vi.py draws the reliability diagrams from the same probabilities as the seed-0 ECE of its
    digits-MLP table."""
    pytest.importorskip("sklearn")
    import torchsso2.plotting
    from benchmarks import vi

    drawn = {}
    monkeypatch.setattr(torchsso2.plotting, "save_reliability_diagram",
                        lambda data, path, title=None: drawn.update(data) or Path(path))
    out = tmp_path / "v.json"
    vi.main(["--quick", "--skip-timing", "--tasks", "digits-mlp", "--methods", "vi-diag", "sgd", "--seeds", "1",
             "--mc-samples", "2", "--long-epochs", "0", "--grid", "0.01", "--plot", str(tmp_path / "r.png"),
             "--json", str(out)])
    report = json.loads(out.read_text())
    assert set(drawn) == {"vi-diag", "sgd"}
    for name, rel in drawn.items():
        seed0 = report["quality"]["digits-mlp"]["methods"][name]["seeds"][0]
        assert float(rel.ece) == pytest.approx(seed0["ece"], abs=1e-12)
    assert report["config"]["plot"] == str(tmp_path / "r.png")


def test_vi_step_time_header_names_when_and_under_which_load_the_step_times_were_measured() -> None:
    """A ``--skip-timing`` re-run of benchmarks/vi.py that keeps an earlier run's step times stamps
    them with that run's date and load (``config.timing_*``), not with the quality run's."""
    quality_run = {"config": {"load_average_before": [9.4], "load_average_after": [3.5]}}
    assert summary._timing_stamp((Path("vi.json"), quality_run, 1795591945.0)) == \
        "2026-11-25 07:32 UTC, 1-min load average 9.4 before, 3.5 after"
    kept = {"config": {"load_average_before": [9.4], "load_average_after": [3.5],
                       "timing_measured_at_unix": 1795590299.0,
                       "timing_load_average_before": [2.4], "timing_load_average_after": [10.1]}}
    assert summary._timing_stamp((Path("vi.json"), kept, 1795591945.0)) == \
        "2026-11-25 07:04 UTC, 1-min load average 2.4 before, 10.1 after"
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    report = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/vi.json").read_text())
    if report.get("timing"):
        assert summary._timing_stamp((Path("vi.json"), report, report["measured_at_unix"])) in readme.replace("\n", " ")


def test_vi_regression_splits_lines_state_the_paired_differences() -> None:
    """The README renders benchmarks/vi_splits.py's paired differences from the JSON, and nothing when a
    vi.json has no ``regression_splits`` part."""
    from benchmarks import vi_splits

    rows = [{"split": k, "methods": {"vi-diag": {"lr": 1e-3, "val_nll": 5.40 + 0.01 * k, "test_nll": 5.44 + 0.02 * k},
                                     "adam": {"lr": 1e-3, "val_nll": 5.41, "test_nll": 5.45}}} for k in range(3)]
    res = {"num_splits": 3, "epochs": 50, "splits": rows, **vi_splits.summarize_splits(rows)}
    text = "\n".join(summary.vi_splits_lines(res, dict(summary.VI_LABELS)))
    assert f"{summary.VI_TASKS['diabetes']} over 3 random splits" in text
    # VI − Adam on test: -0.01, +0.01, +0.03: mean +0.0100, se 0.02/sqrt(3) = 0.0115; VI <= Adam on 1 of 3
    assert f"{summary.VI_LABELS['adam']}: NLL +0.0100 ± 0.0115 on test (VI diag at least as good on 1 of 3 splits)" \
        in text
    assert "ECE" not in text  # regression: NLL only
    assert summary.vi_splits_lines({}, dict(summary.VI_LABELS)) == []
    for row in rows:  # a digits task: ECE and accuracy too
        for m, e in (("vi-diag", 0.02), ("adam", 0.03)):
            row["methods"][m].update(ece=e, accuracy=0.97)
    res = {"task": "digits-cnn", "num_splits": 3, "epochs": 15, "splits": rows, **vi_splits.summarize_splits(rows)}
    text = "\n".join(summary.vi_splits_lines(res, dict(summary.VI_LABELS)))
    assert f"{summary.VI_TASKS['digits-cnn']} over 3 random splits" in text
    assert "ECE -1.00 ± 0.00 pp on test (at least as good on 3 of 3)" in text and "| 2.00 ± 0.00 | 97.00 |" in text


def test_every_test_the_docs_cite_exists() -> None:
    # docs/validation.md and friends name tests as evidence; a renamed or merged test must be renamed there too
    root = Path(__file__).resolve().parents[1]
    cited = set()
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        cited |= {n for n in re.findall(r"`(test_\w+)", doc.read_text()) if not n.endswith("_")}  # `test_x_...`
    defined = set()
    for src in (root / "tests").rglob("*.py"):
        defined |= set(re.findall(r"def (test_\w+)", src.read_text()))
        defined.add(src.stem)
    assert cited and not sorted(cited - defined)


def test_entropy_verdict_is_strictly_higher() -> None:
    """A set whose mean entropy equals the test digits' (0.5 vs 0.5) is not "higher"; 0.6 is, 0.4 is not."""
    verdicts = summary.entropy_verdicts({"vi": {"entropy_test": 0.5, "entropy_ood": {"noise": 0.5, "flip": 0.6,
                                                                                     "inv": 0.4}}})
    assert verdicts == {"vi": {"noise": False, "flip": True, "inv": False}}


def test_summary_helpers_on_hand_made_inputs() -> None:
    """The freshest source (load_sources sorts most recent first) supplies a (model, batch) row, an older
    one only the rows the newer lacks; _range spans min–max (one value when they round alike); _per is
    ours / theirs; _x keeps three significant digits."""
    new = (Path("new.json"), {"timing": [{"model": "m", "batch": 1}]}, 2.0)
    old = (Path("old.json"), {"timing": [{"model": "m", "batch": 1}, {"model": "m", "batch": 2}]}, 1.0)
    chosen = summary._freshest_rows([new, old], "timing")
    assert chosen[("m", 1)] is new and chosen[("m", 2)] is old
    assert summary._range([0.5, 1.234, 12.0]) == "0.50–12" and summary._range([1.0, 1.001]) == "1.00"
    assert summary._per({"min_s": 2.0}, {"min_s": 4.0}) == "0.50" and summary._per(None, {"min_s": 1.0}) == ""
    assert summary._x(12.34) == "12.3×" and summary._x(1.234) == "1.23×" and summary._x(None) == ""


def test_time_to_accuracy_sentence_of_a_hand_made_run() -> None:
    """K-FAC reaches on 2 of 3 seeds (median 3 epochs, 0.5 s), SGD in 8 epochs / 2.0 s, Adam in 6 / 1.0 s:
    by hand its wall time is 0.5 / 2.0 = 0.25× SGD's and 0.5 / 1.0 = 0.50× Adam's."""
    conv = {"target": 0.97, "batch_size": 32, "max_epochs": 20, "seeds": [0, 1, 2], "best": {
        "sgd": {"lr": 0.1, "momentum": 0.9, "reached": 3, "epochs_per_seed": [8, 8, 8], "epochs_to_target": 8,
                "wall_to_target_s": 2.0},
        "adam": {"lr": 0.01, "reached": 3, "epochs_per_seed": [6, 6, 6], "epochs_to_target": 6,
                 "wall_to_target_s": 1.0},
        "sso-kfac": {"lr": 0.05, "reached": 2, "epochs_per_seed": [3, None, 3], "epochs_to_target": 3,
                     "wall_to_target_s": 0.5}}}
    text = "\n".join(summary._time_to_accuracy([(Path("s.json"), {"convergence": conv}, 0.0)]))
    assert ("K-FAC (factored damping) needs 3 epochs to SGD's 8 and Adam's 6; its wall time to the target is "
            "0.25× SGD's and 0.50× Adam's.") in text
    assert "| 3/3 |" in text and "| 3 – 3 |" in text
