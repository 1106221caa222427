"""benchmarks/vi.py (with its task module benchmarks/vi_quality.py): the quick mode's one JSON (step
time, quality, long run), that the lr is chosen from validation data only, and that every method runs
at its library defaults except the lr."""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import vi
from benchmarks import vi_quality as q


def test_choose_lr_is_the_smallest_finite_validation_nll() -> None:
    assert q.choose_lr({0.1: 0.5, 0.01: 0.3, 0.001: 0.4}) == 0.01
    assert q.choose_lr({0.1: math.nan, 0.01: math.inf, 0.001: 2.0}) == 0.001  # non-finite never chosen
    assert q.choose_lr({0.1: 0.3, 0.01: 0.3}) == 0.1  # ties: the first in grid order
    assert q.choose_lr({0.1: math.inf, 0.01: math.nan}) is None


def test_run_method_chooses_by_validation_and_never_evaluates_test_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """Grid runs are scored on the validation split only; the test split is evaluated only for the
    chosen lr's seeds, after the choice."""
    calls = []
    val_nll = {0.1: 0.9, 0.2: 0.2, 0.3: 0.5}  # 0.2 is best on validation
    test_nll = {0.1: 0.01, 0.2: 9.0, 0.3: 9.0}  # ... and worst on test: a test-based chooser would pick 0.1

    def fake_train(task, method, split, lr, seed, epochs, batch, ivon_mod):  # noqa: ANN001
        return q.Trained(method, lr, seed, torch.nn.Linear(1, 1), None, [1e-3], 0, 0.0)

    def fake_evaluate(run, split, which, num_samples):  # noqa: ANN001
        calls.append((which, run.lr, run.seed))
        return {"nll": (val_nll if which == "val" else test_nll)[run.lr]}

    monkeypatch.setattr(q, "train", fake_train)
    monkeypatch.setattr(q, "evaluate", fake_evaluate)
    args = vi.parse_args(["--quick", "--grid", "0.1", "0.2", "0.3", "--seeds", "3", "--select-seeds", "1"])
    out = q.run_method("digits-mlp", "adam", None, args, None)
    assert out["chosen_lr"] == 0.2
    assert calls[:3] == [("val", 0.1, 0), ("val", 0.2, 0), ("val", 0.3, 0)]
    assert calls[3:] == [("test", 0.2, 0), ("test", 0.2, 1), ("test", 0.2, 2)]
    assert out["summary"]["nll"]["mean"] == 9.0


