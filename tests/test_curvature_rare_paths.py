"""Rarely taken paths of the curvature engine against the float64 brute force of tests/reference.py.

Each case is a path no other test checks by value (a mutation audit changed the line and the rest
of the suite still passed): the empirical Fisher from a backward of a scaled loss (``loss_scale``,
what the optimizers pass for a GradScaler or a summed loss) and from a loss backpropagated in two
parts, per-sequence gradients of a head on ``N·T`` rows when the rows exceed the engine's example
chunk and ``T`` does not divide it, the Hessian block of a module whose output does not reach the
loss, a module frozen after the engine was built, and BatchNorm without running statistics in eval
mode (it normalizes with the batch). The diagonal Hessian's coupled-example check in float32 is in
tests/test_hessian_diag_audit.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

import curvature
from curvature.engine import _EXAMPLE_CHUNK, CurvatureEngine
from reference import Reference


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def _batch(n: int = 6) -> tuple:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, dtype=torch.float64, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def _block(ref: Reference, mat: torch.Tensor, name: str) -> torch.Tensor:
    s = next(s for s in ref.slices if s.name == name)
    return mat[s.start:s.stop, s.start:s.stop]


@pytest.mark.parametrize("scale", [8.0, 0.125])
def test_empirical_fisher_from_the_backward_of_a_scaled_loss(scale):
    """The backward of ``scale ·`` the mean loss with ``loss_scale = N / scale`` is the empirical
    Fisher of the mean loss: (1/N) Σ_n g_n g_nᵀ of the per-example gradients."""
    model = _mlp()
    x, y = _batch()
    eng = CurvatureEngine(model, kind="empirical_fisher", approx="full")
    with eng.capture(record_backward=True) as cap:
        (F.cross_entropy(eng.select_output(model(x)), y) * scale).backward()
    blocks = eng.estimate_from_backward(cap, loss_scale=x.shape[0] / scale)
    ref = Reference(model, x, y, "cross_entropy")
    want = ref.dense("empirical_fisher")
    for name in ("0", "2"):
        torch.testing.assert_close(blocks[name].dense(), _block(ref, want, name), rtol=1e-10, atol=1e-12)


def test_empirical_fisher_from_a_loss_backpropagated_in_two_parts():
    """Two backward passes through one forward (``retain_graph``) record each module's output
    gradient twice; their sum is the gradient of the whole loss."""
    model = _mlp()
    x, y = _batch()
    eng = CurvatureEngine(model, kind="empirical_fisher", approx="full")
    with eng.capture(record_backward=True) as cap:
        loss = F.cross_entropy(eng.select_output(model(x)), y)
        (0.25 * loss).backward(retain_graph=True)
        (0.75 * loss).backward()
    blocks = eng.estimate_from_backward(cap)
    ref = Reference(model, x, y, "cross_entropy")
    want = ref.dense("empirical_fisher")
    for name in ("0", "2"):
        torch.testing.assert_close(blocks[name].dense(), _block(ref, want, name), rtol=1e-10, atol=1e-12)


class _HeadOnRows(nn.Module):
    """Token ids [N, T] → logits on the N·T rows [N·T, 6] (the loss rows of a sequence model)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.l1 = nn.Linear(4, 5)
        self.l2 = nn.Linear(5, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(self.emb(ids))).reshape(-1, 5))


@pytest.mark.parametrize("approx", ["full", "diag"])
def test_rows_of_sequences_beyond_one_example_chunk(approx):
    """90 loss rows of 30 sequences of 3: more rows than one chunk of the engine's per-example work,
    and 3 does not divide the chunk, so a chunk must end at a sequence boundary. The empirical
    Fisher takes the sequence as the example: (1/(N·T)) Σ_n (Σ_t g_nt)(Σ_t g_nt)ᵀ."""
    n, t = 30, 3
    assert n * t > _EXAMPLE_CHUNK and _EXAMPLE_CHUNK % t != 0
    torch.manual_seed(0)
    model = _HeadOnRows().double()
    gen = torch.Generator().manual_seed(2)
    ids, y = torch.randint(0, 7, (n, t), generator=gen), torch.randint(0, 6, (n * t,), generator=gen)
    got = curvature.compute(model, ids, y, kind="empirical_fisher", approx=approx)
    params = dict(model.named_parameters())
    for name in ("l1", "l2"):
        names = [f"{name}.weight", f"{name}.bias"]

        def rows(*ps: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(model, dict(zip(names, ps)), (ids,)), y, reduction="none")
        jac = jacrev(rows, argnums=(0, 1))(*[params[k].detach() for k in names])
        per_sequence = torch.cat([j.reshape(n * t, -1) for j in jac], 1).reshape(n, t, -1).sum(1)
        want = per_sequence.t() @ per_sequence / (n * t)
        if approx == "diag":
            want = torch.diag(torch.diagonal(want))
        torch.testing.assert_close(got.blocks[name].dense(), want, rtol=1e-10, atol=1e-12)


class _AuxHead(nn.Module):
    """A head that is called but whose output the loss never sees."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.aux = nn.Linear(4, 2)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        self.aux(h)
        return self.head(h)


@pytest.mark.parametrize("approx", ["full", "diag"])
def test_hessian_of_a_module_whose_output_is_unused(approx):
    torch.manual_seed(0)
    model = _AuxHead().double()
    x, y = _batch(5)
    got = curvature.compute(model, x, y, kind="hessian", approx=approx)
    ref = Reference(model, x, y, "cross_entropy")
    want = ref.shaped("hessian", approx)
    for name in ("body", "aux", "head"):
        torch.testing.assert_close(got.blocks[name].dense(), _block(ref, want, name), rtol=1e-10, atol=1e-12)
    assert not got.blocks["aux"].dense().any()


def test_a_module_frozen_after_the_engine_was_built_has_a_zero_block():
    """Freezing the first layer after construction: its output needs no gradient, its block is
    zero, and the trainable layer's block is its exact Fisher (GGN)."""
    model = _mlp()
    x, y = _batch(5)
    eng = CurvatureEngine(model, kind="fisher", approx="full")
    for p in model[0].parameters():
        p.requires_grad_(False)
    with eng.capture() as cap:
        out = eng.select_output(model(x))
    blocks = eng.estimate(cap, out, y)
    assert not blocks["0"].dense().any()
    ref = Reference(model, x, y, "cross_entropy")  # covers the trainable parameters only
    torch.testing.assert_close(blocks["2"].dense(), ref.dense("fisher"), rtol=1e-10, atol=1e-12)


def test_batchnorm_without_running_statistics_in_eval_mode():
    """``BatchNorm1d(track_running_stats=False)`` normalizes with the batch in eval mode too; its
    curvature is the GGN with this batch's statistics held constant (the library's convention),
    here an eval-mode copy whose running statistics are the batch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False), nn.Tanh(),
                          nn.Linear(4, 3)).double()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.5, 0.5)
    model.eval()
    x, y = _batch()
    frozen = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3)).double().eval()
    frozen.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        h = model[0](x)
        frozen[1].running_mean.copy_(h.mean(0))
        frozen[1].running_var.copy_(h.var(0, unbiased=False))
        torch.testing.assert_close(frozen(x), model(x))
    got = curvature.compute(model, x, y, kind="fisher", approx="full")
    ref = Reference(frozen, x, y, "cross_entropy")
    want = ref.dense("fisher")
    for name in ("0", "1", "3"):
        torch.testing.assert_close(got.blocks[name].dense(), _block(ref, want, name), rtol=1e-10, atol=1e-12)
