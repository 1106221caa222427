"""CPU smoke runs of the ResNet K-FAC examples: one process each, and 2 ranks under torchrun and mpiexec."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import launch_example, require_mpiexec

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--synthetic", "--image-size", "16", "--num-classes", "4", "--width", "4", "--epochs", "1",
         "--steps-per-epoch", "2", "--batch-size", "8"]
SCRIPTS = ["examples/cifar10_resnet.py", "examples/imagenet_resnet.py"]


def _launch(prefix, script, *args, timeout=120.0) -> str:
    return launch_example(prefix, script, *args, timeout=timeout)


def _check(out: str, world: int) -> None:
    lines = out.strip().splitlines()
    assert lines and lines[-1].startswith("final test accuracy:"), out
    assert out.count("final test accuracy") == 1, out  # only rank 0 prints
    assert out.count("epoch 1/1:") == 1 and "step time" in out, out
    assert f"{world} process(es)" in out, out


@pytest.mark.parametrize("script", SCRIPTS)
def test_single_process(script):
    _check(_launch([sys.executable], script, *SMALL), world=1)


def test_no_kfac_and_help():
    out = _launch([sys.executable], SCRIPTS[0], *SMALL, "--no-kfac")
    _check(out, world=1)
    assert "K-FAC off" in out
    assert "--kfac-grad-worker-fraction" in _launch([sys.executable], SCRIPTS[1], "--help")


def test_imagenet_data_dir_needs_torchvision(tmp_path):
    try:
        import torchvision  # noqa: F401
        pytest.skip("torchvision is installed: the ImageFolder loader is used")
    except ImportError:
        pass
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / SCRIPTS[1]), "--data-dir", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "torchvision" in proc.stderr


def test_cifar_pickle_loader(tmp_path):
    import pickle

    import numpy as np

    rng = np.random.default_rng(0)
    for name in ("data_batch_1", "data_batch_2", "test_batch"):
        with open(tmp_path / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (32, 3072), dtype=np.uint8),
                         b"labels": rng.integers(0, 10, 32).tolist()}, f)
    out = _launch([sys.executable], SCRIPTS[0], "--data-dir", str(tmp_path), "--width", "4", "--epochs", "1",
                  "--steps-per-epoch", "2", "--batch-size", "8")
    _check(out, world=1)
    assert "classes=10" in out


def test_torchrun_two_ranks():
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    out = _launch(prefix, SCRIPTS[0], *SMALL, "--kfac-grad-worker-fraction", "mem-opt")
    _check(out, world=2)
    assert "[torch]" in out and "MEM_OPT" in out


def test_mpiexec_two_ranks():
    mpiexec = require_mpiexec()
    out = _launch([mpiexec, "-n", "2", sys.executable], SCRIPTS[1], *SMALL, "--kfac-grad-worker-fraction", "comm-opt")
    _check(out, world=2)
    assert "[mpi]" in out and "COMM_OPT" in out


def test_torchrun_two_ranks_kfac_pytorch_options():
    """kfac_pytorch's example options (schedulers, update-step decay, skip layers, strategy) reach the run."""
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = list(SMALL)
    args[args.index("--epochs") + 1] = "2"
    args += ["--kfac-strategy", "mem-opt", "--no-kfac-colocate-factors", "--kfac-inv-method",
        "--kfac-factor-update-steps", "1", "--kfac-inv-update-steps", "2", "--kfac-damping-decay", "1",
        "--kfac-update-steps-decay", "2", "--kfac-skip-layers", "Linear", "--lr-decay", "2", "--warmup-epochs", "1",
             "--batches-per-allreduce", "2"]
    out = _launch(prefix, SCRIPTS[0], *args)
    assert "2 process(es) [torch]" in out and "K-FAC on (MEM_OPT, 20 layers, INVERSE)" in out, out
    # after epoch 1: damping x0.5 (decay epoch 1), warm-up over (lr 0.1); after epoch 2: damping x0.5 again
    # (kfac_pytorch's compounding factor rule), update steps x10 (decay epoch 2), lr x0.1 (lr decay epoch 2);
    # 2 batches per epoch, 2 batches per allreduce: one optimizer (and K-FAC) step per epoch
    assert ("K-FAC for epoch 2: damping 0.0015, factor_update_steps 1, inv_update_steps 2, lr 0.1, "
            "K-FAC steps so far 1") in out, out
    assert ("K-FAC for epoch 3: damping 0.00075, factor_update_steps 10, inv_update_steps 20, lr 0.01, "
            "K-FAC steps so far 2") in out, out
    assert out.strip().splitlines()[-1].startswith("final test accuracy:")


def test_kfac_inv_update_steps_zero_turns_kfac_off():
    out = _launch([sys.executable], SCRIPTS[0], *SMALL, "--kfac-inv-update-steps", "0")
    _check(out, world=1)
    assert "K-FAC off" in out


def test_batches_per_allreduce_accumulates():
    """3 batches, 2 per optimizer step: steps after batch 2 and after the last (partial) group."""
    args = list(SMALL)
    args[args.index("--steps-per-epoch") + 1] = "3"
    out = _launch([sys.executable], SCRIPTS[0], *args, "--batches-per-allreduce", "2")
    _check(out, world=1)
    assert "K-FAC steps so far 2" in out, out
    out = _launch([sys.executable], SCRIPTS[0], *args)
    assert "K-FAC steps so far 3" in out, out


def test_mpiexec_and_torchrun_report_the_same_run():
    """BatchNorm's running statistics: DDP broadcasts rank 0's (torchrun); the MPI path broadcasts them before
    evaluating, so both launchers evaluate the same model (the test loss differed before)."""
    mpiexec = require_mpiexec()
    args = [*SMALL, "--kfac-grad-worker-fraction", "comm-opt"]
    runs = [_launch([mpiexec, "-n", "2", sys.executable], SCRIPTS[0], *args),
            _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
                    SCRIPTS[0], *args)]
    results = [next(line for line in out.splitlines() if line.startswith("epoch 1/1:")).split("| step time")[0]
               for out in runs]
    assert results[0] == results[1], runs