def test_lr_is_chosen_by_the_mean_validation_nll_over_the_selection_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``--select-seeds 3`` every grid value is trained on seeds 0, 1, 2 and scored by the mean of
    their validation NLLs: seed 0 alone would pick 0.1, the test split would pick 0.3, the mean picks
    0.2. The test split is evaluated only after the choice, and only at the chosen lr; the selection's
    runs of seeds 0–2 are reused as test seeds (not retrained), seeds 3 and 4 are trained."""
    trained, calls = [], []
    val_nll = {0.1: [0.10, 0.90, 0.90], 0.2: [0.30, 0.30, 0.30], 0.3: [0.50, 0.40, 0.60]}  # means 0.633 / 0.3 / 0.5
    test_nll = {0.1: 5.0, 0.2: 7.0, 0.3: 0.01}

    def fake_train(task, method, split, lr, seed, epochs, batch, ivon_mod):  # noqa: ANN001
        trained.append((lr, seed))
        return q.Trained(method, lr, seed, torch.nn.Linear(1, 1), None, [1e-3], 0, 0.0)

    def fake_evaluate(run, split, which, num_samples):  # noqa: ANN001
        calls.append((which, run.lr, run.seed))
        return {"nll": val_nll[run.lr][run.seed] if which == "val" else test_nll[run.lr] + run.seed}

    monkeypatch.setattr(q, "train", fake_train)
    monkeypatch.setattr(q, "evaluate", fake_evaluate)
    args = vi.parse_args(["--grid", "0.1", "0.2", "0.3", "--seeds", "5"])
    assert args.select_seeds == 3  # the default
    out = q.run_method("digits-mlp", "adam", None, args, None)
    assert out["chosen_lr"] == 0.2
    assert [g["val_nll"] for g in out["grid"]] == pytest.approx([1.9 / 3, 0.3, 0.5])
    assert [g["val_nll_seeds"] for g in out["grid"]] == [val_nll[lr] for lr in (0.1, 0.2, 0.3)]
    n_val = 9
    assert sorted(calls[:n_val]) == [("val", lr, s) for lr in (0.1, 0.2, 0.3) for s in range(3)]
    assert calls[n_val:] == [("test", 0.2, s) for s in range(5)]  # test only after the choice, at the choice
    assert trained == [(lr, s) for lr in (0.1, 0.2, 0.3) for s in range(3)] + [(0.2, 3), (0.2, 4)]
    assert [r["seed"] for r in out["seeds"]] == [0, 1, 2, 3, 4]
    assert out["summary"]["nll"]["mean"] == pytest.approx(7.0 + 2.0)


def test_a_seed_with_non_finite_validation_nll_rules_its_lr_out(monkeypatch: pytest.MonkeyPatch) -> None:
    val_nll = {0.1: [0.1, math.inf], 0.2: [0.5, 0.5]}
    monkeypatch.setattr(q, "train", lambda task, method, split, lr, seed, *a: q.Trained(
        method, lr, seed, torch.nn.Linear(1, 1), None, [1e-3], 0, 0.0))
    monkeypatch.setattr(q, "evaluate", lambda run, split, which, n: {"nll": val_nll[run.lr][run.seed]
                                                                     if which == "val" else 1.0})
    args = vi.parse_args(["--quick", "--grid", "0.1", "0.2", "--select-seeds", "2", "--edge-extensions", "0"])
    out = q.run_method("digits-mlp", "adam", None, args, None)
    assert out["chosen_lr"] == 0.2 and out["grid"][0]["val_nll"] == math.inf


def _stub_selection(monkeypatch: pytest.MonkeyPatch, val_nll, calls: list) -> None:  # noqa: ANN001
    """Stub task: ``train`` records (lr, seed), ``evaluate`` gives ``val_nll(lr)`` on validation and
    records every call; a test-split call during the selection would show up in ``calls``."""
    def fake_train(task, method, split, lr, seed, epochs, batch, ivon_mod):  # noqa: ANN001
        calls.append(("train", lr, seed))
        return q.Trained(method, lr, seed, torch.nn.Linear(1, 1), None, [1e-3], 0, 0.0)

    def fake_evaluate(run, split, which, num_samples):  # noqa: ANN001
        calls.append((which, run.lr, run.seed))
        return {"nll": val_nll(run.lr) if which == "val" else 1.0}

    monkeypatch.setattr(q, "train", fake_train)
    monkeypatch.setattr(q, "evaluate", fake_evaluate)


def test_extend_beyond_is_a_half_decade_step_rounded_like_the_grids() -> None:
    assert q.extend_beyond(0.001, -1) == 0.00032 and q.extend_beyond(0.001, 1) == 0.0032
    assert q.extend_beyond(0.32, 1) == 1.0 and q.extend_beyond(0.01, -1) == 0.0032
    assert q.extend_beyond(q.extend_beyond(0.01, -1), -1) == 0.001
    with pytest.raises(ValueError, match="direction"):
        q.extend_beyond(0.1, 0)


def test_grid_edge_rule_extends_the_low_end_twice_and_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation NLL falls with the lr everywhere: the grid's smallest value is chosen, so one
    half-decade value below is added, chosen again, one more, and then the rule stops (2 per end):
    the choice is the last extension and is still marked "(edge)". Only validation is read before the
    choice; the test split only at the chosen lr."""
    calls: list = []
    _stub_selection(monkeypatch, lambda lr: lr, calls)
    args = vi.parse_args(["--grid", "0.01", "0.032", "0.1", "--seeds", "3", "--select-seeds", "2"])
    assert args.edge_extensions == 2  # the default
    out = q.run_method("digits-mlp", "adam", None, args, None)
    assert [g["lr"] for g in out["grid"]] == [0.01, 0.032, 0.1, 0.0032, 0.001]
    assert [g["extension"] for g in out["grid"]] == [False, False, False, True, True]
    assert out["lr_grid"] == [0.001, 0.0032, 0.01, 0.032, 0.1]
    assert out["chosen_lr"] == 0.001 and out["chosen_at_grid_edge"] is True
    n_sel = 5 * 2 * 2  # 5 values × 2 seeds × (train + val)
    assert all(c[0] in ("train", "val") for c in calls[:n_sel])
    assert {c[1] for c in calls[:n_sel]} == {0.01, 0.032, 0.1, 0.0032, 0.001}
    assert [c for c in calls[n_sel:] if c[0] != "train"] == [("test", 0.001, s) for s in range(3)]


