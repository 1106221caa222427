"""The examples run data-parallel under ``mpiexec -n 2`` and ``torchrun --nproc_per_node=2``
and reach the same test accuracy as one process (issue #7). Real processes, 2 ranks."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from dist_utils import launch_example, require_mpiexec

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("sklearn", reason="the examples need scikit-learn")




def _launch(prefix, script, *args, timeout=180.0, env=None) -> str:
    return launch_example(prefix, script, *args, timeout=timeout, env=env)


def _final_accuracy(out: str) -> float:
    m = re.search(r"final test accuracy: ([0-9.]+)%", out)
    assert m, out
    return float(m.group(1))


LAUNCHERS = {
    "mpiexec": lambda: [require_mpiexec(), "-n", "2", sys.executable],
    "torchrun": lambda: [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_train_digits_data_parallel(launcher, tmp_path):
    args = ["--epochs", "2", "--no-progress", "--optimizer", "sso-kfac"]
    single = _final_accuracy(_launch([sys.executable], "examples/train_digits.py", *args))
    out = _launch(LAUNCHERS[launcher](), "examples/train_digits.py", *args, "--json", str(tmp_path / "r.json"))
    # only rank 0 reports
    assert out.count("final test accuracy") == 1
    # the same global batches, averaged gradients/curvature: the same model up to MC-label noise
    assert abs(_final_accuracy(out) - single) <= 3.0
    assert json.loads((tmp_path / "r.json").read_text())["final_test_accuracy"] > 0.8


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_bayesian_digits_data_parallel(launcher, tmp_path):
    out = _launch(LAUNCHERS[launcher](), "examples/bayesian_digits.py", "--epochs", "1", "--no-progress",
                  "--methods", "vi-kfac", "--mc-samples", "4", "--out-dir", str(tmp_path / "out"),
                  env={"TMPDIR": str(tmp_path)})
    assert "vi-kfac" in out
    assert not list(tmp_path.glob("bayesian_digits_rank*")), "rank 1's scratch directory is removed"
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert result["results"]["vi-kfac"]["accuracy"] > 0.8
