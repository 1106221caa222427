"""Benchmark CLIs and plots an audit found wanting: unknown names and partial runs of step_overhead
(they replaced the published JSON), bad arguments of scaling / kaisa / width_scaling, width_scaling's
quick mode, kfac_adaptive's tables in results.md, and the reliability diagram's clipped x label."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import kaisa, kfac_adaptive, scaling, step_overhead, width_scaling
from fake_clock import FakeClock

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.parametrize("argv,match", [(["--models", "mlp"], "--models: unknown \\['mlp'\\]"),
                                        (["--quick", "--optimizers", "adamw"], "--optimizers: unknown \\['adamw'\\]")])
def test_step_overhead_refuses_unknown_names(argv, match, capsys) -> None:
    with pytest.raises(SystemExit):
        step_overhead.parse_args(argv)
    assert __import__("re").search(match, capsys.readouterr().err)


@pytest.mark.parametrize("argv", [["--models", "mlp784"], ["--optimizers", "sgd"], ["--skip-convergence"],
                                  ["--skip-timing"]])
def test_a_partial_step_overhead_run_writes_no_default_json(argv) -> None:
    assert step_overhead.parse_args(argv).json is None
    assert step_overhead.parse_args([]).json == step_overhead.DEFAULT_JSON


@pytest.mark.parametrize("module,argv", [(scaling, ["--ranks", "0"]), (width_scaling, ["--widths", "0"]),
                                         (scaling, ["--steps", "0"])])
def test_bad_benchmark_arguments_are_argparse_errors(module, argv, capsys) -> None:
    with pytest.raises(SystemExit):
        module.parse_args(argv)
    assert "expected" in capsys.readouterr().err


def test_kaisa_world_sizes_that_are_not_numbers() -> None:
    with pytest.raises(SystemExit, match="--world-sizes must be positive integers, got 'x'"):
        kaisa.main(["--quick", "--world-sizes", "x"])


def test_width_scaling_quick_keeps_the_full_shape_small() -> None:
    assert width_scaling.parse_args(["--quick"]).full_max_d == width_scaling.QUICK_FULL_MAX_D < width_scaling.FULL_MAX_D
    assert width_scaling.parse_args([]).full_max_d == width_scaling.FULL_MAX_D


def test_kfac_adaptive_report_renders_its_tables() -> None:
    report = json.loads((RESULTS / "kfac_adaptive.json").read_text())
    text = kfac_adaptive.format_tables(report)
    assert "adaptive / K-FAC" in text and "per LM adjustment" in text and "0.95 (0.774)" in text


def test_reliability_diagram_keeps_its_x_label(tmp_path) -> None:
    plt_image = pytest.importorskip("matplotlib.image")
    from torchsso2 import metrics
    from torchsso2.plotting import save_reliability_diagram

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(200, 10, generator=g), -1)
    d = metrics.reliability_diagram_data(probs, torch.randint(0, 10, (200,), generator=g))
    out = save_reliability_diagram({k: d for k in ("a", "b", "c")}, tmp_path / "r.png", title="a title")
    img = plt_image.imread(str(out))[..., :3].mean(-1)
    assert int((img[-1] < 0.5).sum()) == 0  # no text cut at the bottom edge


def test_results_page_names_the_peers_the_jsons_recorded(tmp_path) -> None:
    """docs/results.md's peer line comes from the results JSONs (``machine.peers`` of each run), not
    from the environment writing the page: it listed backpack / curvlinops as absent beside tables
    measured with them. A peer no run had is listed as absent; unreadable JSONs are left out."""
    from benchmarks import run as bench_run
    (tmp_path / "a.json").write_text(json.dumps({"machine": {"peers": {"backpack": "1.7.1", "ivon": None}}}))
    (tmp_path / "b.json").write_text(json.dumps({"machine": {"peers": {"backpack": "1.7.0", "ivon": None,
                                                                        "asdl": "0.1a4"}}}))
    (tmp_path / "c.json").write_text("{not json")
    found, absent = bench_run.recorded_peers([tmp_path / n for n in ("a.json", "b.json", "c.json", "d.json")])
    assert found == {"backpack": ["1.7.0", "1.7.1"], "asdl": ["0.1a4"]} and absent == ["ivon"]


def _digits_like(n: int = 8) -> dict:
    torch.manual_seed(0)
    return {"x_train": torch.randn(n, 64), "y_train": torch.randint(0, 10, (n,))}


def test_kfac_adaptive_step_times_are_per_position_minima_and_medians_over_cycles(monkeypatch) -> None:
    """kfac_adaptive.time_steps at intervals 1/1 (window 10 steps, 3 cycles) under a fake perf_counter:
    the i-th step of a cycle takes base · i · scale (base 1 / 2 / 4 ms for K-FAC / adaptive / adaptive + LM,
    scale 1, 3, 2 per cycle). By hand: the per-position min over cycles is scale 1, the median scale 2,
    so min_s = base · mean(1..10) = 5.5 base, median_s = 11 base; the ratios to K-FAC are 2 and 4."""
    import types

    window, base, scale = 10, {"kfac": 1e-3, "adaptive": 2e-3, "adaptive_lm": 4e-3}, (1, 3, 2)
    durations = [base[name] * (i + 1) * s for s in scale for name, _, _ in kfac_adaptive.VARIANTS
                 for i in range(window)]
    clock = FakeClock(durations)
    monkeypatch.setattr(kfac_adaptive, "time", types.SimpleNamespace(perf_counter=clock))
    (row,) = kfac_adaptive.time_steps(_digits_like(), [8], len(scale), [(1, 1)])
    assert clock.calls == 2 * len(durations)
    for name, b in base.items():
        assert row[name]["min_s"] == pytest.approx(5.5 * b) and row[name]["median_s"] == pytest.approx(11 * b)
    assert row["adaptive_ratio_min"] == pytest.approx(2.0) and row["adaptive_lm_ratio_min"] == pytest.approx(4.0)
    assert row["adaptive_ratio_median"] == pytest.approx(2.0) and row["adaptive_lm_ratio_median"] == pytest.approx(4.0)


def test_kfac_adaptive_component_times_and_their_ratio(monkeypatch) -> None:
    """kfac_adaptive.time_components, 4 interleaved calls of the closure (1, 5, 2, 3 ms) and the
    quadratic model (4, 9, 6, 8 ms) under a fake perf_counter: by hand closure min 1 ms, median 2.5 ms;
    quadratic model min 4 ms, median 7 ms; quadratic model / closure (min) = 4."""
    import types

    closure, quad = [1e-3, 5e-3, 2e-3, 3e-3], [4e-3, 9e-3, 6e-3, 8e-3]
    clock = FakeClock([v for pair in zip(closure, quad) for v in pair])
    monkeypatch.setattr(kfac_adaptive, "time", types.SimpleNamespace(perf_counter=clock))
    (row,) = kfac_adaptive.time_components(_digits_like(), [8], 4)
    assert clock.calls == 16
    assert row["closure"]["min_s"] == pytest.approx(1e-3) and row["closure"]["median_s"] == pytest.approx(2.5e-3)
    assert row["quad_model"]["min_s"] == pytest.approx(4e-3) and row["quad_model"]["median_s"] == pytest.approx(7e-3)
    assert row["ratio_min"] == pytest.approx(4.0)


def test_kfac_adaptive_grid_table_counts_a_missed_seed_as_infinite() -> None:
    """One grid point, three seeds: epochs (3, -, -) have median inf (no median epochs, 1/3 reached);
    (3, 5, -) have median 5 (2/3). Median wall time of (1, 3, 2) s is 2.00."""
    runs = [dict(damping_decay=0.95, damping=0.01, epochs=e, final_accuracy=0.97, wall_s=w, final_damping=0.01)
            for e, w in ((3, 1.0), (None, 3.0), (None, 2.0))]
    assert kfac_adaptive.grid_table(runs, 0.97).splitlines()[2] == \
        "| 0.95 (0.774) | 0.01 | 1/3 | 3 - - | - | 0.970 0.970 0.970 | 2.00 | 0.01 0.01 0.01 |"
    runs[1]["epochs"] = 5
    assert "| 2/3 | 3 5 - | 5 |" in kfac_adaptive.grid_table(runs, 0.97).splitlines()[2]


def test_step_overhead_flop_floor_with_distinct_intervals() -> None:
    """kfac_flops of one layer (m 4, n 2, T 3) at batch 5, curvature every 2 and decompositions every 4
    steps, eigen form, by hand: SGD 6·5·3·4·2 = 720; preconditioning 2·(2·4·2·(4 + 2)) = 192; factors
    2·5·3·(16 + 4) / 2 = 300; decompositions 9·(64 + 8) / 4 = 162; floor (720 + 192 + 300 + 162) / 720."""
    f = step_overhead.kfac_flops([{"m": 4, "n": 2, "T": 3}], batch=5, curv_interval=2, inv_interval=4, eigen=True)
    assert (f["sgd"], f["precondition"], f["factors"], f["decompositions"]) == (720, 192, 300, 162)
    assert f["floor"] == pytest.approx((720 + 192 + 300 + 162) / 720)


def test_step_overhead_timing_rows_from_hand_chosen_window_times(monkeypatch) -> None:
    """run_timing (quick, digits-mlp, 3 rounds) with time_training_steps replaced by hand-chosen window
    times per optimizer and round. By hand: SGD min 1 ms, median 2 ms; Adam 4 ms; K-FAC 10/100 (3, 5,
    4 ms) min 3, median 4: ratio to SGD 3 (min) and 2 (median), to Adam 0.75; the inverse form (6 ms):
    6 and 3; measured / floor divides the min ratio by the floor of the row's own form."""
    import types

    times = {"sgd": [2e-3, 1e-3, 3e-3], "adam": [4e-3] * 3, "sso-kfac 10/100": [3e-3, 5e-3, 4e-3],
             "sso-kfac-inv 10/100": [6e-3] * 3, "sso-diag": [2e-3] * 3, "sso-full 5/50": [9e-3] * 3,
             "sso-kfac 1/1": [8e-3] * 3}
    names, rounds = {}, {}
    build = step_overhead.build_optimizer

    def named_build(spec, model, kfac_mod, lr=step_overhead.TIMING_LR):
        opt = build(spec, model, kfac_mod, lr)
        names[id(opt)] = spec.name
        return opt

    def window_times(model, opt, x, y, window, repeats, step=None, warmup=3):
        name = names[id(opt)]
        rounds[name] = rounds.get(name, -1) + 1
        return [times[name][rounds[name]]]

    monkeypatch.setattr(step_overhead, "build_optimizer", named_build)
    monkeypatch.setattr(step_overhead, "time_training_steps", window_times)
    args = types.SimpleNamespace(mode="quick", models=["digits-mlp"], include_1_1=False, repeats=3)
    rows, _ = step_overhead.run_timing(args, None, "not installed")
    by = {r["optimizer"]: r for r in rows}
    k, inv = by["sso-kfac 10/100"], by["sso-kfac-inv 10/100"]
    assert k["min_s"] == 3e-3 and k["median_s"] == 4e-3 and by["sgd"]["min_s"] == 1e-3
    assert k["ratio_sgd_min"] == pytest.approx(3.0) and k["ratio_sgd_median"] == pytest.approx(2.0)
    assert k["ratio_adam_min"] == pytest.approx(0.75)
    assert by["sgd"]["ratio_adam_min"] == pytest.approx(0.25)  # SGD's own row too (1 ms / 4 ms)
    assert inv["ratio_sgd_min"] == pytest.approx(6.0) and inv["ratio_sgd_median"] == pytest.approx(3.0)
    assert inv["floor"] == inv["floor_inverse_form"] < inv["floor_eigen_form"]
    assert inv["measured_over_floor"] == pytest.approx(6.0 / inv["floor_inverse_form"])
    assert k["measured_over_floor"] == pytest.approx(3.0 / k["floor_eigen_form"])


