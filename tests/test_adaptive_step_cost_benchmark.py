"""benchmarks/adaptive_step_cost.py: a tiny run writes one row per model and optimizer, ratios to the same run's SGD/Adam."""
import json

import pytest

pytest.importorskip("sklearn")


def test_a_tiny_run_writes_every_row_with_ratios_to_its_own_baselines(tmp_path):
    from benchmarks import adaptive_step_cost

    out = tmp_path / "a.json"
    assert adaptive_step_cost.main(["--models", "mlp", "cnn", "--intervals", "1/2", "--rounds", "2", "--steps", "2",
                                    "--warmup", "1", "--no-plain", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["optimizer"]) for r in rows] == [
        (m, o) for m in ("mlp", "cnn") for o in ("sgd lr 0.1", "adam lr 0.01", "adaptive 1/2")]
    for r in rows:
        assert 0 < r["min_ms"] <= r["median_ms"]
        sgd, adam = (next(s for s in rows if s["model"] == r["model"] and s["optimizer"] == o)
                     for o in ("sgd lr 0.1", "adam lr 0.01"))
        assert r["min_over_sgd"] == pytest.approx(r["min_ms"] / sgd["min_ms"])
        assert r["min_over_adam"] == pytest.approx(r["min_ms"] / adam["min_ms"])


def test_malformed_intervals_are_refused_with_the_expected_form():
    from benchmarks import adaptive_step_cost

    with pytest.raises(SystemExit):
        adaptive_step_cost.main(["--intervals", "5x5"])


def test_the_dual_number_stepper_takes_the_forward_mode_path_and_restores_the_hand_written_one(monkeypatch):
    from benchmarks import adaptive_step_cost
    from benchmarks.kfac_robustness import load_data
    from torchsso2.optim import sequential_jvp

    calls = []
    original = sequential_jvp.sequential_jvps
    monkeypatch.setattr(sequential_jvp, "sequential_jvps", lambda *a, **k: calls.append(1) or original(*a, **k))
    data = load_data()
    point = {"damping": 0.01, "curv": 10 ** 9, "inv": 10 ** 9}
    for dual, expected in ((True, 0), (False, 2)):
        calls.clear()
        step = adaptive_step_cost.stepper("kfac-adaptive", point, "mlp", data["x_train"], data["y_train"], 32,
                                          dual_numbers=dual)
        step()
        step()
        assert len(calls) == expected
    assert sequential_jvp.supports_model is not adaptive_step_cost._never
