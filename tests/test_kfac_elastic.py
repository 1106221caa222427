"""KFACPreconditioner checkpoints across a change in the number of ranks (elastic training).

Two gloo ranks under DDP train and each saves its own ``state_dict()`` (per-rank files: the way to a
bit-exact resume on the same ranks); four ranks resume, rank ``r`` from rank ``r % 2``'s file. With
``HYBRID_OPT`` each layer's decomposition was held by one rank of two and is now needed by two ranks of
four, one of which loaded a file without it: that rank decomposed the factors anew while the other used
the saved (older) decomposition, and the replicas drifted apart for good (6.6e-4), silently. The
checkpoint now records where its decompositions were held (``placement``), and a layer whose grad
workers changed is decomposed anew by each of them, so the ranks stay identical.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))

import kfac_elastic_worker as worker  # noqa: E402
from dist_utils import start_ranks  # noqa: E402

DEADLINE_S = 150.0


def test_per_rank_checkpoints_resumed_on_more_ranks_keep_the_ranks_identical(tmp_path):
    for phase, world in (("save", 2), ("load", 4)):
        init = tmp_path / f"init_{phase}"
        codes = start_ranks(worker.main, world, (world, str(init), str(tmp_path), phase),
                            [worker.__name__], DEADLINE_S)
        assert codes == [0] * world, f"{phase}: ranks exited with {codes} (None: killed after {DEADLINE_S} s)"
    saved = [torch.load(tmp_path / f"ckpt{r}.pt", weights_only=True)["pre"]["torchsso2"] for r in range(2)]
    assert [s["placement"]["world_size"] for s in saved] == [2, 2]
    held = [sorted(s["decompositions"]) for s in saved]
    assert held[0] != held[1]  # each rank saved only the layers it was a grad worker of
    weights = [torch.load(tmp_path / f"weights{r}.pt", weights_only=True) for r in range(4)]
    for r in range(1, 4):
        assert torch.equal(weights[r], weights[0]), (r, float((weights[r] - weights[0]).abs().max()))
    assert torch.isfinite(weights[0]).all()


def test_same_placement_keeps_the_saved_decompositions():
    """One process: a checkpoint of the same placement is used as saved (a bit-exact resume); one that records
    another world size has the decompositions recomputed from the factors."""
    from torchsso2.distributed import LocalCommunicator
    from torchsso2.kfac import KFACPreconditioner

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        return model, KFACPreconditioner(model, communicator=LocalCommunicator(), factor_update_steps=1,
                                         inv_update_steps=3)

    model, pre = build()
    for s in range(5):  # decomposed at steps 0 and 3, factors updated at step 4 too: the saved ones are older
        g = torch.Generator().manual_seed(s)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(8, 4, generator=g)),
                                          torch.randint(0, 3, (8,), generator=g)).backward()
        pre.step()
    state = pre.state_dict()
    assert state["torchsso2"]["placement"] == {"world_size": 1, "grad_workers": {"0": [0], "2": [0]},
                                               "decomposition": ["EIGEN", True]}
    _, same = build()
    same.load_state_dict(state)
    for name, layer in same.layers.items():
        for key, t in layer.inv.items():
            assert torch.equal(t, pre.layers[name].inv[key]), (name, key)
    state["torchsso2"]["placement"]["world_size"] = 2  # as if saved by a rank of two
    state["torchsso2"]["placement"]["grad_workers"] = {"0": [0, 1], "2": [0, 1]}
    _, moved = build()
    moved.load_state_dict(state)
    fresh = build()[1]
    fresh.load_state_dict({k: v for k, v in state.items() if k != "torchsso2"})  # kfac_pytorch's format: recomputed
    for name, layer in moved.layers.items():
        assert not torch.equal(layer.inv["qa"], pre.layers[name].inv["qa"]) or not torch.equal(
            layer.inv["dgda"], pre.layers[name].inv["dgda"]), name
        for key, t in layer.inv.items():
            assert torch.equal(t, fresh.layers[name].inv[key]), (name, key)


def test_native_optimizers_resume_on_another_number_of_ranks(tmp_path):
    """SecondOrderOptimizer (``mem_opt`` K-FAC, diag) and VIOptimizer (diag, K-FAC): a checkpoint saved on one
    rank loads on two (the placement and the ranks' label streams are built for the loading world); the
    ranks stay identical and the run finite (docs/scaling.md, "Checkpoints")."""
    import native_elastic_worker as native

    for phase, world in (("save", 1), ("load", 2)):
        codes = start_ranks(native.main, world, (world, str(tmp_path / f"init_{phase}"), str(tmp_path), phase),
                            [native.__name__], DEADLINE_S)
        assert codes == [0] * world, f"{phase}: ranks exited with {codes} (None: killed after {DEADLINE_S} s)"
    for name in native.CONFIGS:
        weights = [torch.load(tmp_path / f"{name}_weights{r}.pt", weights_only=True) for r in range(2)]
        assert torch.equal(weights[0], weights[1]), name
        assert torch.isfinite(weights[0]).all() and not torch.equal(weights[0][0], weights[0][-1]), name


def test_another_decomposition_method_or_missing_factors_are_refused_on_every_rank():
    """A checkpoint of the eigen method loaded with compute_method="inverse": each rank's file records the
    method, so a rank whose file holds no decompositions (MEM_OPT) refuses it too, instead of going on alone
    to the next collective. A layer listed as decomposed needs its factors (a moved layer is decomposed
    from them), checked before anything changes."""
    import pytest

    from torchsso2.distributed import LocalCommunicator
    from torchsso2.kfac import KFACPreconditioner

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    pre = KFACPreconditioner(model, communicator=LocalCommunicator())
    torch.nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
    pre.step()
    state = pre.state_dict()
    no_decompositions = {**state, "torchsso2": {**state["torchsso2"], "decompositions": {}}}
    for given in (state, no_decompositions):
        other = KFACPreconditioner(model, communicator=LocalCommunicator(), compute_method="inverse")
        with pytest.raises(ValueError, match=r"\['placement'\]\['decomposition'\] is \['EIGEN', True\].*this "
                                             r"preconditioner uses \['INVERSE', False\]"):
            other.load_state_dict(given)
        assert other.steps == 0
        other.remove_hooks()
    broken = {**state, "layers": {**state["layers"], "0": {"A": None, "G": state["layers"]["0"]["G"]}}}
    fresh = KFACPreconditioner(model, communicator=LocalCommunicator())
    with pytest.raises(ValueError, match=r"\['inv_ready'\] lists \['0'\], whose factors are missing"):
        fresh.load_state_dict(broken)
    assert fresh.steps == 0
