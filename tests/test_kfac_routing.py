"""KFACPreconditioner with ranks routed through different registered layers (2 real processes).

Each rank sends its shard through another head at some steps (tests/dist_scripts/kfac_routing_worker.py):
the ranks agree on which layers were updated (an all-reduce of one count per layer) and average
each updated layer's factors over the ranks that updated it. Checks, for gloo under
DistributedDataParallel and for mpiexec: the preconditioned gradients and the factors are the same on
every rank and equal one process feeding the ranks' shards as accumulated micro-batches (float64,
1e-9); no rank warns that a layer another rank used was unrecorded. Before, ranks averaged one head's
factors with another's and then waited in different broadcasts until the collective timeout.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch

SCRIPTS = Path(__file__).parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))

import kfac_routing_worker as worker  # noqa: E402
from models import Experts  # noqa: E402
from dist_utils import mpi_env, require_mpiexec, run_gloo_ranks  # noqa: E402

DEADLINE_S = 120.0
RTOL = 1e-9


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _check(results: List[Dict[str, Any]]) -> None:
    for name in worker.CONFIGS:
        ref_grads, ref_factors = worker.single_process(name)
        for rank, res in enumerate(results):
            got = res[name]
            assert torch.equal(got["grads"], results[0][name]["grads"]), (name, rank)
            assert _rel(got["grads"], ref_grads) < RTOL, (name, rank, _rel(got["grads"], ref_grads))
            assert sorted(got["factors"]) == sorted(ref_factors), (name, rank)
            for key, ref in ref_factors.items():
                assert _rel(got["factors"][key], ref) < RTOL, (name, rank, key)
            assert not [w for w in got["warnings"] if "no forward of them was recorded" in w], got["warnings"]
        # every head was used, and preconditioned: the heads' factors are not the identity any more
        assert {k.split(".")[1] for k in ref_factors if k.startswith("heads.")} == {"a", "b", "c"}


def test_routed_ranks_gloo_ddp(tmp_path):
    codes = run_gloo_ranks(worker, 2, tmp_path, DEADLINE_S)
    assert codes == [0, 0], f"gloo ranks exited with {codes} (None: killed after {DEADLINE_S} s)"
    _check([torch.load(tmp_path / f"torch_rank{r}.pt") for r in range(2)])


def test_routed_ranks_mpiexec(tmp_path):
    mpiexec = require_mpiexec()
    cmd = [mpiexec, "-n", "2", sys.executable, str(SCRIPTS / "kfac_routing_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 0, f"mpiexec failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    _check([torch.load(tmp_path / f"mpi_rank{r}.pt") for r in range(2)])


def test_single_process_reference_routes_each_shard_through_its_head():
    """The reference itself: a head one micro-batch used gets that micro-batch's factors alone (its
    A factor after step 0 is decay·I + (1 − decay)·ã ãᵀ mean of that shard)."""
    from torchsso2.distributed import LocalCommunicator
    from torchsso2.kfac import KFACPreconditioner

    model = worker.build()
    pre = KFACPreconditioner(model, communicator=LocalCommunicator(), accumulation_steps=2,
                             **{**worker.BASE, **worker.CONFIGS["comm_opt-eigen"]})
    for r in range(2):
        x, y = worker.shard(0, r)
        torch.nn.functional.cross_entropy(model(x, worker.ROUTE[0][r]), y).backward()
    pre.step()
    x0, _ = worker.shard(0, 0)
    h = torch.cat([torch.tanh(model.trunk(x0)), torch.ones(len(x0), 1, dtype=worker.DT)], 1).detach()
    expected = 0.9 * torch.eye(7, dtype=worker.DT) + 0.1 * h.T @ h / len(x0)
    assert _rel(pre.layers["heads.a"].a_factor, expected) < 1e-12
    assert not pre.layers["heads.c"].has_factors()


def test_an_expert_called_on_no_rows_counts_as_not_called():
    """A mixture-of-experts expert no row was routed to and that is called anyway (on 0 rows) adds nothing,
    as under kfac_pytorch: the factors and preconditioned gradients equal those of skipping the call. Before,
    it raised an "empty batch" error whose advice (skip empty batches) did not apply."""
    from torchsso2.distributed import LocalCommunicator
    from torchsso2.kfac import KFACPreconditioner

    runs = []
    for call_empty in (False, True):
        model = Experts(call_empty).double()
        pre = KFACPreconditioner(model, communicator=LocalCommunicator(), damping=0.01)
        grads = []
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(6, 4, generator=g, dtype=torch.float64)
            y = torch.randint(0, 3, (6,), generator=g)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            pre.step()
            grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                    for p in model.parameters()]))  # (an expert called on no rows: zeros)
        runs.append((grads, {n: (l.a_factor, l.g_factor) for n, l in pre.layers.items() if l.has_factors()},
                     model.empty_calls))
    (g0, f0, _), (g1, f1, empty_calls) = runs
    assert empty_calls > 0  # some expert was called on no rows
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert f0.keys() == f1.keys() and all(torch.equal(f0[n][i], f1[n][i]) for n in f0 for i in (0, 1))


def test_an_empty_batch_is_named_whatever_the_output_and_the_batch_axis():
    """The empty-batch error comes from the registered layers' calls (all without rows), not from the output's
    shape: a dict output, a sequence-first batch ``[T, 0, d]``; a model whose layers had rows but whose
    output is empty (every label ignored) is not an empty batch."""
    import pytest

    from torchsso2.kfac import KFACPreconditioner

    class DictOut(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 3)

        def forward(self, x):
            return {"logits": self.a(x)}

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 3)

        def forward(self, x, keep):
            return self.a(x)[keep]

    model = DictOut()
    kept = [KFACPreconditioner(model)]  # (a dropped preconditioner removes its hooks)
    with pytest.raises(ValueError, match="the model ran on an empty batch"):
        model(torch.randn(0, 4))
    seq = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    kept.append(KFACPreconditioner(seq))
    with pytest.raises(ValueError, match="the model ran on an empty batch"):
        seq(torch.randn(5, 0, 4))  # sequence-first, no examples
    masked = Masked()
    pre = KFACPreconditioner(masked)
    out = masked(torch.randn(6, 4), torch.zeros(6, dtype=torch.bool))  # every row ignored: empty output only
    assert out.shape == (0, 3) and pre._mini_steps["a"] == 1


MISMATCH = """
import torch
from torch import nn
from torchsso2.distributed import average_gradients, get_communicator

