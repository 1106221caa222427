"""Models whose loss rows are not their modules' examples: a sequence model whose ``[N, T, C]``
logits are reshaped to ``[N·T, C]`` (the usual language-model loss), so every covered module
sees N examples of T loss rows each.

The Monte-Carlo Fisher stays unbiased there (sampled per-row gradients are independent and
zero-mean, so the cross-row terms of a module example vanish in expectation); the exact Fisher
backpropagates its vectors per position and the empirical Fisher takes the sequence's gradient as
the per-example one (curvature.sequence; more families in tests/test_sequence_curvature.py).
"""
from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

import curvature
from torchsso2 import SecondOrderOptimizer

N, T, V, D, C = 3, 6, 7, 5, 4


def _model_and_batch() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, D), nn.Tanh(), nn.Linear(D, C)).double()
    x = torch.randint(0, V, (N, T))
    y = torch.randint(0, C, (N * T,))
    return model, x, y


def _rows(out: Tensor) -> Tensor:
    return out.reshape(-1, C)


def _rows_closure(opt, model: nn.Module, x: Tensor, y: Tensor):
    """The optimizer closure of a language-model loss: cross-entropy over the ``N·T`` rows."""
    def closure():
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.cross_entropy(_rows(out), y)
        loss.backward()
        return loss, out
    return closure


def _brute_ggn(model: nn.Module, x: Tensor, y: Tensor, loss: str) -> Tensor:
    """``Jᵀ ∇²_f L J`` with ``L`` the engine's mean loss over the ``N·T`` rows (float64 autograd)."""
    from curvature import likelihoods
    from curvature.options import LossType

    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    theta = torch.cat([p.detach().flatten() for p in model.parameters()])

    def f(th: Tensor) -> Tensor:
        params, i = {}, 0
        for n, sh in zip(names, shapes):
            params[n] = th[i:i + sh.numel()].view(sh)
            i += sh.numel()
        return _rows(functional_call(model, params, (x,)))

    out = f(theta).detach()
    jac = jacrev(f)(theta).reshape(out.numel(), -1)  # [R·C, P]
    lt = LossType(loss)
    h = torch.func.hessian(lambda o: likelihoods.mean_nll(lt, o.reshape(out.shape), y))(out.reshape(-1))
    return jac.t() @ h @ jac


@pytest.mark.parametrize("approx", ["diag", "full"])
def test_exact_fisher_of_rows_inside_examples_is_the_ggn(approx: str) -> None:
    """Summing the factor's vectors over a sequence's rows would be 2.4× off on this diagonal; the
    per-position vectors give the GGN over the N·T rows."""
    model, x, y = _model_and_batch()
    ggn = _brute_ggn(model, x, y, "cross_entropy")
    c = curvature.compute(model, x, y, kind="fisher", approx=approx, output_selector=_rows)
    p0 = c.blocks["0"].dense().shape[0]
    for got, ref in ((c.blocks["0"].dense(), ggn[:p0, :p0]), (c.blocks["2"].dense(), ggn[p0:, p0:])):
        if approx == "diag":
            ref = torch.diag(ref.diagonal())
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_empirical_fisher_from_the_users_backward_matches_the_targets_route() -> None:
    """``curvature="empirical_fisher"`` without targets (blocks from the user's backward) gives the
    per-sequence empirical Fisher, as ``curvature.compute`` with the targets does."""
    model, x, y = _model_and_batch()
    opt = SecondOrderOptimizer(model, curvature="empirical_fisher", approx={"Embedding": "kfac", "Linear": "diag"},
                               output_selector=_rows, lr=0.0)
    opt.step(_rows_closure(opt, model, x, y))
    c = curvature.compute(model, x, y, kind="empirical_fisher", approx={"Embedding": "kfac", "Linear": "diag"},
                          output_selector=_rows)
    torch.testing.assert_close(opt.running.blocks["2"].diagonal, c.blocks["2"].diagonal, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(opt.running.blocks["0"].G, c.blocks["0"].G, rtol=1e-10, atol=1e-12)


def test_monte_carlo_fisher_is_unbiased_per_row() -> None:
    """The MC diagonal and full blocks with many samples approach the brute-force GGN over the
    N·T rows: the relative error shrinks like 1/√S (1.2% at S = 4000 here, 7% at 100, 65% at 1; 0.1 leaves room),
    while mixing rows (the former result of the exact kind) is 2.4× off."""
    model, x, y = _model_and_batch()
    ggn = _brute_ggn(model, x, y, "cross_entropy")
    gen = torch.Generator().manual_seed(0)
    c = curvature.compute(model, x, y, kind="fisher_mc", approx="full", mc_samples=4000, generator=gen,
                          output_selector=_rows)
    blocks = [c.blocks[n].dense() for n in ("0", "2")]
    sizes = [b.shape[0] for b in blocks]
    want = [ggn[:sizes[0], :sizes[0]], ggn[sizes[0]:, sizes[0]:]]
    for got, ref in zip(blocks, want):
        err = float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref))
        assert err < 0.1, err
    gen = torch.Generator().manual_seed(0)
    d = curvature.compute(model, x, y, kind="fisher_mc", approx="diag", mc_samples=4000, generator=gen,
                          output_selector=_rows)
    diag = torch.cat([d.blocks[n].diagonal for n in ("0", "2")])
    assert float(torch.linalg.norm(diag - ggn.diagonal()) / torch.linalg.norm(ggn.diagonal())) < 0.1


