"""Every kind × shape × layer family of ``curvature.compute`` against the brute-force reference.

The reference (``tests/reference.py``) uses only ``torch.func`` in float64; it never calls the
engine. ``fisher_mc`` is compared exactly: the reference redraws the engine's labels from an
identically seeded generator.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import pytest
import torch
from torch import nn

import curvature
from models import MODELS, Norm3d, NormCNN, NormMLP, ResBNCNN, _randomize_norm_stats, _targets
from reference import Reference, freeze_batchnorm, has_kfac, sample_labels

ATOL = 1e-8
KINDS = ["fisher", "fisher_mc", "empirical_fisher", "hessian"]
FISHER_KINDS = ["fisher", "fisher_mc", "empirical_fisher"]
SHAPES = ["full", "diag", "kfac"]
LOSSES = ["cross_entropy", "mse", "binary_cross_entropy"]
N = 4
MC_SAMPLES = 3
SEED = 1234


@functools.lru_cache(maxsize=None)
def case(model_name: str, loss: str) -> Tuple[nn.Module, torch.Tensor, torch.Tensor, Reference]:
    build, batch = MODELS[model_name]
    model = build()
    x, y = batch(N, loss)
    return model, x, y, Reference(model, x, y, loss)


@functools.lru_cache(maxsize=None)
def ref_shaped(model_name: str, loss: str, kind: str, approx: str) -> torch.Tensor:
    _, _, _, ref = case(model_name, loss)
    return ref.shaped(kind, approx, labels_for(ref, kind))


def labels_for(ref: Reference, kind: str) -> Optional[torch.Tensor]:
    return sample_labels(ref.loss, ref.outputs, MC_SAMPLES, SEED) if kind == "fisher_mc" else None


def engine(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str, kind: str, approx, **kw):
    if kind == "fisher_mc":
        kw.setdefault("mc_samples", MC_SAMPLES)
        kw.setdefault("generator", torch.Generator().manual_seed(SEED))
    return curvature.compute(model, x, y, loss=loss, kind=kind, approx=approx, **kw)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL, what: str = "") -> None:
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert err <= atol * max(1.0, expected.abs().max().item()), f"{what}: max abs error {err:.3e}"


# ---- the matrix: model × loss × kind × shape ------------------------------------------------------
# K-FAC of the Hessian is not implemented (tested to raise in test_curvature_errors.py)
KIND_SHAPES = [(k, a) for k in KINDS for a in SHAPES if not (k == "hessian" and a == "kfac")]


@pytest.mark.parametrize("kind,approx", KIND_SHAPES)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_dense_matches_reference(model_name: str, loss: str, kind: str, approx: str) -> None:
    model, x, y, ref = case(model_name, loss)
    c = engine(model, x, y, loss, kind, approx)
    expected = ref_shaped(model_name, loss, kind, approx)
    assert expected.abs().max() > 1e-3, "degenerate reference (the test could not fail)"
    assert_close(c.dense(), expected, what=f"{model_name}/{loss}/{kind}/{approx}")
    # the per-block matrices agree with the dense assembly, module by module
    for s in ref.slices:
        assert expected[s.start:s.stop, s.start:s.stop].abs().max() > 0, f"degenerate reference block {s.name}"
        assert_close(c.blocks[s.name].dense(), expected[s.start:s.stop, s.start:s.stop], what=s.name)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_covered_params_and_order(model_name: str) -> None:
    model, x, y, ref = case(model_name, "cross_entropy")
    c = curvature.compute(model, x, y, kind="fisher", approx="diag")
    named = dict(model.named_parameters())
    assert [id(p) for p in c.params] == [id(named[n]) for n in ref.names]
    assert list(c.blocks) == [s.name for s in ref.slices]
    assert c.dense().shape == (ref.P, ref.P)
    # full keeps cross terms inside a module only (block-diagonal over modules)
    full = curvature.compute(model, x, y, kind="fisher", approx="full").dense()
    outside = ~torch.block_diag(*[torch.ones(s.stop - s.start, s.stop - s.start) for s in ref.slices]).bool()
    assert full[outside].abs().max() == 0


@pytest.mark.parametrize("kind", FISHER_KINDS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("model_name", ["mlp", "cnn", "convt", "convt13", "embedding", "norm_cnn", "inplace_dropout",
                                        "seq_linear"])
def test_kfac_factors_match_reference(model_name: str, loss: str, kind: str) -> None:
    """The factors themselves (not only their Kronecker product, which is blind to A·c, G/c)."""
    model, x, y, ref = case(model_name, loss)
    c = engine(model, x, y, loss, kind, "kfac")
    labels = labels_for(ref, kind)
    checked = 0
    for s in ref.slices:
        if not has_kfac(s.module):
            assert isinstance(c.blocks[s.name], curvature.DiagBlock)
            continue
        blk = c.blocks[s.name]
        assert isinstance(blk, curvature.KFACBlock)
        a, g, _ = ref.kfac(s.name, kind, labels)
        assert_close(blk.A, a, what=f"{s.name}.A")
        assert_close(blk.G, g, what=f"{s.name}.G")
        if isinstance(s.module, nn.Embedding):
            assert blk.A.dim() == 1  # diagonal factor stored as a vector
        checked += 1
    assert checked >= 1


def test_approx_dict_selects_per_module() -> None:
    """Dict keys by type, by class name and by name regex; unmatched modules get the family default."""
    model, x, y, ref = case("norm_mlp", "cross_entropy")
    spec = {"fc2": "full", nn.LayerNorm: "full", "BatchNorm1d": "diag"}  # fc1: default kfac
    c = curvature.compute(model, x, y, kind="fisher", approx=spec)
    assert c.approx == {"fc1": "kfac", "bn": "diag", "ln": "full", "fc2": "full"}
    expected = ref.shaped("fisher", {"fc1": "kfac", "bn": "diag", "ln": "full", "fc2": "full"})
    assert_close(c.dense(), expected)
    # default for norm layers in a dict is diag; first matching key wins
    c2 = curvature.compute(model, x, y, kind="fisher", approx={r"fc\d": "diag", nn.Linear: "full"})
    assert c2.approx == {"fc1": "diag", "bn": "diag", "ln": "diag", "fc2": "diag"}
    assert_close(c2.dense(), ref.shaped("fisher", "diag"))


def test_tuple_inputs_and_multi_batch_sizes() -> None:
    """inputs may be a tuple; batch size 1 and odd sizes work."""
    build, batch = MODELS["mlp"]
    model = build()
    for n in (1, 3):
        x, y = batch(n, "cross_entropy", seed=5)
        ref = Reference(model, x, y, "cross_entropy")
        c = curvature.compute(model, (x,), y, kind="empirical_fisher", approx="full")
        assert_close(c.dense(), ref.shaped("empirical_fisher", "full"))


def test_large_batch_chunking() -> None:
    """More examples than the engine's per-example chunk (64)."""
    build, batch = MODELS["inplace_dropout"]
    model = build()
    x, y = batch(150, "mse", seed=3)
    ref = Reference(model, x, y, "mse")
    for approx in ("full", "diag"):
        c = curvature.compute(model, x, y, loss="mse", kind="fisher", approx=approx)
        assert_close(c.dense(), ref.shaped("fisher", approx))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("out_shape", [(), (2, 2)], ids=["N", "N-2-2"])