def test_grid_edge_rule_stops_when_the_extension_is_worse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Best on validation just above the grid's top (0.5): the top 0.32 is chosen, 1.0 is added and is
    worse, so 0.32 stays chosen, now inside the values tried: no more extension, no "(edge)"."""
    calls: list = []
    _stub_selection(monkeypatch, lambda lr: abs(math.log10(lr) - math.log10(0.5)), calls)
    args = vi.parse_args(["--grid", "0.1", "0.32", "--seeds", "1", "--select-seeds", "1"])
    out = q.run_method("digits-mlp", "sgd", None, args, None)
    assert [g["lr"] for g in out["grid"]] == [0.1, 0.32, 1.0]
    assert out["chosen_lr"] == 0.32 and out["chosen_at_grid_edge"] is False


def test_grid_edge_rule_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list = []
    _stub_selection(monkeypatch, lambda lr: lr, calls)
    args = vi.parse_args(["--grid", "0.01", "0.1", "--seeds", "1", "--select-seeds", "1", "--edge-extensions", "0"])
    out = q.run_method("digits-mlp", "adam", None, args, None)
    assert [g["lr"] for g in out["grid"]] == [0.01, 0.1]
    assert out["chosen_lr"] == 0.01 and out["chosen_at_grid_edge"] is True
    with pytest.raises(SystemExit):
        vi.parse_args(["--edge-extensions", "-1"])


def test_select_seeds_must_be_positive(capsys: pytest.CaptureFixture) -> None:
    assert vi.parse_args(["--select-seeds", "1"]).select_seeds == 1  # one seed: the seed-0 selection
    with pytest.raises(SystemExit):
        vi.parse_args(["--select-seeds", "0"])
    assert "--select-seeds" in capsys.readouterr().err.split("error:")[1]


def test_splits_are_disjoint_and_standardized_on_train() -> None:
    d = q.load_digits_split()
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (1149, 288, 360)
    assert torch.allclose(d.x_train.mean(0), torch.zeros(64), atol=1e-5)
    r = q.load_diabetes_split()
    assert len(r.y_train) + len(r.y_val) + len(r.y_test) == 442 and r.regression
    assert 0.2 < r.noise_var < 1.0  # the OLS residual variance of the standardized target
    x = torch.randn(200, 3, generator=torch.Generator().manual_seed(0))
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3 * torch.randn(200, 1, generator=torch.Generator().manual_seed(1))
    assert abs(q.ols_noise_variance(x, y) - 0.09) < 0.03


def test_gaussian_nll_matches_torch() -> None:
    m, v, y = torch.randn(10, 1), torch.rand(10, 1) + 0.1, torch.randn(10, 1)
    ref = torch.nn.functional.gaussian_nll_loss(m, y, v, full=True, reduction="mean")
    assert q.gaussian_nll(m, v, y) == pytest.approx(float(ref), rel=1e-6)


def test_quick_run_writes_one_json_with_timing_quality_and_long_run(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    out_json = tmp_path / "vq.json"
    assert vi.main(["--quick", "--tasks", "digits-mlp", "diabetes", "--methods", "vi-diag", "adam",
                    "--epochs", "1", "--seeds", "2", "--mc-samples", "2", "--long-epochs", "1", "--repeats", "2",
                    "--window", "1", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "| method | lr | accuracy | NLL | ECE | Brier | skipped |" in printed
    report = json.loads(out_json.read_text())
    assert report["config"]["quick"] and report["config"]["seeds"] == 2 and report["config"]["select_seeds"] == 2
    timing = {(r["model"], r["optimizer"]): r for r in report["timing"]}
    assert set(timing) == {(m, o) for m in vi.TIMING_TASKS for o in ("vi-diag", "adam", vi.FLOOR)}
    for (model, name), r in timing.items():
        assert len(r["times_s"]) == 2 and r["min_s"] <= r["median_s"]
        assert r["ratio_adam_min"] == pytest.approx(r["min_s"] / timing[(model, "adam")]["min_s"])
        assert r["skipped_steps"] == 0
    assert set(report["quality"]) == {"digits-mlp", "diabetes"}
    for task, res in report["quality"].items():
        assert set(res["methods"]) == {"vi-diag", "adam"}
        for m, r in res["methods"].items():
            base = [g["lr"] for g in r["grid"] if not g["extension"]]
            assert base == list(q.LR_GRIDS[m]) and len(r["grid"]) <= len(base) + 4  # at most 2 per end
            assert r["lr_grid"] == sorted(g["lr"] for g in r["grid"]) and r["chosen_lr"] in r["lr_grid"]
            assert r["chosen_lr"] == min(r["grid"], key=lambda g: g["val_nll"])["lr"]
            for g in r["grid"]:  # quick: the mean over 2 selection seeds
                assert len(g["val_nll_seeds"]) == 2 and g["val_nll"] == pytest.approx(sum(g["val_nll_seeds"]) / 2)
            assert [s["seed"] for s in r["seeds"]] == [0, 1]
            assert isinstance(r["chosen_at_grid_edge"], bool)
        keys = {"accuracy", "nll", "ece", "brier"} if task == "digits-mlp" else {"nll", "rmse"}
        assert set(res["methods"]["adam"]["summary"]) == keys
        assert res["targets"]["evaluated"] is True  # vi-diag and adam present; ivon not requested
    ent = report["quality"]["digits-mlp"]["methods"]["vi-diag"]["entropy"]
    assert set(ent["entropy_ood"]) == {"rotated90", "flipped", "noise", "gaussian_noise"}
    assert "noise_var" in report["quality"]["diabetes"]
    splits = report["regression_splits"]  # quick: 2 random diabetes splits, one seed each
    assert splits["splits_used"] == [0, 1] and set(splits["summary"]) == {"vi-diag", "adam"}
    assert set(splits["paired"]) == {"adam"} and splits["paired"]["adam"]["test"]["n"] == 2
    assert "diabetes over 2 random splits" in printed
    cls = report["classification_splits"]  # quick: 2 random splits of each digits task run, one seed each
    assert set(cls) == {"digits-mlp"} and cls["digits-mlp"]["task"] == "digits-mlp"
    assert cls["digits-mlp"]["splits_used"] == [0, 1]
    assert set(cls["digits-mlp"]["summary"]["vi-diag"]) == {"test_nll", "val_nll", "test_ece", "test_accuracy"}
    assert cls["digits-mlp"]["paired"]["adam"]["test_ece"]["n"] == 2
    assert "digits-mlp over 2 random splits" in printed
    long = report["long"]["digits-mlp"]
    assert long["epochs"] == 1 and set(long["methods"]) == {"vi-diag", "adam"}
    assert all(len(r["seeds"]) == 1 for r in long["methods"].values())
    from benchmarks import _readme_summary as summary

    readme = "\n".join(summary._vi([(out_json, report, 0.0)], []))  # the README's generated text states the selection
    assert "lr per method from a small grid by the mean validation NLL over seeds 0–1 (a choice at an end of the " \
        "values tried adds one half-decade value beyond it, at most 2 per end), then 2 seeds" in " ".join(readme.split())


def test_regression_splits_choose_by_validation_on_each_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/vi_splits.py: split k is ``load_diabetes_split(seed=k)``; on each split every method's lr
    is the one with the smallest validation NLL of that split, its test NLL is that run's, and the paired
    differences are VI diag − reference over the same splits (mean, standard error, count of VI ≤ ref)."""
    from benchmarks import vi_splits

    loaded = []
    val = {("vi-diag", 0): {0.1: 1.0, 0.2: 0.5}, ("adam", 0): {0.1: 0.4, 0.2: 0.9},
           ("vi-diag", 1): {0.1: 0.3, 0.2: 0.5}, ("adam", 1): {0.1: 0.8, 0.2: 0.6}}
    test = {("vi-diag", 0, 0.2): 2.0, ("adam", 0, 0.1): 2.5, ("vi-diag", 1, 0.1): 3.0, ("adam", 1, 0.2): 2.0}

    def fake_load(seed: int = 0) -> q.Split:
        loaded.append(seed)
        t = torch.full((1, 1), float(seed))
        return q.Split(t, t, t, t, t, t, regression=True)

    def fake_train(task, method, split, lr, seed, epochs, batch, ivon_mod):  # noqa: ANN001
        assert seed == 0 and task == "diabetes"
        return q.Trained(method, lr, int(split.x_train), torch.nn.Linear(1, 1), None, [1e-3], 0, 0.0)

    def fake_evaluate(run, split, which, num_samples):  # noqa: ANN001
        k = int(split.x_train)
        nll = val[(run.method, k)][run.lr] if which == "val" else test[(run.method, k, run.lr)]
        return {"nll": nll, "rmse": 1.0}

    monkeypatch.setattr(q, "load_diabetes_split", fake_load)
    monkeypatch.setattr(q, "train", fake_train)
    monkeypatch.setattr(q, "evaluate", fake_evaluate)
    args = vi.parse_args(["--quick", "--grid", "0.1", "0.2", "--edge-extensions", "0"])  # 2 values: both ends
    res = vi_splits.run_splits(args, None, ["vi-diag", "adam"], 2)
    assert loaded == [0, 1]
    assert [{m: v["lr"] for m, v in r["methods"].items()} for r in res["splits"]] == \
        [{"vi-diag": 0.2, "adam": 0.1}, {"vi-diag": 0.1, "adam": 0.2}]
    p = res["paired"]["adam"]
    assert p["test"]["mean"] == pytest.approx(0.25) and p["test"]["se"] == pytest.approx(0.75)  # diffs -0.5, +1.0
    assert p["test"]["vi_at_least_as_good"] == 1 and p["val"]["mean"] == pytest.approx(-0.1)  # +0.1, -0.3
    assert res["summary"]["adam"]["test_nll"]["mean"] == pytest.approx(2.25)
    with pytest.raises(ValueError, match="num_splits"):
        vi_splits.run_splits(args, None, ["vi-diag"], 0)