# ---- K-FAC (expand) on sequence outputs ---------------------------------------------------------
# G sums the output-gradient outer products over every position and is divided by the loss rows
# N·T, A averages the inputs over every position: for a position-wise Linear under a Gaussian
# likelihood that is exactly the GGN block (the linear-Gaussian case), for any kind's expectation.

D_IN = 4


def _linear_seq() -> tuple:
    """A position-wise Linear on ``[N, T, D_IN]`` inputs with ``mse`` targets ``[N·T, C]``."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(D_IN, C)).double()
    x = torch.randn(N, T, D_IN, dtype=torch.float64)
    y = torch.randn(N * T, C, dtype=torch.float64)
    return model, x, y


def test_exact_fisher_kfac_equals_the_ggn_of_a_positionwise_linear() -> None:
    model, x, y = _linear_seq()
    c = curvature.compute(model, x, y, kind="fisher", approx="kfac", loss="mse", output_selector=_rows)
    torch.testing.assert_close(c.dense(), _brute_ggn(model, x, y, "mse"), rtol=1e-10, atol=1e-12)


def test_monte_carlo_kfac_is_normalized_by_the_loss_rows() -> None:
    """The MC K-FAC block (many samples) approaches the same GGN; before the rows normalization
    its G was divided by the N module examples, T = 6 times too large."""
    model, x, y = _linear_seq()
    gen = torch.Generator().manual_seed(0)
    c = curvature.compute(model, x, y, kind="fisher_mc", approx="kfac", loss="mse", mc_samples=4000,
                          generator=gen, output_selector=_rows)
    ref = _brute_ggn(model, x, y, "mse")
    err = float(torch.linalg.norm(c.dense() - ref) / torch.linalg.norm(ref))
    assert err < 0.1, err


def test_empirical_fisher_kfac_factors_are_the_per_row_definition() -> None:
    """Cross-entropy, position-wise Linear head: the output gradient at position (n, t) is the loss
    row's own ``∇_f ℓ = softmax − onehot``, so ``G = (1/(N·T)) Σ_r ∇ℓ_r ∇ℓ_rᵀ`` and
    ``A = (1/(N·T)) Σ_r ã_r ã_rᵀ`` exactly; the same from the targets and from the user's backward."""
    model, x, _ = _linear_seq()
    y = torch.randint(0, C, (N * T,), generator=torch.Generator().manual_seed(3))
    c = curvature.compute(model, x, y, kind="empirical_fisher", approx="kfac", output_selector=_rows)
    blk = c.blocks["0"]
    with torch.no_grad():
        logits = _rows(model(x))
    e = logits.softmax(-1) - nn.functional.one_hot(y, C).double()
    a = torch.cat([x.reshape(-1, D_IN), torch.ones(N * T, 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(blk.G, e.t() @ e / (N * T), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(blk.A, a.t() @ a / (N * T), rtol=1e-10, atol=1e-12)

    opt = SecondOrderOptimizer(model, curvature="empirical_fisher", approx="kfac", output_selector=_rows, lr=0.0)

    opt.step(_rows_closure(opt, model, x, y))
    run = opt.running.blocks["0"]
    torch.testing.assert_close(run.G, blk.G, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(run.A, blk.A, rtol=1e-10, atol=1e-12)


class _HeadOnRows(nn.Module):
    """Embedding → Linear → tanh on ``[N, T, ·]``, then a head on the reshaped ``[N·T, H]`` rows: the
    head sees the loss rows while the other modules see the N sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.l1 = nn.Linear(4, 5)
        self.l2 = nn.Linear(5, 6)

    def forward(self, ids):
        return self.l2(torch.tanh(self.l1(self.emb(ids))).reshape(-1, 5))


@pytest.mark.parametrize("approx", ["full", "diag"])
def test_empirical_fisher_of_a_module_on_the_rows_takes_the_sequence_as_the_example(approx):
    """Every module's empirical Fisher block is (1/R) Σ_n g_n g_nᵀ with g_n the gradient of sequence n's
    summed token losses, the head on [N·T, H] rows included (it was the per-row sum, 75% off)."""
    torch.manual_seed(0)
    n, t = 3, 4
    model = _HeadOnRows().double()
    ids, y = torch.randint(0, 7, (n, t)), torch.randint(0, 6, (n * t,))
    params = dict(model.named_parameters())
    expected = {}
    for name in ("l1", "l2"):
        names = [k for k in params if k.startswith(name + ".")]

        def rows(*ps):
            return torch.nn.functional.cross_entropy(functional_call(model, dict(zip(names, ps)), (ids,)), y,
                                                     reduction="none")
        jac = jacrev(rows, argnums=tuple(range(len(names))))(*[params[k].detach() for k in names])
        per_seq = torch.cat([j.reshape(n * t, -1) for j in jac], dim=1).reshape(n, t, -1).sum(1)
        full = per_seq.t() @ per_seq / (n * t)
        expected[name] = full if approx == "full" else torch.diag(torch.diagonal(full))
        assert full.abs().max() > 1e-3
    got = curvature.compute(model, ids, y, kind="empirical_fisher", approx=approx)
    opt = SecondOrderOptimizer(model, curvature="empirical_fisher", approx=approx)

    def closure():
        opt.zero_grad()
        out = model(ids)
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        return loss, out
    opt.step(closure)  # the empirical Fisher from the user's own backward: the same blocks
    for name in ("l1", "l2"):
        torch.testing.assert_close(got.blocks[name].dense(), expected[name], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(opt.running.blocks[name].dense(), expected[name], rtol=1e-10, atol=1e-12)
