"""Tied parameters (one ``Parameter`` held by several modules, e.g. ``head.weight = emb.weight``).

One block per parameter, in the layout of the first module holding it, with the contributions of
every use summed (:mod:`curvature.tied`): diag and full blocks are exact (built from the summed
per-example gradients, cross terms between uses included) and are checked against the brute-force
reference for every kind; K-FAC is ``(Σ_u L_u) ⊗ (Σ_u R_u) / U``, checked against its definition
from the per-use factors and against the exact block where it is exact.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import curvature
from curvature.engine import CurvatureEngine
from reference import Reference, sample_labels

V, D, N, T = 5, 3, 4, 3
KINDS = ["fisher", "fisher_mc", "empirical_fisher", "hessian"]


class TiedLM(nn.Module):
    """Embedding → Linear → tanh → mean over positions → head whose weight is the embedding's."""

    def __init__(self, head_bias: bool = True, d: int = D, v: int = V) -> None:
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(d, v, bias=head_bias)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(self.emb(x))).mean(1))


def _batch(seed: int = 0, head_bias: bool = True, loss: str = "cross_entropy"):
    torch.manual_seed(seed)
    model = TiedLM(head_bias).double()
    x = torch.randint(0, V, (N, T))
    y = torch.randint(0, V, (N,)) if loss == "cross_entropy" else torch.randn(N, V, dtype=torch.float64)
    return model, x, y


def _kw(kind: str, seed: int = 3) -> dict:
    # the engine draws the reference's labels from an identically seeded generator
    return dict(mc_samples=2, generator=torch.Generator().manual_seed(seed)) if kind == "fisher_mc" else {}


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("approx", ["full", "diag"])
@pytest.mark.parametrize("kind", KINDS)
def test_tied_embedding_blocks_equal_brute_force(kind: str, approx: str, loss: str) -> None:
    """The tied weight's block is the exact block of the parameter (both uses, cross terms included)."""
    model, x, y = _batch(loss=loss)
    ref = Reference(model, x, y, loss)
    assert ref.names == ["emb.weight", "lin.weight", "lin.bias", "head.bias"]
    labels = sample_labels(loss, ref.outputs, 2, 3) if kind == "fisher_mc" else None
    c = curvature.compute(model, x, y, loss=loss, kind=kind, approx=approx, **_kw(kind))
    assert list(c.blocks) == ["emb", "lin", "head"]
    assert c.blocks["head"].layout.param_names == ("bias",)
    expected = ref.shaped(kind, approx, labels)
    scale = max(1.0, float(expected.abs().max()))
    assert float((c.dense() - expected).abs().max()) <= 1e-8 * scale


def test_sum_of_per_use_blocks_would_miss_the_cross_terms() -> None:
    """The reason the per-example gradients are summed first: the blocks of the two uses, added,
    differ from the exact block."""
    model, x, y = _batch(head_bias=False)
    untied = copy.deepcopy(model)
    untied.head.weight = nn.Parameter(model.emb.weight.detach().clone())
    tied = curvature.compute(model, x, y, kind="fisher", approx="full").blocks["emb"].dense()
    parts = curvature.compute(untied, x, y, kind="fisher", approx="full").blocks
    summed = parts["emb"].dense() + parts["head"].dense()
    assert float((tied - summed).abs().max()) > 1e-3 * float(tied.abs().max())


def test_tied_blocks_from_the_users_backward() -> None:
    """Empirical Fisher from the gradients recorded during the user's own backward (the optimizers'
    ``curvature='empirical_fisher'`` without targets) equals the brute-force block too."""
    model, x, y = _batch()
    ref = Reference(model, x, y, "cross_entropy")
    for approx in ("full", "diag"):
        engine = CurvatureEngine(model, kind="empirical_fisher", approx=approx)
        model.zero_grad()
        with engine.capture(record_backward=True) as cap:
            nn.functional.cross_entropy(model(x), y).backward()
        got = torch.block_diag(*[b.dense() for b in engine.estimate_from_backward(cap).values()])
        expected = ref.shaped("empirical_fisher", approx)
        assert float((got - expected).abs().max()) <= 1e-8 * max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("kind", ["fisher", "fisher_mc", "empirical_fisher"])