comm = get_communicator("auto")
for frozen in ([0], [0, 2], []):  # on rank 1 only: a shorter list of trainable parameters, none, the same
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    if comm.rank == 1:
        for i in frozen:
            model[i].requires_grad_(False)
    out = model(torch.randn(5, 4)).square().sum()
    if out.requires_grad:
        out.backward()
    try:
        average_gradients(model.parameters(), comm)
        print(f"{frozen} rank {comm.rank}: averaged", flush=True)
    except RuntimeError as err:
        print(f"{frozen} rank {comm.rank}: {err}", flush=True)
"""


def test_average_gradients_refuses_ranks_that_disagree_on_which_parameters_train(tmp_path):
    """Under MPI, ranks reducing lists of other lengths paired one parameter's gradient with another's without an
    error (the probe: the last layer's mean differed between the ranks by 0.2); the count and size of the
    parameters ride first in the all-reduce, and every rank raises."""
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    proc = subprocess.run([require_mpiexec(), "-n", "2", sys.executable, str(script)], env=mpi_env(),
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 0, f"mpiexec failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "[0] rank 0: average_gradients: rank 0 averages gradients of 4 parameters" in proc.stdout, proc.stdout
    assert "[0] rank 1: average_gradients: rank 1 averages gradients of 2 parameters" in proc.stdout, proc.stdout
    # every parameter frozen on one rank: it takes part too (it returned at once, and the other rank waited)
    assert "[0, 2] rank 1: average_gradients: rank 1 averages gradients of 0 parameters" in proc.stdout, proc.stdout
    assert "[0, 2] rank 0: average_gradients: rank 0 averages" in proc.stdout, proc.stdout
    assert proc.stdout.count("the ranks disagree on which parameters train") == 4, proc.stdout
    assert "[] rank 0: averaged" in proc.stdout and "[] rank 1: averaged" in proc.stdout, proc.stdout
