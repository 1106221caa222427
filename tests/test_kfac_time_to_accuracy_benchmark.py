"""benchmarks/kfac_time_to_accuracy.py (issue 30, speed): CLI, selection and target logic, report."""
from __future__ import annotations

import json
import math

import pytest

from benchmarks import kfac_time_to_accuracy as bench


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--help"])
    assert info.value.code == 0
    assert "--quick" in capsys.readouterr().out


def _summary(epochs, seconds):
    return {"summary": bench.summarize([{"epochs": e, "seconds": s} for e, s in zip(epochs, seconds)])}


def test_summarize_counts_a_missed_seed_as_infinite():
    s = bench.summarize([{"epochs": 3, "seconds": 0.3}, {"epochs": None, "seconds": None},
                         {"epochs": 5, "seconds": 0.2}])
    assert s["median_epochs"] == 5 and s["median_seconds"] == 0.3 and s["reached"] == 2
    s = bench.summarize([{"epochs": None, "seconds": None}, {"epochs": None, "seconds": None},
                         {"epochs": 5, "seconds": 0.2}])
    assert s["median_epochs"] is None and s["median_seconds"] is None


def test_targets_compare_epochs_and_the_time_ratio():
    best = {"sgd": _summary([30, 30, 30], [1.0, 1.0, 1.0]), "adam": _summary([4, 4, 4], [0.5, 0.5, 0.5]),
            "kfac-fixed": _summary([5, 5, 5], [0.6, 0.6, 0.6]),
            "kfac-adaptive": _summary([None, None, 2], [None, None, 0.1])}
    rows = {(r["kfac"], r["baseline"]): r for r in bench.targets(best)}
    sgd = rows[("kfac-fixed", "sgd")]
    assert sgd["fewer_epochs"] and math.isclose(sgd["time_ratio"], 0.6) and sgd["time_target_met"]
    adam = rows[("kfac-fixed", "adam")]
    assert not adam["fewer_epochs"] and math.isclose(adam["time_ratio"], 1.2) and not adam["time_target_met"]
    missed = rows[("kfac-adaptive", "sgd")]  # K-FAC that misses the target meets nothing
    assert missed["time_ratio"] is None and not missed["fewer_epochs"] and not missed["time_target_met"]


def test_finalists_are_the_fastest_points_within_the_span_and_the_retimed_best_is_reported(monkeypatch):
    """The sweep's fastest points (at most FINALISTS, within FINALIST_SPAN of the fastest; none that
    missed on the median seed) are timed again, and the point with the best retimed median wins even
    when one sweep pass ranked it second."""
    entries = [{"point": {"lr": lr}, **_summary([5, 5, 5], [t, t, t])} for lr, t in
               ((0.1, 1.0), (0.2, 1.2), (0.3, 1.4), (0.4, 1.45), (0.5, 2.0))] + \
              [{"point": {"lr": 0.6}, **_summary([None, None, 3], [None, None, 0.1])}]
    picked = bench._finalists(entries)
    assert [e["point"]["lr"] for e in picked] == [0.1, 0.2, 0.3]  # 1.45 is the fourth; 2.0 is past 1.5x
    assert bench._finalists([entries[-1]]) == []

    # one setting: the sweep ranks lr 0.1 first by a burst of load; retimed, lr 0.3 is faster
    sweep_time = {0.1: 0.9, 0.3: 1.0, 1.0: 5.0}
    retimed = {0.1: 0.8, 0.3: 0.5, 1.0: 5.0}
    calls = []

    def fake_train(method, point, model_kind, data, batch, seed, target, max_epochs, time_cap=math.inf):
        lr = point["lr"]
        first = not any(c == (method, lr, seed) for c in calls)
        calls.append((method, lr, seed))
        return {"seed": seed, "epochs": 4, "seconds": sweep_time[lr] if first else retimed[lr], "curve": [],
                "skipped": 0, "stalled": False}

    monkeypatch.setattr(bench, "train", fake_train)
    grid = {m: [{"lr": 0.1}, {"lr": 0.3}, {"lr": 1.0}] for m in bench.METHODS}
    out = bench.run_setting("mlp", 128, {}, grid, [0, 1], 0.97, 5, 1, lambda s: None)
    for m in bench.METHODS:
        assert out["best"][m]["point"] == {"lr": 0.3}
        assert out["best"][m]["summary"]["seconds_per_seed"] == [0.5, 0.5]
    assert ("sgd", 1.0, 0) in calls and calls.count(("sgd", 1.0, 0)) == 1  # past the span: not retimed


