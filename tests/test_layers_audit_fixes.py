"""Modules off the main path an audit found mishandled: covered modules called without the batch
(a Linear on a ``[d]`` vector, a position embedding on ``torch.arange(T)``) under the exact and the
empirical Fisher; a sparse Embedding left to the plain update; KFACPreconditioner on a subclass
overriding ``forward`` and on the old hook-based ``weight_norm``."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvature
from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner


class Hyper(nn.Module):
    """``gen`` runs on a ``[2]`` buffer; its output is broadcast over the batch."""

    def __init__(self, d_out: int = 3) -> None:
        super().__init__()
        self.fc, self.gen = nn.Linear(4, d_out), nn.Linear(2, d_out)
        self.register_buffer("z", torch.randn(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.gen(self.z)


class PositionLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(7, 4), nn.Embedding(5, 4), nn.Linear(4, 7)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))


@pytest.mark.parametrize("n", [5, 3])  # 3: the [d_out] output's size equals the batch
@pytest.mark.parametrize("kind,approx", [("fisher", "full"), ("fisher", "diag"), ("fisher", "kfac"),
                                         ("empirical_fisher", "full"), ("empirical_fisher", "kfac")])
def test_a_module_without_the_batch_dimension_is_refused(n: int, kind: str, approx: str) -> None:
    torch.manual_seed(0)
    model = Hyper()
    x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
    with pytest.raises(ValueError, match=r"modules \{'gen': \[3\]\} were called without a batch dimension"):
        curvature.compute(model, x, y, kind=kind, approx=approx)
    curvature.compute(model, x, y, kind="fisher_mc", approx=approx)  # no per-example products: fine


def test_a_position_embedding_on_arange_is_refused_where_the_sizes_show_it() -> None:
    """The exact Fisher's blocks (any shape) check the modules' batches: refused. The empirical Fisher's
    K-FAC blocks accept any layout (sequence-first models), so there it is not detected (docs/guide.md)."""
    torch.manual_seed(0)
    model = PositionLM()
    ids, nxt = torch.randint(0, 7, (3, 5)), torch.randint(0, 7, (3, 5))
    for approx in ("kfac", "diag"):
        with pytest.raises(ValueError, match="position embedding"):
            curvature.compute(model, ids, nxt, kind="fisher", approx=approx)
    with pytest.raises(ValueError, match="position embedding"):
        curvature.compute(model, ids, nxt, kind="empirical_fisher", approx="diag")


def test_empirical_fisher_kfac_takes_a_sequence_first_layout() -> None:
    """Linear layers on [T, N, d] and a classification head: the K-FAC blocks of the empirical Fisher
    equal those of the same model written batch-first."""

    class SeqFirst(nn.Module):
        def __init__(self, batch_first: bool) -> None:
            super().__init__()
            self.batch_first = batch_first
            self.inp, self.head = nn.Linear(3, 5), nn.Linear(5, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, T, 3]
            h = torch.tanh(self.inp(x if self.batch_first else x.transpose(0, 1)))
            return self.head(h.mean(1 if self.batch_first else 0))

    torch.manual_seed(0)
    x, y = torch.randn(4, 7, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    first = SeqFirst(True).double()
    seq = SeqFirst(False).double()
    seq.load_state_dict(first.state_dict())
    a = curvature.compute(first, x, y, kind="empirical_fisher", approx="kfac")
    b = curvature.compute(seq, x, y, kind="empirical_fisher", approx="kfac")
    torch.testing.assert_close(a.dense(), b.dense(), rtol=1e-10, atol=1e-12)


def test_empirical_fisher_kfac_takes_a_module_with_several_rows_per_loss_row() -> None:
    """Tokens through a head whose loss is averaged over them: the head's batch N·T is a multiple of
    the N loss rows, each of its rows belongs to one example; K-FAC-expand sums them, as before."""

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.head = nn.Linear(4, 6), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n, t, d = x.shape
            return self.head(torch.tanh(self.proj(x.reshape(n * t, d)))).reshape(n, t, 3).mean(1)

    torch.manual_seed(0)
    x, y = torch.randn(5, 4, 4), torch.randint(0, 3, (5,))
    blocks = curvature.compute(Pooled(), x, y, kind="empirical_fisher", approx="kfac").blocks
    assert set(blocks) == {"proj", "head"}


class _Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(7, 4, sparse=True), nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


@pytest.mark.parametrize("face", ["soo", "vi"])
def test_sparse_embedding_is_refused_even_when_skipped_and_the_params_recipe_works(face: str) -> None:
    torch.manual_seed(0)
    model = _Emb()
    with pytest.raises(ValueError, match=r"sparse=True.*SparseAdam") as info:
        SecondOrderOptimizer(model)
    assert "skip_modules" not in str(info.value)  # skipping would not help: no such hint

    def build(**kw):
        return SecondOrderOptimizer(model, **kw) if face == "soo" else VIOptimizer(model, dataset_size=50, **kw)

    with pytest.raises(ValueError, match=r"parameters \['emb.weight'\] get sparse gradients.*SparseAdam"):
        build(skip_modules=["^emb$"])
    opt, sparse = build(params=model.head.parameters()), torch.optim.SparseAdam(model.emb.parameters())
    ids, y = torch.randint(0, 7, (8, 5)), torch.randint(0, 3, (8,))
    before = model.emb.weight.detach().clone()

    def closure():
        opt.zero_grad()
        sparse.zero_grad()
        out = model(ids)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out

    opt.step(closure)
    sparse.step()
    assert not torch.equal(model.emb.weight, before)


def test_kfac_preconditioner_warns_about_a_subclass_overriding_forward() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 3 * super().forward(x)

    class Initialised(nn.Linear):  # keeps Linear.forward: the layer itself, no warning
        pass

    with pytest.warns(UserWarning, match=r"layer '0' \(Scaled\).*skip_layers"):
        KFACPreconditioner(nn.Sequential(Scaled(3, 4), nn.ReLU(), nn.Linear(4, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KFACPreconditioner(nn.Sequential(Initialised(3, 4), nn.ReLU(), nn.Linear(4, 2)))


@pytest.mark.parametrize("wrap", [nn.utils.weight_norm, nn.utils.spectral_norm])
def test_kfac_preconditioner_refuses_the_old_weight_reparametrizations(wrap) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weight_norm's deprecation
        model = nn.Sequential(wrap(nn.Linear(4, 6)), nn.ReLU(), nn.Linear(6, 3))
        with pytest.raises(ValueError, match=r"module '0' \(Linear\) holds parameters .*skip_layers"):
            KFACPreconditioner(model)
        KFACPreconditioner(model, skip_layers=["^0$"])


def test_a_sparse_gradient_from_a_functional_embedding_is_a_clear_error() -> None:
    class SparseTable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(10, 4))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return F.embedding(ids, self.table, sparse=True)

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = SparseTable(), nn.Linear(4, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids).mean(1))

    torch.manual_seed(0)
    model = Functional()
    opt = SecondOrderOptimizer(model, skip_modules=["^emb$"])
    ids, y = torch.randint(0, 10, (8, 5)), torch.randint(0, 3, (8,))
    with pytest.raises(TypeError, match="sparse gradient.*SparseAdam"):
        opt.step(make_closure(opt, model, ids, y))


def test_kfac_preconditioner_leaves_a_subclass_extra_parameter_its_gradient() -> None:
    class Scaled(nn.Linear):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale * super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(Scaled(5, 4), nn.Tanh(), nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
    model(torch.randn(8, 5)).pow(2).mean().backward()
    scale_grad = model[0].scale.grad.clone()
    pre.step()
    assert torch.equal(model[0].scale.grad, scale_grad) and pre.layers["0"].param_names == ("weight", "bias")
