"""Benchmark CLIs and plots an audit found wanting: unknown names and partial runs of step_overhead
(they replaced the published JSON), bad arguments of scaling / kaisa / width_scaling, width_scaling's
quick mode, kfac_adaptive's tables in results.md, and the reliability diagram's clipped x label."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import kaisa, kfac_adaptive, scaling, step_overhead, width_scaling

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