def test_classification_splits_load_each_split_and_pair_nll_and_ece(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/vi_splits.py on a digits task: split k is ``load_task(task, seed=k)``; per split the chosen
    run's test NLL, ECE and accuracy are kept, and the paired differences cover the NLL and the ECE."""
    from benchmarks import vi_splits

    loaded = []
    ece = {("vi-diag", 0): 0.01, ("adam", 0): 0.03, ("vi-diag", 1): 0.04, ("adam", 1): 0.02}

    def fake_load(task: str, seed: int = 0) -> q.Split:
        loaded.append((task, seed))
        t = torch.full((1, 1), float(seed))
        return q.Split(t, t, t, t, t, t)

    def fake_train(task, method, split, lr, seed, epochs, batch, ivon_mod):  # noqa: ANN001
        assert seed == 0 and task == "digits-cnn"
        return q.Trained(method, lr, int(split.x_train), torch.nn.Linear(1, 1), None, [1e-3], 0, 0.0)

    def fake_evaluate(run, split, which, num_samples):  # noqa: ANN001
        k = int(split.x_train)
        return {"nll": 0.1 * (k + 1) + (0.05 if run.method == "adam" else 0.0) + (0.0 if which == "val" else 0.2),
                "ece": ece[(run.method, k)], "accuracy": 0.9, "brier": 0.1}

    monkeypatch.setattr(q, "load_task", fake_load)
    monkeypatch.setattr(q, "train", fake_train)
    monkeypatch.setattr(q, "evaluate", fake_evaluate)
    args = vi.parse_args(["--quick", "--grid", "0.1", "--edge-extensions", "0"])
    res = vi_splits.run_splits(args, None, ["vi-diag", "adam"], 2, "digits-cnn")
    assert loaded == [("digits-cnn", 0), ("digits-cnn", 1)] and res["task"] == "digits-cnn"
    assert res["splits"][1]["methods"]["vi-diag"] == {"lr": 0.1, "val_nll": pytest.approx(0.2),
                                                     "test_nll": pytest.approx(0.4), "accuracy": 0.9, "ece": 0.04}
    p = res["paired"]["adam"]
    assert p["test"]["mean"] == pytest.approx(-0.05) and p["test"]["vi_at_least_as_good"] == 2
    assert p["test_ece"]["mean"] == pytest.approx(0.0) and p["test_ece"]["se"] == pytest.approx(0.02)  # -0.02, +0.02
    assert p["test_ece"]["vi_at_least_as_good"] == 1
    assert res["summary"]["adam"]["test_ece"]["mean"] == pytest.approx(0.025)
    text = vi_splits.format_splits(res)
    assert "digits-cnn over 2 random splits" in text and "test ECE +0.00 ± 2.00 pp, vi-diag ≤ adam on 1/2" in text
    with pytest.raises(ValueError, match="task="):
        vi_splits.run_splits(args, None, ["vi-diag"], 1, "mnist")


def test_diabetes_split_seeds_give_different_test_examples() -> None:
    a, b = q.load_diabetes_split(seed=0), q.load_diabetes_split(seed=1)
    assert a.x_test.shape == b.x_test.shape and not torch.equal(a.x_test, b.x_test)


def test_quick_without_json_writes_into_a_temp_dir_made_when_it_writes(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(vi.tempfile, "tempdir", str(tmp_path))  # parse_args alone (tests, --help) leaves no dir
    assert vi.parse_args(["--quick"]).json is None and not list(tmp_path.iterdir())
    assert vi.parse_args([]).json == vi.DEFAULT_JSON
    assert vi.parse_args([]).long_epochs == 200 and vi.parse_args([]).seeds == 5
    assert vi.parse_args([]).regression_splits == 20 and vi.parse_args(["--quick"]).regression_splits == 2
    assert vi.parse_args([]).classification_splits == 20 and vi.parse_args(["--quick"]).classification_splits == 2


def test_methods_at_library_defaults_except_lr() -> None:
    from torchsso2 import VIOptimizer

    model = q.make_model("digits-mlp")
    diag = q.make_optimizer("vi-diag", model, 0.05, 100, False, 0, None)
    ref = VIOptimizer(q.make_model("digits-mlp"), dataset_size=100)
    assert isinstance(diag, VIOptimizer) and diag.param_groups[0]["lr"] == 0.05 and diag.dataset_size == 100
    for attr in ("prior_precision", "kl_weighting", "damping", "num_mc_samples", "ema_decay", "reparam",
                 "curvature_init", "kl_clip"):
        assert getattr(diag, attr) == getattr(ref, attr), attr
    assert diag.reparam  # the diag default: curvature from the same backward
    assert q.make_optimizer("vi-kfac", q.make_model("digits-mlp"), 0.05, 100, False, 0, None).engine.approx != \
        diag.engine.approx
    assert not q.make_optimizer("vi-fisher-mc", q.make_model("digits-mlp"), 0.05, 100, False, 0, None).reparam
    reg = q.make_optimizer("vi-diag", q.make_model("diabetes"), 0.05, 100, True, 0, None)
    assert reg.engine.loss.value == "mse" and reg.noise.learned
    assert "vi-fisher-mc" not in vi.parse_args([]).methods
    with pytest.raises(ValueError, match="method="):
        q.make_optimizer("lbfgs", model, 0.1, 100, False, 0, None)


def test_ivon_predictions_do_not_depend_on_the_global_random_state() -> None:
    """IVON samples its weights from torch's global generator; the benchmark seeds it per run (as VI's
    own generator is seeded), so a run's BMA is the same whatever ran before it, and the caller's
    global random state is left as it was."""
    ivon = pytest.importorskip("ivon")
    split = q.load_digits_split()
    run = q.train("digits-mlp", "ivon", split, 0.1, 3, 1, 64, ivon)
    torch.manual_seed(1)
    first = q.output_samples(run, split.x_val, 4)
    after_first = torch.rand(3)
    torch.manual_seed(2)
    torch.rand(100)  # another run's training or evaluation in between
    second = q.output_samples(run, split.x_val, 4)
    assert torch.equal(first, second)
    assert not torch.equal(first[0], first[1])  # still four different weight samples
    torch.manual_seed(1)
    q.output_samples(run, split.x_val, 4)
    assert torch.equal(torch.rand(3), after_first)  # the global generator is not advanced


# ------------------------------------------------------------------------------------------------
# evaluation of the non-VI methods (IVON / point estimates) against hand formulas in float64
# ------------------------------------------------------------------------------------------------
class _FakeIVON:
    """IVON stand-in: ``sampled_params()`` moves ``model.weight`` by the next of fixed ``shifts`` (in
    turn), so the S "posterior samples" are known exactly."""

    def __init__(self, model: torch.nn.Module, shifts: list) -> None:
        self.model, self.shifts, self.k = model, shifts, 0

    @contextlib.contextmanager
    def sampled_params(self):  # noqa: ANN201
        d = self.shifts[self.k % len(self.shifts)]
        self.k += 1
        with torch.no_grad():
            self.model.weight += d
        try:
            yield
        finally:
            with torch.no_grad():
                self.model.weight -= d


_SHIFTS = [torch.tensor([[0.3, -0.2]]), torch.tensor([[-0.1, 0.5]]), torch.tensor([[0.7, 0.1]]),
           torch.tensor([[-0.4, -0.6]])]


def _run(method: str, model: torch.nn.Module, opt=None) -> q.Trained:  # noqa: ANN001
    return q.Trained(method=method, lr=0.1, seed=0, model=model, opt=opt, step_seconds=[], skipped=0, final_loss=0.0)


def _regression_fixture():  # noqa: ANN202
    """A fixed ``Linear(2, 1)`` f(x) = W x + b and a small regression split with noise_var 0.37 (σ ≠ 1) and
    y_scale 3.5 (≠ 1), so a missing σ, σ² or unit conversion changes the numbers."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.8, -1.3]]))
        model.bias.fill_(0.25)
    x, xv, xt = (torch.randn(n, 2, generator=g) for n in (7, 5, 6))
    y, yv, yt = (torch.randn(n, 1, generator=g) for n in (7, 5, 6))
    split = q.Split(x, y, xv, yv, xt, yt, regression=True, noise_var=0.37, y_scale=3.5)
    w, b = model.weight.detach().double().numpy(), float(model.bias.detach())

    def f(xx: torch.Tensor, dw=np.zeros((1, 2))) -> np.ndarray:  # noqa: ANN001
        return xx.double().numpy() @ (w + dw).T + b

    return model, split, f


def test_ivon_regression_predictive_is_the_moment_matched_mixture() -> None:
    """IVON's regression predictive (module docstring): mean σ·mean_s f_s, variance σ² + σ²·var_s f_s
    (population variance, ddof 0, of the S sampled means). Reference: numpy float64 on the four known
    weight shifts; 1e-6 covers the float32 forward pass."""
    model, split, f = _regression_fixture()
    sig = math.sqrt(split.noise_var)
    fs = np.stack([f(split.x_test, s.double().numpy()) for s in _SHIFTS])  # [S, N, 1]
    assert fs.var(0, ddof=0).min() > 1e-2  # the spread term is not negligible
    mean, var = q.regression_predictive(_run("ivon", model, _FakeIVON(model, _SHIFTS)), split, split.x_test, 4)
    np.testing.assert_allclose(mean.double().numpy(), sig * fs.mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(var.double().numpy(), split.noise_var + sig ** 2 * fs.var(0, ddof=0),
                               rtol=1e-6, atol=1e-6)


def test_evaluate_reports_regression_nll_and_rmse_in_original_units() -> None:
    """``evaluate`` on a regression split: NLL and RMSE of the moment-matched Gaussian in the target's
    original units (y·y_scale, mean·y_scale, sd·y_scale; the NLL is shift-invariant so y_mean is moot).
    Reference: scipy.stats.norm.logpdf and numpy in float64 on the same hand predictive as above."""
    from scipy.stats import norm

    model, split, f = _regression_fixture()
    sig, ys = math.sqrt(split.noise_var), split.y_scale
    fs = np.stack([f(split.x_test, s.double().numpy()) for s in _SHIFTS])
    m, v = sig * fs.mean(0), split.noise_var + sig ** 2 * fs.var(0, ddof=0)
    yt = split.y_test.double().numpy()
    r = q.evaluate(_run("ivon", model, _FakeIVON(model, _SHIFTS)), split, "test", 4)
    assert r["nll"] == pytest.approx(-norm.logpdf(yt * ys, m * ys, np.sqrt(v) * ys).mean(), rel=1e-6)
    assert r["rmse"] == pytest.approx(np.sqrt(((m - yt) ** 2).mean()) * ys, rel=1e-6)


def test_point_estimate_regression_variance_is_its_validation_residual_variance() -> None:
    """A point estimate (adam): mean σ·f(x), variance the mean squared validation residual
    mean((y_val − σ·f(x_val))²) — not the variance of y_val around its own mean. Reference: numpy."""
    model, split, f = _regression_fixture()
    sig = math.sqrt(split.noise_var)
    mean, var = q.regression_predictive(_run("adam", model), split, split.x_test, 4)
    np.testing.assert_allclose(mean.double().numpy(), sig * f(split.x_test), rtol=1e-6, atol=1e-6)
    resid = float(((split.y_val.double().numpy() - sig * f(split.x_val)) ** 2).mean())
    assert abs(resid - float(split.y_val.double().var(unbiased=False))) > 1e-2  # the two readings differ
    np.testing.assert_allclose(var.double().numpy(), np.full((6, 1), resid), rtol=1e-6)


def test_ivon_class_probs_average_the_softmax_of_each_sample() -> None:
    """The classification BMA of IVON's samples is the mean of the S softmaxes, not the softmax of the
    mean logits. Reference: numpy softmax of each shifted weight's logits, averaged (float64; 1e-6
    covers the float32 forward pass; shifts of scale 2 make the two readings differ by far more)."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(2, 3)
    xt = torch.randn(6, 2, generator=g)
    shifts = [torch.randn(3, 2, generator=g) * 2 for _ in range(4)]
    per_sample = []
    for s in shifts:
        z = torch.nn.functional.linear(xt, model.weight + s, model.bias).detach().double().numpy()
        e = np.exp(z - z.max(1, keepdims=True))
        per_sample.append(e / e.sum(1, keepdims=True))
    p = q.class_probs(_run("ivon", model, _FakeIVON(model, shifts)), xt, 4)
    np.testing.assert_allclose(p.double().numpy(), np.mean(per_sample, 0), rtol=1e-6, atol=1e-6)


def test_mean_std_is_the_mean_and_sample_std() -> None:
    """The tables' "mean ± std": statistics of the seeds, std with ddof 1. Reference: numpy."""
    vals = [0.1, 0.4, 0.35, 0.9]
    ms = q.mean_std(vals)
    assert ms["mean"] == pytest.approx(np.mean(vals), rel=1e-12)
    assert ms["std"] == pytest.approx(np.std(vals, ddof=1), rel=1e-12)
    assert q.mean_std([0.3]) == {"mean": 0.3, "std": 0.0}


def test_entropies_are_mean_predictive_entropies_on_test_and_ood_sets() -> None:
    """``entropies``: the MEAN predictive entropy (nats) over the test digits and over each OOD set
    (examples.bayesian_digits.ood_sets of the test images), and the reliability data of the same test
    probabilities. Reference: scipy.stats.entropy (natural log) of a point-estimate model's softmax,
    averaged with numpy; rtol 1e-6 covers the float32 softmax."""
    from scipy.stats import entropy

    from examples.bayesian_digits import ood_sets

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10)
    xt, yt = torch.randn(30, 64, generator=g), torch.randint(0, 10, (30,), generator=g)
    split = q.Split(xt, yt, xt, yt, xt, yt)

    def h(x: torch.Tensor) -> float:
        with torch.no_grad():
            return float(np.mean(entropy(torch.softmax(model(x), -1).double().numpy(), axis=1)))

    ent, rel = q.entropies(_run("adam", model), split, 4)
    assert ent["entropy_test"] == pytest.approx(h(xt), rel=1e-6)
    sets = ood_sets(xt.reshape(-1, 1, 8, 8), 0, gaussian_noise=True)
    assert set(ent["entropy_ood"]) == set(sets)
    for k, v in sets.items():
        assert ent["entropy_ood"][k] == pytest.approx(h(v.reshape(30, 64)), rel=1e-6), k
    assert int(rel.bin_count.sum()) == 30
