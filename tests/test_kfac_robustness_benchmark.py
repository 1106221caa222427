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