def test_mse_on_non_matrix_outputs(out_shape, kind) -> None:
    """mse accepts outputs [N] and [N, ...]: ½‖y − f‖² over all output entries."""
    torch.manual_seed(0)
    d = math.prod(out_shape)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, d), nn.Unflatten(1, out_shape or (1,)))
    if not out_shape:
        model.append(nn.Flatten(0))
    model = model.double()
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randn((5,) + out_shape, dtype=torch.float64)
    ref = Reference(model, x, y, "mse")
    for approx in (["full", "diag"] if kind == "hessian" else SHAPES):
        c = engine(model, x, y, "mse", kind, approx)
        assert_close(c.dense(), ref.shaped(kind, approx, labels_for(ref, kind)), what=approx)


@pytest.mark.parametrize("approx", ["full", "diag"])
def test_hessian_of_a_module_with_more_than_256_parameters(approx: str) -> None:
    """The engine's Hessian is assembled in chunks of HVPs; a 294-parameter Linear spans two."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 14), nn.Tanh(), nn.Linear(14, 3)).double()
    x = torch.randn(4, 20, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    ref = Reference(model, x, y, "cross_entropy")
    c = curvature.compute(model, x, y, kind="hessian", approx=approx)
    assert_close(c.dense(), ref.shaped("hessian", approx))


@pytest.mark.parametrize("training", [False, True])
def test_curvature_does_not_touch_model(training: bool) -> None:
    """compute() leaves parameters, .grad and buffers alone, also in training mode (a BatchNorm's forward
    moved its running statistics and num_batches_tracked by one batch there)."""
    build, batch = MODELS["norm_cnn"]
    model = build().train(training)
    x, y = batch(N, "cross_entropy")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for kind in KINDS:
        for approx in ("full", "diag"):
            curvature.compute(model, x, y, kind=kind, approx=approx)
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not model._forward_hooks and all(not m._forward_hooks for m in model.modules())


# ---- BatchNorm in training mode: batch statistics are constants -----------------------------------
TRAIN_MODELS = {
    # (class, input shape, modules at or after the first BatchNorm, modules before it)
    "norm_mlp": (NormMLP, (4,), ["bn", "ln", "fc2"], ["fc1"]),
    "norm_cnn": (NormCNN, (2, 3, 3), ["bn", "ln", "fc"], ["conv"]),
    "norm3d": (Norm3d, (2, 2, 3, 3), ["bn", "inorm", "fc"], ["conv"]),
    # residual: conv2 sits between two BatchNorms, conv1 feeds both bn1 and the skip ("after" =
    # downstream of every BatchNorm: there even the Hessian needs no frozen statistics)
    "res_bn_cnn": (ResBNCNN, (2, 3, 3), ["bn2", "fc"], ["conv1", "bn1", "conv2"]),
}


@functools.lru_cache(maxsize=None)
def _train_case(name: str, loss: str):
    cls, shape, after, before = TRAIN_MODELS[name]
    torch.manual_seed(0)
    model = _randomize_norm_stats(cls()).double().train()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn((5,) + shape, generator=gen, dtype=torch.float64)
    y = _targets(5, loss, gen)
    ref = Reference(freeze_batchnorm(model, x), x, y, loss)
    return model, x, y, ref, after, before


@pytest.mark.parametrize("kind,approx", KIND_SHAPES)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("name", list(TRAIN_MODELS))
def test_batchnorm_train_mode_frozen_statistics(name: str, loss: str, kind: str, approx: str) -> None:
    """BN's own block and every block downstream of it equal the frozen-statistics reference."""
    model, x, y, ref, after, _ = _train_case(name, loss)
    assert model.training
    c = engine(model, x, y, loss, kind, approx)
    expected = ref.shaped(kind, approx, labels_for(ref, kind))
    for s in ref.slices:
        if s.name in after:
            assert_close(c.blocks[s.name].dense(), expected[s.start:s.stop, s.start:s.stop], what=s.name)