def test_tied_kfac_is_the_documented_combination_of_the_per_use_factors(kind: str) -> None:
    """``(A_emb + G_head) ⊗ (G_emb + A_head) / 2`` (row factor ⊗ column factor of ``[V, D]``), with the
    per-use factors from an untied copy (whose K-FAC blocks the reference tests check)."""
    model, x, y = _batch(head_bias=False)
    untied = copy.deepcopy(model)
    untied.head.weight = nn.Parameter(model.emb.weight.detach().clone())
    got = curvature.compute(model, x, y, kind=kind, approx="kfac", **_kw(kind)).blocks
    per_use = curvature.compute(untied, x, y, kind=kind, approx="kfac", **_kw(kind)).blocks
    assert list(got) == ["emb", "lin"]  # the head has no parameter of its own
    left = torch.diag(per_use["emb"].A) + per_use["head"].G
    right = (per_use["emb"].G + per_use["head"].A) / 2
    expected = torch.kron(left, right)  # row-major vec of the [V, D] weight: the flat order
    assert float((got["emb"].dense() - expected).abs().max()) <= 1e-12 * float(expected.abs().max())
    for name in ("lin",):
        assert torch.allclose(got[name].dense(), per_use[name].dense(), rtol=0, atol=1e-14)


class SharedTwice(nn.Module):
    """Two bias-free Linears sharing one weight on the same input, outputs side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2, bias=False)
        self.b = nn.Linear(3, 2, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), torch.tanh(self.b(x))], dim=1)


@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher"])
def test_tied_kfac_equals_the_exact_block_where_it_is_exact(kind: str) -> None:
    """Both uses see the same input (equal column factors ``A``), one example, and the uses' output
    gradients never overlap (MSE on disjoint output halves: no cross terms between uses for the
    exact Fisher; the empirical Fisher has them, so it is *not* exact there)."""
    torch.manual_seed(2)
    model = SharedTwice().double()
    x = torch.randn(1, 3, dtype=torch.float64)
    y = torch.randn(1, 4, dtype=torch.float64)
    ref = Reference(model, x, y, "mse")
    exact = ref.shaped(kind, "full")
    got = curvature.compute(model, x, y, loss="mse", kind=kind, approx="kfac").dense()
    err = float((got - exact).abs().max())
    if kind == "fisher":
        assert err <= 1e-8 * float(exact.abs().max())
    else:
        assert err > 1e-3 * float(exact.abs().max())


def test_kfac_of_a_tied_parameter_next_to_other_parameters_is_not_implemented() -> None:
    model, x, y = _batch()
    model.emb, model.head = model.head, model.emb  # the Linear (weight + bias) now holds the block
    with pytest.raises(NotImplementedError, match=r"tied.*'full' or 'diag'"):
        CurvatureEngine(model, approx={"head": "kfac", "emb": "kfac", "lin": "kfac"})


@pytest.mark.parametrize("face,curv,approx", [("sso", "fisher_mc", "kfac"), ("sso", "empirical_fisher", "kfac"),
                                              ("sso", "empirical_fisher", "diag"), ("vi", "fisher_mc", "kfac"),
                                              ("vi", "fisher_mc", "diag")])
def test_optimizers_train_a_tied_model(face: str, curv: str, approx: str) -> None:
    """Both faces on the tied model: the loss at the (mean) weights falls and the tie survives the steps
    (VI's sampled weights included)."""
    from torchsso2 import SecondOrderOptimizer, VIOptimizer

    model, x, y = _batch(head_bias=False)
    opt = SecondOrderOptimizer(model, lr=0.02, curvature=curv, approx=approx) if face == "sso" else \
        VIOptimizer(model, lr=0.1, dataset_size=1000, curvature=curv, approx=approx)

    def mean_loss() -> float:
        with torch.no_grad():
            return float(nn.functional.cross_entropy(model(x), y))

    before = mean_loss()
    for _ in range(5):  # VI: lr 0.1 of the 1e-3 … 1e-1 range its defaults train in (5 steps of the default 1e-2 are too few here)
        def closure():
            opt.zero_grad()
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            loss.backward()
            return loss, out
        opt.step(closure)
    assert model.head.weight is model.emb.weight
    assert mean_loss() < 0.9 * before, (before, mean_loss())


class FlatHead(TiedLM):
    """The tied head applied to the ``N·T`` positions as one batch: its examples are not the Embedding's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(self.emb(x)))
        return self.head(h.reshape(-1, D)).reshape(x.shape[0], -1)


def test_tied_uses_with_other_batch_sizes_are_refused() -> None:
    torch.manual_seed(0)
    model = FlatHead(head_bias=False).double()
    x = torch.randint(0, V, (N, T))
    with pytest.raises(ValueError, match=r"other batch sizes \[\('head', 12\)\]"):
        curvature.compute(model, x, torch.randn(N, T * V, dtype=torch.float64), loss="mse", kind="fisher_mc",
                          approx="diag", generator=torch.Generator().manual_seed(0))