def _seed_run(seed, epochs, wall):
    return dict(seed=seed, epochs_to_target=epochs, wall_to_target_s=wall, final_accuracy=0.97, best_accuracy=0.98,
                skipped_steps=0, history=[])


def test_step_overhead_seed_summary_counts_a_missed_seed_as_infinite() -> None:
    """Epochs (3, miss, 5) and walls (0.3, miss, 0.2) s: medians of (3, inf, 5) = 5 and (0.3, inf, 0.2)
    = 0.3, 2 reached; with two misses the medians are inf: none, 1 reached."""
    per_seed = [_seed_run(0, 3, 0.3), _seed_run(1, None, None), _seed_run(2, 5, 0.2)]
    r = step_overhead._summarize_seeds({"lr": 0.1}, per_seed)
    assert r["reached"] == 2 and r["epochs_to_target"] == 5 and r["wall_to_target_s"] == 0.3
    r = step_overhead._summarize_seeds({"lr": 0.1}, [per_seed[0], per_seed[1], _seed_run(2, None, None)])
    assert r["reached"] == 1 and r["epochs_to_target"] is None and r["wall_to_target_s"] is None


def test_step_overhead_retime_keeps_each_seeds_fastest_run(monkeypatch) -> None:
    """retime_best, 2 re-runs of seeds 0 and 2 (seed 1 missed: not re-run) with walls 0.25, 0.5, 0.4,
    0.1 s: seed 0 min(0.3, 0.25, 0.4) = 0.25, seed 2 min(0.2, 0.5, 0.1) = 0.1; the median over seeds of
    (0.25, inf, 0.1) is 0.25."""
    import types

    walls = iter([0.25, 0.5, 0.4, 0.1])  # seed 0 re-run 1, seed 2 re-run 1, seed 0 re-run 2, seed 2 re-run 2

    def fit(name, cfg, hidden, data, epochs, stop=None, seed=0, batch_size=32):
        return None, [types.SimpleNamespace(epoch=epochs, test_accuracy=0.98, wall_s=next(walls))]

    monkeypatch.setattr(step_overhead, "seeded_fit", fit)
    best = {"sgd": {"lr": 0.1, "hidden": [64], "epochs_per_seed": [3, None, 5], "wall_per_seed_s": [0.3, None, 0.2]}}
    step_overhead.retime_best(best, None, 2, 0.97, [0, 1, 2])
    assert best["sgd"]["wall_per_seed_s"] == [0.25, None, 0.1] and best["sgd"]["wall_to_target_s"] == 0.25