@pytest.mark.parametrize("name", list(TRAIN_MODELS))
def test_batchnorm_train_and_eval_differ(name: str) -> None:
    """Train mode really uses the batch statistics: eval mode (running statistics) gives another block."""
    model, x, y, ref, after, _ = _train_case(name, "cross_entropy")
    bn = after[0]
    train = curvature.compute(model, x, y, kind="fisher", approx="full").blocks[bn].dense()
    model.eval()
    try:
        ev = curvature.compute(model, x, y, kind="fisher", approx="full").blocks[bn].dense()
    finally:
        model.train()
    s = next(s for s in ref.slices if s.name == bn)
    assert_close(train, ref.dense("fisher")[s.start:s.stop, s.start:s.stop])
    assert (train - ev).abs().max() > 1e-3


@pytest.mark.parametrize("kind,approx", [ka for ka in KIND_SHAPES if ka[0] != "hessian"])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("name", list(TRAIN_MODELS))
def test_batchnorm_train_mode_upstream_layers(name: str, loss: str, kind: str, approx: str) -> None:
    """Layers *upstream* of a training-mode BatchNorm get the frozen-statistics blocks too: the
    engine's backward passes route through ``γ/√(σ²_B + ε)`` (curvature/frozen_norm.py); norm_mlp
    takes the vmapped backward, norm_cnn the per-vector loop. (The Hessian keeps the batch
    statistics' second derivatives: it is the Hessian of the loss the model computes.)"""
    model, x, y, ref, _, before = _train_case(name, loss)
    c = engine(model, x, y, loss, kind, approx)
    expected = ref.shaped(kind, approx, labels_for(ref, kind))
    for s in ref.slices:
        if s.name in before:
            assert_close(c.blocks[s.name].dense(), expected[s.start:s.stop, s.start:s.stop], what=s.name)


def test_curvature_restores_a_buffer_the_forward_rebinds() -> None:
    """A forward that rebinds a buffer (``self.count = self.count + 1``) instead of updating it in place:
    the module's buffer is the original tensor again, with its value."""
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.count = self.count + 1
            return self.fc(x)

    model = Counting()
    original = model.count
    curvature.compute(model, torch.randn(4, 3), torch.randint(0, 2, (4,)), kind="fisher", approx="diag")
    assert model.count is original and float(model.count) == 0.0
