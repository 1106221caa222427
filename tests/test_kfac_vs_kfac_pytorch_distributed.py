"""Issue #14 proof (b): under the same 2-rank torch.distributed launch (DDP, gloo), our
KFACPreconditioner's preconditioned gradients equal kfac_pytorch's, for COMM_OPT/MEM_OPT/HYBRID,
eigen and inverse. Opt-in: skipped unless kfac_pytorch is installed (README, "How we know the math is right": from PyPI where
the index has it, else from its repository or a source snapshot)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_gloo_ranks

pytest.importorskip("kfac.preconditioner", reason="kfac_pytorch is not installed (opt-in comparison): pip install kfac-pytorch==0.4.2")

SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"


def _spawn(world_size: int, out_dir: Path) -> list:
    sys.path.insert(0, str(SCRIPTS))
    import kfac_vs_kfacpt_worker as worker

    codes = run_gloo_ranks(worker, world_size, out_dir, 240.0)
    assert codes == [0] * world_size, f"ranks exited with {codes}"
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


def test_two_ranks_match_kfac_pytorch(tmp_path):
    ranks = _spawn(2, tmp_path)
    for rank, results in enumerate(ranks):
        for name, traces in results.items():
            ours, theirs = traces["ours"], traces["theirs"]
            rel = float((ours - theirs).abs().max() / theirs.abs().max())
            print(f"rank {rank} {name}: max relative difference {rel:.2e}")
            assert rel < 1e-4, (rank, name, rel)