def test_step_overhead_best_configuration_reaches_on_the_most_seeds_first(monkeypatch) -> None:
    """run_convergence over the full SGD grid with a fake fit: lr 0.3 / momentum 0.8 reaches on 3 of 3
    seeds in 1.0 s, lr 0.1 / momentum 0.9 on 2 of 3 in 0.1 s, the rest on none: the best is the 3-of-3
    point (more seeds first, then the median wall time), 6 epochs."""
    import types

    import examples.common as ec

    def fit(name, cfg, hidden, data, epochs, stop=None, seed=0, batch_size=32):
        point = (cfg["lr"], cfg.get("momentum"))
        if point == (0.3, 0.8):
            return None, [types.SimpleNamespace(epoch=6, test_accuracy=0.98, wall_s=1.0)]
        if point == (0.1, 0.9) and seed < 2:
            return None, [types.SimpleNamespace(epoch=3, test_accuracy=0.98, wall_s=0.1)]
        return None, [types.SimpleNamespace(epoch=epochs, test_accuracy=0.90, wall_s=2.0)]

    monkeypatch.setattr(step_overhead, "seeded_fit", fit)
    monkeypatch.setattr(ec, "load_digits_data", lambda *a, **k: None)
    conv = step_overhead.run_convergence(types.SimpleNamespace(target=0.97, epochs=10, seeds=[0, 1, 2], mode="full",
                                                               optimizers=["sgd"], repeats=0))
    b = conv["best"]["sgd"]
    assert (b["lr"], b["momentum"], b["reached"], b["epochs_to_target"]) == (0.3, 0.8, 3, 6)


