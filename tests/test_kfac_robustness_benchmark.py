"""benchmarks/kfac_robustness.py (issue 30, "defaults that are safe"): CLI and report format."""
from __future__ import annotations

import json

import pytest

from benchmarks import kfac_robustness


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as info:
        kfac_robustness.main(["--help"])
    assert info.value.code == 0
    assert "--epochs" in capsys.readouterr().out


def test_one_epoch_run_writes_the_grid(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert kfac_robustness.main(["--seeds", "0", "--epochs", "1", "--optimizers", "kfac", "sgd",
                                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    kfac = [p for p in report["points"] if p["optimizer"] == "kfac"]
    assert [(p["lr"], p["damping"]) for p in kfac] == [(lr, d) for lr in kfac_robustness.LRS
                                                       for d in kfac_robustness.DAMPINGS]
    assert report["kfac_points"] == 9 and 0 <= report["kfac_reached"] <= 9
    for p in report["points"]:
        run = p["runs"][0]
        assert run["seed"] == 0 and 0.0 <= run["final_accuracy"] <= 1.0
    assert "| kfac | 0.1 | 0.001 |" in capsys.readouterr().out
