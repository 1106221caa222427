"""benchmarks/soak.py runs end to end on a short budget and reports what docs/validation.md quotes:
flat live tensors over the run, and no hooks or live optimizers left by dropped ones (all faces)."""
from __future__ import annotations

import json

from benchmarks import soak


def test_soak_script_short_run(tmp_path):
    out = tmp_path / "soak.json"
    report = soak.main(["--steps", "40", "--warmup", "10", "--window", "10", "--create", "3", "--timing-reps", "5", "--json", str(out)])
    assert json.loads(out.read_text())["config"]["steps"] == 40
    assert [r["face"] for r in report["soak"]] == list(soak.FACES)
    for row in report["soak"]:
        assert row["live_tensors_end"] == row["live_tensors_start"], row
        assert row["step_ms_start"] > 0 and row["step_ms_end"] > 0
    for row in report["create_destroy"]:
        assert row["hooks_left"] == 0 and row["alive_after_gc"] == 0, row


def test_soak_script_refuses_too_few_steps(capsys):
    import pytest

    with pytest.raises(SystemExit):
        soak.main(["--steps", "10", "--warmup", "10", "--window", "10"])
    assert "--steps=10 must be at least" in capsys.readouterr().err
