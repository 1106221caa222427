"""End-to-end smoke tests of the examples and the optimizer benchmarks (tiny settings).

Each script runs in its own subprocess, as a user would run it (``python examples/x.py ...``),
so its ``torch.set_num_threads``, logging and ``sys.path`` set-up stay out of this process.
Only exit codes and the files written are checked: never any speed or accuracy number.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("sklearn", reason='the examples need scikit-learn (pip install -e ".[examples]")')
pytest.importorskip("matplotlib", reason='the examples save PNGs (pip install -e ".[examples]")')


def run_script(script: str, *args: str, timeout: float = 120.0) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_digits_help() -> None:
    out = run_script("examples/train_digits.py", "--help")
    assert "--optimizer" in out and "sso-kfac" in out


@pytest.mark.parametrize("optimizer,model", [("sso-kfac", "mlp"), ("sso-diag", "cnn"), ("sso-full", "mlp")])
def test_train_digits_runs(tmp_path: Path, optimizer: str, model: str) -> None:
    out_json = tmp_path / "hist.json"
    out = run_script("examples/train_digits.py", "--optimizer", optimizer, "--model", model, "--epochs", "1",
                     "--no-progress", "--json", str(out_json))
    assert "final test accuracy" in out
    result = json.loads(out_json.read_text())
    assert result["optimizer"] == optimizer and len(result["history"]) == 1
    assert 0.0 <= result["final_test_accuracy"] <= 1.0


def test_train_digits_kfac_method_and_momentum_flags(tmp_path: Path) -> None:
    """--kfac-method / --momentum reach the optimizer (the history records the overrides)."""
    out_json = tmp_path / "hist.json"
    run_script("examples/train_digits.py", "--optimizer", "sso-kfac", "--kfac-method", "eigen", "--momentum", "0.5",
               "--damping", "0.01", "--epochs", "1", "--no-progress", "--json", str(out_json))
    result = json.loads(out_json.read_text())
    assert result["overrides"] == {"damping": 0.01, "kfac_method": "eigen"}


def test_make_optimizer_settings() -> None:
    """The examples' K-FAC uses factored damping with its own momentum; SGD's and the shapes' momentum
    can be overridden; Adam refuses one (it has none)."""
    sys.path.insert(0, str(ROOT))
    try:
        import torch

        from examples.common import SSO_SETTINGS, make_model, make_optimizer
    finally:
        sys.path.remove(str(ROOT))
    model = make_model("mlp")
    kfac = make_optimizer("sso-kfac", model)
    assert kfac.kfac_method == "inverse" and kfac.param_groups[0]["momentum"] == SSO_SETTINGS["sso-kfac"]["momentum"]
    assert make_optimizer("sso-kfac-eigen", model).kfac_method == "eigen"
    assert make_optimizer("sso-diag", model, momentum=0.5).param_groups[0]["momentum"] == 0.5
    assert make_optimizer("sgd", model, 0.3, momentum=0.8).param_groups[0]["momentum"] == 0.8
    with pytest.raises(ValueError, match="momentum"):
        make_optimizer("adam", model, momentum=0.9)
    assert isinstance(make_optimizer("adam", model), torch.optim.Adam)


def test_bayesian_digits_runs(tmp_path: Path) -> None:
    out = run_script("examples/bayesian_digits.py", "--epochs", "1", "--mc-samples", "2", "--no-progress",
                     "--out-dir", str(tmp_path))
    assert "| method | accuracy | NLL | ECE | Brier |" in out
    assert "OOD higher?" in out
    assert is_png(tmp_path / "reliability_digits.png")
    for method in ("sgd", "adam", "vi-diag", "vi-kfac"):
        assert is_png(tmp_path / f"reliability_{method}.png")
    report = json.loads((tmp_path / "results.json").read_text())
    methods = {"sgd", "adam", "vi-diag", "vi-kfac"} | ({"ivon"} if importlib.util.find_spec("ivon") else set())
    assert set(report["results"]) == methods
    for r in report["results"].values():
        assert set(r["entropy_ood"]) == {"rotated90", "flipped", "noise", "gaussian_noise"}
    assert is_png(tmp_path / "ood_entropy.png") and str(tmp_path / "ood_entropy.png") in report["figures"]


def test_binary_classification_runs(tmp_path: Path) -> None:
    out = run_script("examples/binary_classification.py", "--epochs", "2", "--mc-samples", "2", "--no-progress",
                     "--methods", *("adam", "sso-kfac", "sso-adaptive", "vi-diag", "vi-kfac"),
                     "--json", str(tmp_path / "bc.json"))
    assert "test NLL" in out
    report = json.loads((tmp_path / "bc.json").read_text())
    assert [r["method"] for r in report["results"]] == ["adam", "sso-kfac", "sso-adaptive", "vi-diag", "vi-kfac"]
    for r in report["results"]:
        assert set(r["test"]) == {"accuracy", "nll", "brier", "ece"} and r["skipped_steps"] == 0


def test_bayesian_digits_entropy_plot_path_and_ivon(tmp_path: Path) -> None:
    pytest.importorskip("ivon")
    plot = tmp_path / "sub" / "entropy.png"
    out = run_script("examples/bayesian_digits.py", "--epochs", "1", "--mc-samples", "2", "--no-progress",
                     "--methods", "ivon", "adam", "--out-dir", str(tmp_path), "--entropy-plot", str(plot))
    assert "| ivon |" in out
    assert is_png(plot)
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report["results"]) == {"ivon", "adam"}
    assert report["results"]["ivon"]["accuracy"] > 0.5


def test_step_overhead_quick(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "so.json", tmp_path / "so.png"
    out = run_script("benchmarks/step_overhead.py", "--quick", "--epochs", "1", "--json", str(out_json),
                     "--plot", str(out_png), timeout=180)
    assert "measured/floor" in out
    report = json.loads(out_json.read_text())
    assert report["machine"]["cores"] and report["timing"] and report["convergence"]["best"]
    names = {r["optimizer"] for r in report["timing"]}
    assert {"sgd", "adam", "sso-kfac 10/100", "sso-kfac 1/1", "sso-diag"} <= names
    assert all(r["min_s"] > 0 for r in report["timing"])
    for r in report["timing"]:  # every row's ratios to both baselines of its model and batch, SGD's own included
        adam = next(a for a in report["timing"] if a["optimizer"] == "adam" and (a["model"], a["batch"]) == (r["model"], r["batch"]))
        assert r["ratio_adam_min"] == r["min_s"] / adam["min_s"]
    assert is_png(out_png)


def test_kfac_flop_floor_matches_hand_count() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.step_overhead import kfac_flops
    finally:
        sys.path.remove(str(ROOT))
    dims = [{"m": 4, "n": 2, "T": 3}]
    f = kfac_flops(dims, batch=5, curv_interval=1, inv_interval=1, eigen=False)
    assert f["sgd"] == 6 * 5 * 3 * 4 * 2
    assert f["precondition"] == 2 * 4 * 2 * 6
    assert f["factors"] == 2 * 5 * 3 * (16 + 4)
    assert f["decompositions"] == 9 * (64 + 8)
    assert f["floor"] == pytest.approx(1 + (96 + 600 + 648) / 720)
    # as autograd runs SGD: the first layer's input gets no gradient (4·B·T·m·n there, 6 elsewhere)
    two = [{"m": 4, "n": 2, "T": 3}, {"m": 2, "n": 3, "T": 1}]
    g = kfac_flops(two, batch=5, curv_interval=1, inv_interval=1, eigen=False, first_input_grad=False)
    assert g["sgd"] == 4 * 5 * 3 * 4 * 2 + 6 * 5 * 1 * 2 * 3
    assert g["floor"] > kfac_flops(two, batch=5, curv_interval=1, inv_interval=1, eigen=False)["floor"]


def test_vi_benchmark_quick(tmp_path: Path) -> None:
    out_json = tmp_path / "vi.json"
    out = run_script("benchmarks/vi.py", "--quick", "--epochs", "1", "--json", str(out_json), timeout=400)
    assert "x Adam" in out
    report = json.loads(out_json.read_text())
    assert {"vi-diag", "vi-kfac", "adam"} <= {r["optimizer"] for r in report["timing"]}
    assert set(report["quality"]) == {"digits-mlp", "digits-cnn", "diabetes"}
    assert {"vi-diag", "vi-kfac", "sgd", "adam"} <= set(report["quality"]["digits-cnn"]["methods"])
    assert set(report["long"]) == {"digits-mlp"}
    assert report["machine"]["torch"]