BAD_ARGUMENTS = [
    ("kfac_robustness.py", ["--quick", "--epochs", "0"], "--epochs: expected an int >= 1"),
    ("peers_training.py", ["--quick", "--target", "2"], "--target: expected a number in (0, 1]"),
    ("peers_training.py", ["--quick", "--batch-size", "0"], "--batch-size: expected an int >= 1"),
    ("peers_curvature.py", ["--batch", "0"], "--batch: expected an int >= 1"),
    ("kaisa.py", ["--quick", "--steps", "0"], "--steps: expected an int >= 1"),
    ("memory.py", ["--quick", "--width", "-3"], "--width: expected an int >= 1"),
    ("step_overhead.py", ["--quick", "--repeats", "0"], "--repeats: expected an int >= 1"),
    ("kfac_time_to_accuracy.py", ["--quick", "--batches", "0"], "--batches: expected an int >= 1"),
    ("sequence_curvature.py", ["--quick", "--heads", "3"], "--heads must divide --d-model"),
    ("transformer.py", ["--quick", "--seq-len", "0"], "--seq-len: expected an int >= 1"),
    ("vi_step_time.py", ["--quick", "--steps", "0"], "--steps: expected an int >= 1"),
    ("soak.py", ["--create", "-1"], "--create: expected an int >= 0"),
]