def test_a_method_that_misses_on_the_median_seed_reports_its_point_reaching_on_the_most_seeds(monkeypatch):
    """No finalist (no point reaches the target on the median seed): the point with the most seeds
    reaching it is reported, not the grid's first point."""
    def fake_train(method, point, model_kind, data, batch, seed, target, max_epochs, time_cap=math.inf):
        reached = point["lr"] == 0.3 and seed == 0  # one seed of three, at one point
        return {"seed": seed, "epochs": 4 if reached else None, "seconds": 0.5 if reached else None, "curve": [],
                "skipped": 0, "stalled": False}

    monkeypatch.setattr(bench, "train", fake_train)
    grid = {m: [{"lr": 0.1}, {"lr": 0.3}, {"lr": 1.0}] for m in bench.METHODS}
    out = bench.run_setting("mlp", 128, {}, grid, [0, 1, 2], 0.97, 5, 2, lambda s: None)
    for m in bench.METHODS:
        assert out["best"][m]["point"] == {"lr": 0.3} and out["best"][m]["summary"]["reached"] == 1


def test_adaptive_grid_has_long_interval_points_and_the_optimizer_uses_them():
    adaptive = bench.grids(False)["kfac-adaptive"]
    assert {(p.get("curv", 1), p.get("inv", 1)) for p in adaptive} >= {(1, 1), (1, 10), (3, 12), (5, 5), (5, 20)}
    assert len(adaptive) <= 7  # the full run stays short
    model = bench.make_model("mlp", 0)
    opt = bench.make_optimizer("kfac-adaptive", {"damping": 0.01, "curv": 5, "inv": 20}, model, 0)
    assert (opt.curv_update_interval, opt.inv_update_interval) == (5, 20) and opt.adaptive.interval == 1
    assert bench.point_text({"damping": 0.01, "curv": 5, "inv": 20}) == "damping 0.01, intervals 5/20"
    opt = bench.make_optimizer("kfac-adaptive", {"damping": 0.01, "curv": 5, "inv": 5, "coef": 3}, model, 0)
    assert opt.adaptive.interval == 3
    assert bench.point_text({"damping": 0.01, "curv": 5, "inv": 5, "coef": 3}) == \
        "damping 0.01, intervals 5/5, coefficients every 3"
    opt = bench.make_optimizer("kfac-adaptive", {"damping": 0.01, "kfac_method": "inverse"}, model, 0)
    assert opt.kfac_method == "inverse"
    assert bench.point_text({"damping": 0.01, "kfac_method": "inverse"}) == "damping 0.01, kfac_method inverse"
    # a point may set the curvature of the K-FAC factors (the quadratic model keeps the exact GGN)
    opt = bench.make_optimizer("kfac-adaptive", {"damping": 0.01, "curvature": "empirical_fisher"}, model, 0)
    assert opt.engine.kind.value == "empirical_fisher" and opt.adaptive is not None
    assert bench.make_optimizer("kfac-adaptive", {"damping": 0.01}, model, 0).engine.kind.value == "fisher_mc"


def test_fixed_grid_has_empirical_fisher_points_and_the_optimizer_uses_them():
    """The fixed grid holds points whose G factor comes from the user's own backward
    (``curvature="empirical_fisher"``, no second backward); make_optimizer passes the point's
    curvature, KL clip and method through, and the label shows them."""
    fixed = bench.grids(False)["kfac-fixed"]
    assert any(p.get("curvature") == "empirical_fisher" for p in fixed)
    assert any("curvature" not in p for p in fixed)  # the default (Monte-Carlo Fisher) stays in
    assert len(fixed) <= 16  # the full run stays short
    point = {"lr": 0.3, "damping": 0.01, "curv": 10, "inv": 100, "curvature": "empirical_fisher", "kl_clip": 5e-5}
    opt = bench.make_optimizer("kfac-fixed", point, bench.make_model("mlp", 0), 0)
    assert opt.engine.kind.value == "empirical_fisher" and opt.kl_clip == 5e-5
    assert (opt.curv_update_interval, opt.inv_update_interval) == (10, 100)
    default = bench.make_optimizer("kfac-fixed", {"lr": 0.3, "damping": 0.01, "curv": 10, "inv": 100},
                                   bench.make_model("mlp", 0), 0)
    assert default.engine.kind.value == "fisher_mc"
    assert bench.point_text(point) == ("lr 0.3, damping 0.01, intervals 10/100, curvature empirical_fisher, "
                                       "kl_clip 5e-05")


