"""benchmarks/kfac_robustness.py (issue 30): CLI, report format, README block and plot."""
from __future__ import annotations

import json

import pytest

from benchmarks import kfac_robustness


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as info:
        kfac_robustness.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--epochs" in out and "--quick" in out


def test_quick_run_writes_the_grid_the_table_and_the_plot(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert kfac_robustness.main(["--quick", "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["epochs"] == 2 and report["config"]["scalings"] == ["standardize"]
    kfac = [p for p in report["points"] if p["optimizer"] == "kfac"]
    assert [(p["lr"], p["damping"], p["intervals"]) for p in kfac] == [
        (lr, d, [10, 100]) for lr in kfac_robustness.LRS for d in kfac_robustness.DAMPINGS]
    adaptive = [p for p in report["points"] if p["optimizer"] == "kfac_adaptive"]
    assert [p["damping"] for p in adaptive] == list(kfac_robustness.DAMPINGS)
    # the kfac_pytorch drop-in on the same grid; kfac_pytorch itself only where it is installed
    peer = {"kfac_pytorch"} if kfac_robustness.kfac_pytorch_class() is not None else set()
    assert {p["optimizer"] for p in report["points"]} == {"sgd", "adam", "kfac", "kfac_adaptive",
                                                          "kfac_preconditioner"} | peer
    for name in ("kfac_preconditioner", *peer):
        assert [(p["lr"], p["damping"], p["intervals"]) for p in report["points"] if p["optimizer"] == name] == [
            (lr, d, [10, 100]) for lr in kfac_robustness.LRS for d in kfac_robustness.DAMPINGS]
    assert report["kfac_points"] == 9 and 0 <= report["kfac_reached"] <= 9
    for p in report["points"]:
        run = p["runs"][0]
        assert run["seed"] == 0 and 0.0 <= run["final_accuracy"] <= 1.0 and run["train_seconds"] > 0
        assert (run["reached_epoch"] is None) == (run["seconds_to_target"] is None)
    printed = capsys.readouterr().out
    assert "| standardize | kfac 10/100 | 0.1 | 0.001 |" in printed
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    # README's block is rebuilt from the JSON alone
    assert kfac_robustness.main(["--readme", "--json", str(out)]) == 0
    block = capsys.readouterr().out
    assert block.startswith("| inputs | optimizer (intervals) | points reaching 97% |")
    assert "| standardize | kfac 10/100 |" in block


def test_quick_without_paths_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(kfac_robustness, "DEFAULT_JSON", tmp_path / "never.json")
    monkeypatch.setattr(kfac_robustness, "DEFAULT_PLOT", tmp_path / "never.png")
    assert kfac_robustness.main(["--quick", "--optimizers", "sgd"]) == 0
    assert not list(tmp_path.iterdir())


def test_summary_counts_a_never_reaching_seed_as_infinite():
    runs = [dict(reached_epoch=e, seconds_to_target=None if e is None else e / 10, final_accuracy=0.97,
                 final_train_loss=0.1, diverged=False, skipped=0) for e in (3, None, 5)]
    s = kfac_robustness.summarize(runs)
    assert s["reached"] and s["median_epochs"] == 5 and s["median_seconds"] == 0.5
    s = kfac_robustness.summarize(runs[1:] + [dict(runs[1])])
    assert not s["reached"] and s["median_epochs"] is None and s["median_seconds"] is None


def test_readme_section_is_what_the_json_gives():
    """README's "K-FAC robustness" table is exactly ``--readme``'s block of the published JSON
    (after a rerun: ``python benchmarks/kfac_robustness.py --readme`` and paste)."""
    from pathlib import Path
    root = Path(kfac_robustness.__file__).resolve().parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    report = json.loads((root / "benchmarks" / "results" / "kfac_robustness.json").read_text())
    block = kfac_robustness.readme_block(report)
    assert block in readme
    assert readme.index("## K-FAC robustness") < readme.index(block) < readme.index("## Known gaps")


def test_the_drop_in_point_is_sgd_preconditioned_at_kfac_pytorch_defaults():
    """``kfac_preconditioner``: SGD with momentum 0.9 at the point's lr, and KFACPreconditioner with the
    point's intervals, damping and lr, every other argument at kfac_pytorch's defaults."""
    import torch
    from torch import nn

    from torchsso2 import KFACPreconditioner

    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    opt = kfac_robustness.make_optimizer("kfac_preconditioner", model, 0.03, 0.01, 0, (10, 100))
    assert isinstance(opt.sgd, torch.optim.SGD) and isinstance(opt.preconditioner, KFACPreconditioner)
    assert opt.sgd.defaults["lr"] == 0.03 and opt.sgd.defaults["momentum"] == 0.9
    pre = opt.preconditioner
    assert (pre.factor_update_steps, pre.inv_update_steps, pre.damping, pre.lr) == (10, 100, 0.01, 0.03)
    assert (pre.kl_clip, pre.factor_decay) == (0.001, 0.95)  # kfac_pytorch's defaults
    # step() preconditions, then steps SGD: the parameters move along the preconditioned gradient
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.num_skipped == 0 and all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_a_missing_kfac_pytorch_is_skipped_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BENCH_DISABLE_PEERS", "kfac_pytorch")  # the peer switch of benchmarks/_peer_utils.py
    out = tmp_path / "r.json"
    assert kfac_robustness.main(["--quick", "--optimizers", "sgd", "kfac_pytorch", "--json", str(out)]) == 0
    assert "kfac_pytorch skipped: kfac_pytorch not importable" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert {p["optimizer"] for p in report["points"]} == {"sgd"} and report["config"]["optimizers"] == ["sgd"]


def _run(epoch, seconds=None, acc=0.97, loss=0.1, diverged=False):
    return dict(reached_epoch=epoch, seconds_to_target=seconds if seconds is not None or epoch is None else epoch / 10,
                final_accuracy=acc, final_train_loss=loss, diverged=diverged, skipped=0)


def test_summary_medians_of_an_even_seed_count_and_a_diverged_seed():
    """By hand: two seeds reaching at 3 and 5 epochs (0.2 s, 0.4 s) have median 4 epochs and 0.3 s (the
    mean of the middle two, not the lower); one diverged seed of three marks the point diverged; the
    accuracy median / minimum of (0.98, 0.96, 0.97) are 0.97 / 0.96; a seed without a loss leaves no
    maximum loss."""
    s = kfac_robustness.summarize([_run(3, 0.2), _run(5, 0.4)])
    assert s["reached"] is True and s["median_epochs"] == 4 and s["median_seconds"] == pytest.approx(0.3)
    s = kfac_robustness.summarize([_run(3, 0.2), _run(None)])
    assert s["reached"] is False and s["median_epochs"] is None and s["median_seconds"] is None
    s = kfac_robustness.summarize([_run(3, acc=0.98), _run(4, acc=0.96, loss=0.5, diverged=True),
                                   _run(5, acc=0.97, loss=None)])
    assert s["diverged"] is True and s["median_final_accuracy"] == 0.97 and s["min_final_accuracy"] == 0.96
    assert s["max_final_train_loss"] is None
    s = kfac_robustness.summarize([_run(3, loss=0.1), _run(4, loss=0.5), _run(5, loss=0.2)])
    assert s["diverged"] is False and s["max_final_train_loss"] == 0.5


def test_counts_and_their_readme_row_of_hand_made_points():
    """Four points of one (scaling, optimizer, intervals), three reaching (10, 4, 7 epochs; 0.5, 0.9,
    0.2 s) and one diverged: 3/4 reach, 1 diverged, best / median epochs 4 / 7, seconds 0.20 / 0.50
    (over the reaching points only)."""
    def point(lr, reached, epochs, seconds, diverged=False):
        return dict(scaling="standardize", optimizer="kfac", lr=lr, damping=0.01, intervals=[10, 100],
                    summary=dict(reached=reached, median_epochs=epochs, median_seconds=seconds, diverged=diverged))

    points = [point(0.01, True, 10, 0.5), point(0.03, True, 4, 0.9), point(0.1, True, 7, 0.2),
              point(0.3, False, None, None, diverged=True)]
    (c,) = kfac_robustness.counts(points)
    assert (c["scaling"], c["optimizer"], c["points"], c["reached"], c["diverged"]) == ("standardize", "kfac 10/100",
                                                                                         4, 3, 1)
    assert (c["best_epochs"], c["median_epochs"], c["best_seconds"], c["median_seconds"]) == (4, 7, 0.2, 0.5)
    report = {"config": {"seeds": [0, 1, 2], "epochs": 60, "batch_size": 512}, "counts": [c]}
    assert kfac_robustness.readme_block(report).splitlines()[2] == \
        "| standardize | kfac 10/100 | 3/4 | 1 | 4 / 7 | 0.20 / 0.50 |"


def test_the_published_summaries_and_counts_are_what_the_code_computes():
    """benchmarks/results/kfac_robustness.json: every point's stored summary is summarize(its runs) and
    the stored counts are counts(its points) (README's table prints them as stored)."""
    from pathlib import Path
    root = Path(kfac_robustness.__file__).resolve().parents[1]
    report = json.loads((root / "benchmarks" / "results" / "kfac_robustness.json").read_text())
    for p in report["points"]:
        assert kfac_robustness.summarize(p["runs"]) == p["summary"], (kfac_robustness._label(p), p["lr"], p["damping"])
    assert kfac_robustness.counts(report["points"]) == report["counts"]
