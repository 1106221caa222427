"""examples/train_transformer.py: a char-level decoder transformer with sso-kfac, vi-diag and AdamW.

Tiny sizes (d=32, 32-token windows, a few dozen steps): each run takes seconds. The script runs
as a user runs it (a subprocess), the data-parallel run under torchrun with 2 ranks.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import launch_example, require_mpiexec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from examples import train_transformer as tt  # noqa: E402

pytest.importorskip("matplotlib", reason='the example saves a PNG (pip install -e ".[examples]")')

TINY = ["--seq-len", "32", "--d-model", "32", "--batch-size", "16", "--train-chars", "20000",
        "--val-chars", "4000", "--steps-per-epoch", "30", "--no-progress"]


def _run(*args: str, timeout: float = 240.0) -> str:
    return launch_example([sys.executable], "examples/train_transformer.py", *args, timeout=timeout,
                          finished_marker="final val loss")


def test_help_lists_optimizers_and_defaults() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples/train_transformer.py"), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    for word in ("sso-kfac", "vi-diag", "adamw", "--tie-weights", "--plot", "(default: 4)"):
        assert word in out


def test_generated_text_is_seeded_and_encodable() -> None:
    a, b = tt.generate_text(5000, 3), tt.generate_text(5000, 3)
    assert a == b and len(a) == 5000 and a != tt.generate_text(5000, 4)
    ids = tt.encode(a)
    assert ids.min() >= 0 and ids.max() < len(tt.ALPHABET)
    assert "".join(tt.ALPHABET[i] for i in ids.tolist()) == a
    # every sum the generator writes is correct (the text has learnable structure)
    for part in a.split(". ")[:-1]:
        if "=" in part:
            lhs, rhs = part.split("=")
            x, y = lhs.split("+")
            assert int(x) + int(y) == int(rhs)
    with pytest.raises(ValueError, match="alphabet"):
        tt.encode("hello!")


def test_windows_are_shifted_by_one() -> None:
    data = tt.load_text_data(3000, 1000, 16, seed=0)
    assert data.x_train.shape[1] == 16 and torch.equal(data.x_train[0, 1:], data.y_train[0, :-1])
    assert torch.equal(data.x_train[1, 0], data.y_train[0, -1])


def test_model_is_causal_and_ties() -> None:
    torch.manual_seed(0)
    model = tt.CharTransformer(len(tt.ALPHABET), d_model=16, num_heads=4, num_layers=2, max_len=8).eval()
    ids = torch.randint(0, len(tt.ALPHABET), (2, 8))
    out = model(ids)
    assert out.shape == (2, 8, len(tt.ALPHABET))
    changed = ids.clone()
    changed[:, 5] = (changed[:, 5] + 1) % len(tt.ALPHABET)
    with torch.no_grad():  # positions before 5 do not see the change
        assert torch.allclose(model(changed)[:, :5], out[:, :5], atol=1e-6)
        assert not torch.allclose(model(changed)[:, 5:], out[:, 5:], atol=1e-6)
    tied = tt.CharTransformer(len(tt.ALPHABET), d_model=16, num_heads=4, max_len=8, tie_weights=True)
    assert tied.head.weight is tied.tok.weight
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_tie_default_follows_library_support() -> None:
    """Tying is the default where the library supports tied parameters; --untie-weights (or
    --no-tie-weights) opts out; asking for tying where the library refuses it is an error."""
    assert tt.tying_supported()  # torchsso2 has one block per tied parameter (tests/test_tied_parameters.py)
    assert tt.parse_args([]).tie_weights is True
    assert tt.parse_args(["--untie-weights"]).tie_weights is False
    assert tt.parse_args(["--no-tie-weights"]).tie_weights is False
    assert tt.parse_args(["--tie-weights", "--optimizer", "sso-kfac"]).tie_weights is True
    assert tt.parse_args([], tie_default=False).tie_weights is False
    with pytest.raises(SystemExit):
        tt.parse_args(["--tie-weights", "--optimizer", "sso-kfac"], tie_default=False)
    assert tt.parse_args(["--tie-weights", "--optimizer", "adamw"], tie_default=False).tie_weights is True


def test_tied_embeddings_start_at_one_scale() -> None:
    """The tied model's token and positional tables both start at the head's U(±1/√d) scale (a
    positional table at N(0, 1) drowned the token signal and the tied model trained much more slowly)."""
    torch.manual_seed(0)
    d = 64
    tied = tt.CharTransformer(len(tt.ALPHABET), d_model=d, max_len=128)
    assert tied.head.weight is tied.tok.weight
    for emb in (tied.tok, tied.pos):
        assert float(emb.weight.abs().max()) <= d ** -0.5 and float(emb.weight.std()) > 0.5 * d ** -0.5 / 3 ** 0.5
    untied = tt.CharTransformer(len(tt.ALPHABET), d_model=d, max_len=128, tie_weights=False)
    assert untied.head.weight is not untied.tok.weight and float(untied.pos.weight.std()) > 0.5


@pytest.mark.parametrize("optimizer", ["adamw", "sso-kfac", "vi-diag"])
def test_short_run(optimizer: str, tmp_path: Path) -> None:
    out = _run("--optimizer", optimizer, "--epochs", "2", *TINY, "--json", str(tmp_path / "r.json"),
               "--plot", str(tmp_path / "loss.png"))
    assert out.count("val loss") >= 3 and "final val loss" in out
    res = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert res["optimizer"] == optimizer and res["steps"] == 60 and res["skipped_steps"] == 0
    val = [h["val_loss"] for h in res["history"]]
    assert len(val) == 3 and all(math.isfinite(v) for v in val)
    assert abs(val[0] - math.log(len(tt.ALPHABET))) < 0.5  # untrained: about uniform over the characters
    if optimizer in ("adamw", "sso-kfac"):
        # the validation loss falls every epoch, well below the uniform log(V) ≈ 3.58
        assert val[2] < val[1] < val[0] and val[2] < 2.5, val
    else:
        assert val[2] < val[0], val
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_torchrun_two_ranks_matches_one_process(tmp_path: Path) -> None:
    """Data-parallel K-FAC on 2 ranks: one report, and about the validation loss of one process."""
    args = ["--optimizer", "sso-kfac", "--epochs", "1", *TINY]
    single = json.loads(_run(*args, "--json", str(tmp_path / "one.json")) and (tmp_path / "one.json").read_text())
    out = launch_example([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
                         "examples/train_transformer.py", *args, "--json", str(tmp_path / "two.json"),
                         timeout=240.0, finished_marker="final val loss")
    assert out.count("final val loss") == 1 and "on 2 ranks (torchrun)" in out
    two = json.loads((tmp_path / "two.json").read_text())
    v1, v2 = single["results"][0]["final_val_loss"], two["results"][0]["final_val_loss"]
    assert v2 < 3.0 and abs(v1 - v2) < 0.15, (v1, v2)


def test_mpiexec_two_ranks_matches_one_process(tmp_path: Path) -> None:
    """The same data-parallel run under ``mpiexec -n 2`` (MPI communicator): one report, about the
    validation loss of one process."""
    mpiexec = require_mpiexec()
    args = ["--optimizer", "sso-kfac", "--epochs", "1", *TINY]
    _run(*args, "--json", str(tmp_path / "one.json"))
    single = json.loads((tmp_path / "one.json").read_text())
    out = launch_example([mpiexec, "-n", "2", sys.executable], "examples/train_transformer.py", *args,
                         "--json", str(tmp_path / "two.json"), timeout=240.0, finished_marker="final val loss")
    assert out.count("final val loss") == 1 and "on 2 ranks (mpiexec)" in out
    two = json.loads((tmp_path / "two.json").read_text())
    v1, v2 = single["results"][0]["final_val_loss"], two["results"][0]["final_val_loss"]
    assert v2 < 3.0 and abs(v1 - v2) < 0.15, (v1, v2)


def test_adamw_refused_under_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="single-process"):
        tt.train(tt.parse_args(["--optimizer", "adamw", *TINY]))


def test_benchmark_quick_run(tmp_path: Path) -> None:
    """benchmarks/transformer.py --quick: every timing row with its ratio to AdamW, and the quality part."""
    out_json = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/transformer.py"), "--quick", "--json", str(out_json)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out_json.read_text())
    names = [r["optimizer"] for r in report["timing"]]
    assert names == ["adamw", "sso-kfac 10/100", "vi-diag 10/100", "vi-diag (defaults)"]
    assert report["timing"][0]["ratio_adamw_min"] == 1.0 and all(r["min_s"] > 0 for r in report["timing"])
    q = report["quality"]
    assert q["budgets"] == [20, 30] and [r["seed"] for r in q["seeds"]] == [0]
    r = q["seeds"][0]
    assert [a["lr"] for a in r["adamw"]] == q["adamw_lrs"] == [3e-3, 5e-3]
    assert all(a["steps"] == 30 for a in r["adamw"]) and r["sso-kfac"]["steps"] == 30
    for b in r["budgets"]:  # the target is the best AdamW's validation loss after the budget's steps
        at = {a["lr"]: next(c["val_loss"] for c in a["curve"] if c["step"] == b["budget_steps"]) for a in r["adamw"]}
        assert b["target_val_loss"] == min(at.values()) == at[b["adamw_best_lr"]] < math.log(len(tt.ALPHABET))
        assert b["adamw_steps_to_target"] <= b["budget_steps"]
        reached = [c["step"] for c in r["sso-kfac"]["curve"] if c["val_loss"] <= b["target_val_loss"]]
        assert b["kfac_steps_to_target"] == (reached[0] if reached else None)
    assert "| sso-kfac 10/100 |" in proc.stdout and "K-FAC steps / s to target" in proc.stdout