def test_empirical_fisher_kfac_factors_from_the_users_backward_equal_brute_force():
    """What the empirical-Fisher grid points precondition with: after one step (float64 MLP, mean
    cross-entropy), the Linear layers' K-FAC factors are ``A = (1/N) Σ_n ã_n ã_nᵀ`` (``ã``: the
    input with a 1 for the bias) and ``G = (1/N) Σ_n (N ∂L/∂s_n)(N ∂L/∂s_n)ᵀ`` (``s``: the layer's
    output, ``L`` the mean loss), each example's gradient from plain autograd."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    n = 7
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(n, 5, dtype=torch.float64), torch.randint(0, 3, (n,))
    opt = bench.SecondOrderOptimizer(model, lr=0.0, curvature="empirical_fisher", approx="kfac",
                                     curv_update_interval=10, inv_update_interval=100)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        return loss, out

    opt.step(closure)
    inputs, outputs = {}, {}

    def record(name):
        def hook(_module, args, out):
            inputs[name], outputs[name] = args[0], out
        return hook

    hooks = [model[int(k)].register_forward_hook(record(k)) for k in ("0", "2")]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    for h in hooks:
        h.remove()
    grads = dict(zip(outputs, torch.autograd.grad(loss, list(outputs.values()))))
    for name in ("0", "2"):
        a = torch.cat([inputs[name], torch.ones(n, 1, dtype=torch.float64)], 1)
        g = grads[name] * n
        block = opt.running.blocks[name]
        torch.testing.assert_close(block.right, a.t() @ a / n, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(block.left, g.t() @ g / n, rtol=1e-10, atol=1e-12)


def test_a_run_stops_at_the_target_and_times_training_only():
    data = bench.load_data()
    run = bench.train("sgd", {"lr": 0.1}, "mlp", data, 512, 0, target=0.0, max_epochs=5)
    assert run["epochs"] == 1 and len(run["curve"]) == 1 and run["seconds"] > 0
    run = bench.train("kfac-fixed", {"lr": 0.1, "damping": 0.01, "curv": 1, "inv": 5}, "cnn", data, 512, 0,
                      target=1.01, max_epochs=2)
    assert run["epochs"] is None and run["seconds"] is None and len(run["curve"]) == 2
    assert run["curve"][0][0] < run["curve"][1][0]  # cumulative training seconds


def test_adaptive_runs_give_the_labels_so_the_lm_rule_needs_no_second_closure(monkeypatch):
    import torchsso2.optim.second_order as so
    made = []
    original = so.forward_only_closure
    monkeypatch.setattr(so, "forward_only_closure", lambda *a: made.append(original(*a)) or made[-1])
    data = bench.load_data()
    bench.train("kfac-adaptive", {"damping": 0.01, "curv": 3, "inv": 12}, "mlp", data, 512, 0, target=2.0,
                max_epochs=2)
    assert len(made) == 1 and made[0] is not None  # 6 steps, LM at the 5th: one forward-only evaluation


def test_quick_run_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    report = bench.main(["--quick", "--json", str(out), "--plot", str(png)])
    saved = json.loads(out.read_text())
    assert png.stat().st_size > 1000
    assert saved["config"]["load_average_before"] is not None
    (setting,) = saved["settings"]
    assert set(setting["best"]) == set(bench.METHODS)
    assert len(setting["targets"]) == 4
    costs = saved["step_costs"][0]
    for key in ("sgd", "kfac_plain_eigen", "kfac_curvature_only", "kfac_curvature_and_eigh", "kfac_first_step",
                "eigh_factors", "precondition_matmuls_eigen", "kfac_curvature_only_empirical"):
        assert costs[key]["min_ms"] > 0
    assert costs["plain_step_over_floor"] > 0
    assert "empirical_curvature_overhead_ms" in costs
    text = capsys.readouterr().out
    assert "time / SGD" in text and "<= 0.7x" in text and "FLOP floor" in text
    assert "empirical-Fisher curvature estimate" in text
    assert "empirical Fisher from the user's backward +" in bench.readme_section(saved)
    assert report["settings"][0]["model"] == "mlp"


def test_readme_block_is_rendered_from_the_json_and_nothing_else_changes(tmp_path, capsys):
    out = tmp_path / "t.json"
    bench.main(["--quick", "--json", str(out)])
    report = json.loads(out.read_text())
    readme = tmp_path / "README.md"
    before, after = "# title\n\ntext before\n", "\n## next\ntext after\n"
    readme.write_text(before + bench.README_BEGIN + "\nSTALE-BLOCK-TEXT\n" + bench.README_END + after)
    bench.update_readme(readme, report)
    text = readme.read_text()
    assert text.startswith(before) and text.endswith(after) and "STALE-BLOCK-TEXT" not in text
    block = text[len(before):-len(after)]
    assert block == bench.readme_section(report)
    assert "| mlp B=512 | sgd | lr 0.1 |" in block and "comparisons" in block and "FLOP floor" in block
    with pytest.raises(ValueError, match="no"):
        bench.update_readme(tmp_path / "t.json", report)


def test_the_repository_readme_has_the_block():
    text = (bench.ROOT / "README.md").read_text()
    assert text.count(bench.README_BEGIN) == 1 and text.count(bench.README_END) == 1


def test_the_runner_finds_it_and_formats_its_json(tmp_path):
    from benchmarks import run as bench_run

    assert "kfac_time_to_accuracy" in bench_run.discover()
    out = tmp_path / "t.json"
    bench.main(["--quick", "--json", str(out)])
    text = bench.format_tables(json.loads(out.read_text()))
    assert "time / Adam" in text and "<= 0.7x" in text and "plain step" in text