@pytest.mark.parametrize("script, args, message", BAD_ARGUMENTS, ids=[f"{s}{' '.join(a)}" for s, a, _ in BAD_ARGUMENTS])
def test_benchmark_options_out_of_range_are_argparse_errors(script, args, message):
    """They crashed after the run had started (empty min(), zero division), were swapped for the default
    (0 → the default by `x or default`) or accepted (a target accuracy of 2)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=120, cwd=root)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]


def test_quick_keeps_the_options_given():
    """--quick overwrote explicit options (--quick --epochs 4 --seeds 0 1 ran 2 epochs of seed 0)."""
    from benchmarks import sequence_curvature, transformer, vi_step_time
    args = transformer.parse_args(["--quick", "--seq-len", "16", "--seeds", "3", "4"])
    assert (args.seq_len, args.seeds, args.d_model) == (16, [3, 4], 32)
    assert transformer.parse_args([]).seq_len == 128
    args = vi_step_time.parse_args(["--quick", "--steps", "7"])
    assert (args.steps, args.warmup) == (7, 2)
    report = sequence_curvature.main(["--quick", "--repeats", "1", "--models", "lm-mlp"])
    assert report["results"][0]["batch"] == 2 and "skipped" in report


def test_a_missing_or_foreign_report_is_an_error_naming_it(tmp_path):
    """--replot / --report-only on a missing file or another benchmark's JSON raised FileNotFoundError/KeyError."""
    from benchmarks.common import read_report
    with pytest.raises(SystemExit, match=r"cannot read .*nosuch\.json"):
        read_report(tmp_path / "nosuch.json", ["results"], "benchmarks.width_scaling")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"bad\.json is not JSON"):
        read_report(tmp_path / "bad.json", ["results"], "benchmarks.width_scaling")
    (tmp_path / "other.json").write_text('{"settings": {}}')
    with pytest.raises(SystemExit, match=r"not a report of benchmarks.width_scaling \(no 'results' entry\)"):
        read_report(tmp_path / "other.json", ["results"], "benchmarks.width_scaling")
    assert read_report(tmp_path / "other.json", ["settings"], "x") == {"settings": {}}
