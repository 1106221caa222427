"""The Hessian diagonal costs what its definition needs, and expensive blocks are announced.

``curvature.compute(kind="hessian", approx="diag")`` takes Linear/Conv1d/Conv2d diagonals from
``d_out·T`` output-space Hessian-vector products (curvature/hessian_diag.py) instead of one
product per parameter; checked against the diagonal of the brute-force Hessian
(``torch.func.hessian`` of the mean loss, float64) on models with stride, padding, dilation,
smooth activations (so the Hessian is not the GGN), sequence Linear layers and pooling, and
the generic path for a model whose train-mode BatchNorm couples the examples.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, hessian

import curvature
from curvature import cost, hessian_diag


def brute_diag(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    theta = torch.cat([params[n].detach().reshape(-1) for n in names])
    shapes = [params[n].shape for n in names]

    def loss(t: torch.Tensor) -> torch.Tensor:
        d, i = {}, 0
        for n, s in zip(names, shapes):
            d[n] = t[i:i + s.numel()].reshape(s)
            i += s.numel()
        return F.cross_entropy(functional_call(model, d, (x,)), y)

    return hessian(loss)(theta).diagonal()


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 3, 3, padding=1)
        self.c2 = nn.Conv2d(3, 4, 3, stride=2, dilation=1, padding=2)
        self.c3 = nn.Conv2d(4, 4, 2, dilation=2, bias=False)
        self.fc = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c1(x))
        h = F.softplus(self.c2(h))
        h = F.max_pool2d(torch.sigmoid(self.c3(h)), 1)
        return self.fc(h.flatten(1))


class Conv1dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(2, 3, 3, padding=1)
        self.c2 = nn.Conv1d(3, 2, 2, stride=2, dilation=2, bias=False)
        self.fc = nn.Linear(2 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 2, 7] -> [N, 3]
        return self.fc(F.softplus(self.c2(torch.tanh(self.c1(x)))).flatten(1))


class Conv3dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv3d(2, 2, (2, 2, 1), padding=(0, 1, 0))
        self.c2 = nn.Conv3d(2, 2, 2, stride=(1, 2, 1), bias=False)
        self.fc = nn.Linear(2 * 1 * 2 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 2, 3, 3, 3] -> [N, 3]
        return self.fc(F.softplus(self.c2(torch.tanh(self.c1(x)))).flatten(1))


class ConvTransposeNet(nn.Module):  # fewer outputs than parameters: the output-space path pays
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.ConvTranspose2d(4, 4, 3, padding=1)
        self.c2 = nn.ConvTranspose1d(4, 2, 3, stride=2, padding=2, output_padding=1, bias=False)
        self.fc = nn.Linear(2 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 4, 2, 2] -> [4, 2, 2] -> [4, 4] -> [2, 6] -> [N, 3]
        return self.fc(F.softplus(self.c2(torch.tanh(self.c1(x)).flatten(2))).flatten(1))


class GroupedNet(nn.Module):  # fewer outputs than parameters in each grouped layer, T = 1 in the last
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.c2 = nn.Conv1d(8, 4, 3, groups=4, bias=False)
        self.c3 = nn.Conv2d(4, 4, (1, 2), groups=2)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 8, 2, 2] -> [8, 2, 2] -> [8, 4] -> [4, 2] -> [4, 1, 1]
        h = self.c2(torch.tanh(self.c1(x)).flatten(2))
        return self.fc(F.softplus(self.c3(h.unsqueeze(2))).flatten(1))


class SeqNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, T, 8] -> [N, 4]
        return self.b(torch.tanh(self.a(x))).pow(2).mean(1)


class BNNet(nn.Module):
    def __init__(self, track: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6, track_running_stats=track)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


CASES = {
    "conv": (ConvNet, (5, 2, 7, 7)),
    "conv1d": (Conv1dNet, (5, 2, 7)),
    "conv3d": (Conv3dNet, (4, 2, 3, 3, 3)),
    "conv_transpose": (ConvTransposeNet, (4, 4, 2, 2)),
    "conv_grouped": (GroupedNet, (4, 8, 2, 2)),
    "seq_linear": (SeqNet, (4, 4, 8)),
    "mlp": (lambda: nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.ELU(), nn.Linear(5, 3)), (6, 6)),
}


@pytest.fixture
def fast_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    calls = []
    real = hessian_diag.diag_block

    def counted(loss, module, family, inputs, z, names):
        calls.append(type(module).__name__)
        return real(loss, module, family, inputs, z, names)

    monkeypatch.setattr(curvature.hessian, "diag_block", counted)
    return calls


@pytest.mark.parametrize("case", list(CASES))
def test_diagonal_matches_brute_force(case: str, fast_calls: list) -> None:
    torch.manual_seed(0)
    build, shape = CASES[case]
    model = build().double().eval()
    x = torch.randn(*shape, dtype=torch.float64)
    y = torch.randint(0, 3, (shape[0],))
    c = curvature.compute(model, x, y, kind="hessian", approx="diag")
    ours = torch.cat([c.blocks[n].diag if hasattr(c.blocks[n], "diag") else c.blocks[n].dense().diagonal()
                      for n in c.blocks])
    torch.testing.assert_close(c.dense().diagonal(), brute_diag(model, x, y), rtol=1e-9, atol=1e-12)
    assert ours.numel() == sum(p.numel() for p in model.parameters())
    assert fast_calls, "the output-space path was used"
    if case.startswith("conv"):  # by the convolutions too, not the Linear head alone
        assert {"Conv1d", "Conv2d", "Conv3d"} & set(fast_calls) or case == "conv_transpose", fast_calls
    if case == "conv_transpose":  # both transposed convolutions (their M permutes the weight: from_matrix)
        assert {"ConvTranspose1d", "ConvTranspose2d"} <= set(fast_calls), fast_calls
    if case == "conv_grouped":  # every grouped layer (a row reads its group's features), T = 1 included
        assert fast_calls.count("Conv2d") == 2 and "Conv1d" in fast_calls, fast_calls


def test_train_mode_batchnorm_uses_the_generic_exact_path(fast_calls: list) -> None:
    torch.manual_seed(0)
    model = BNNet(track=False).double().train()  # batch statistics (functorch cannot update running ones)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    c = curvature.compute(model, x, y, kind="hessian", approx="diag")
    torch.testing.assert_close(c.dense().diagonal(), brute_diag(model, x, y), rtol=1e-9, atol=1e-12)
    assert not fast_calls  # the batch statistics couple the examples: no block-diagonal H_zz
    torch.manual_seed(0)
    model = BNNet().double().eval()
    c = curvature.compute(model, x, y, kind="hessian", approx="diag")
    torch.testing.assert_close(c.dense().diagonal(), brute_diag(model, x, y), rtol=1e-9, atol=1e-12)
    assert fast_calls


def test_diagonal_needs_output_space_products_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Linear(64 -> 10) head: 10 products for its 650 parameters (the full block needs 650), and the
    2 of the check that the examples are independent."""
    products = []
    real = hessian_diag._hvp
    monkeypatch.setattr(hessian_diag, "_hvp", lambda runner, v: products.append(v.shape[0]) or real(runner, v))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    curvature.compute(model, x, y, kind="hessian", approx="diag")
    assert sum(products) == 10 + 2


def test_expensive_hessian_blocks_are_announced(caplog: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 30), nn.Tanh(), nn.Linear(30, 3))  # 630 + 93 parameters
    x, y = torch.randn(4, 20), torch.randint(0, 3, (4,))
    monkeypatch.setattr(cost, "HVP_WARN", 500)
    with caplog.at_level(logging.WARNING, logger="curvature"):
        curvature.compute(model, x, y, kind="hessian", approx="full")
    msgs = [r.getMessage() for r in caplog.records]
    assert any("'0'" in m and "630 Hessian-vector products" in m and "full" in m for m in msgs), msgs
    assert not any("'2'" in m for m in msgs)  # 93 parameters: below the threshold
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="curvature"):
        curvature.compute(model, x, y, kind="hessian", approx="diag")  # 30 products: nothing to announce
    assert not caplog.records


def test_large_full_blocks_are_announced(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 10))  # 2600 parameters in block '0'
    with caplog.at_level(logging.WARNING, logger="curvature"):
        from torchsso2 import SecondOrderOptimizer
        SecondOrderOptimizer(model, approx="full")
    msgs = [r.getMessage() for r in caplog.records]
    assert any("'0'" in m and "2600x2600 = 6,760,000 elements" in m and "MiB" in m for m in msgs), msgs
    assert not any("'2'" in m for m in msgs)


class _SeqFirst(nn.Module):
    """A batch-first model whose first Linear runs on sequence-first ``[T, N, d]`` activations:
    the output's first dimension is the position, and the positions are mixed by the mean."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x.transpose(0, 1))).mean(0))


class _Coupled(nn.Module):
    """Examples coupled without an nn.BatchNorm: functional batch statistics, or centering."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc1, self.fc2 = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = F.batch_norm(h, None, None, training=True) if self.how == "batch_norm" else h - h.mean(0)
        return self.fc2(torch.tanh(h))


class _Tied(nn.Module):
    """Two Linear modules sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        self.fc2.weight = self.fc1.weight
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class _Reused(nn.Module):
    """A module call and a functional use of the same weight (the Hessian sees every use)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.out = nn.Linear(4, 4, bias=False), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(F.linear(torch.tanh(self.fc1(x)), self.fc1.weight)))


@pytest.mark.parametrize("build, shape, fast", [
    (_SeqFirst, (4, 3, 6), "called"), (lambda: _Coupled("batch_norm"), (5, 6), "called"),
    (lambda: _Coupled("center"), (5, 6), "called"), (_Tied, (5, 4), "not called"), (_Reused, (5, 4), "not called")])
def test_fast_path_refuses_what_breaks_its_assumptions(build, shape, fast: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The output-space path assumes the weight reaches the loss only through the module's call and
    no coupling of the output's first dimension; where either fails the block comes from the
    generic path, equal to the brute force (found by an audit: these were off by 10-100%)."""
    torch.manual_seed(0)
    model = build().double()
    x = torch.randn(*shape, dtype=torch.float64)
    y = torch.randint(0, 3, (shape[0],))
    params = {n: p.detach() for n, p in model.named_parameters() if n.startswith("fc1.")}

    def loss(p: dict) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    h = hessian(loss)(params)
    brute = torch.cat([h[n][n].reshape(params[n].numel(), -1).diagonal() for n in params])
    called, real = [], hessian_diag.diag_block
    monkeypatch.setattr(curvature.hessian, "diag_block", lambda loss, module, *a: called.append(module) or
                        real(loss, module, *a))
    c = curvature.compute(model, x, y, kind="hessian", approx="diag")
    torch.testing.assert_close(c.blocks["fc1"].dense().diagonal(), brute, rtol=1e-9, atol=1e-12)
    assert any(m is model.fc1 for m in called) == (fast == "called")  # called: its check refused


def test_independence_check_passes_independent_rows() -> None:
    """The check itself: a per-example loss passes, a centred one does not."""
    z = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    for coupled in (False, True):
        h = z - z.mean(0) if coupled else z
        (gz,) = torch.autograd.grad(h.tanh().pow(2).sum(), z, create_graph=True)
        assert hessian_diag.rows_independent(hessian_diag.ProductRunner(gz, [z]), z) is (not coupled)


class _Unrolled(nn.Module):
    """One Linear called twice in the forward (an unrolled recurrence)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.cell = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.cell(h))
        return self.out(torch.tanh(self.cell(h)))


@pytest.mark.parametrize("approx", ["full", "diag"])
def test_hessian_of_a_module_called_twice(approx) -> None:
    """The Hessian sees every call of a reused module (the Fisher kinds refuse it)."""
    from reference import Reference
    torch.manual_seed(0)
    model = _Unrolled().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    expected = Reference(model, x, y, "cross_entropy").shaped("hessian", approx, None)
    got = curvature.compute(model, x, y, kind="hessian", approx=approx).dense()
    assert expected.abs().max() > 1e-2
    assert (got - expected).abs().max() <= 1e-10
    with pytest.raises(ValueError, match="called more than once"):
        curvature.compute(model, x, y, kind="fisher", approx=approx)


def test_an_optimizer_announces_a_hessian_blocks_cost_once(caplog):
    """Each step logged it again (bfloat16 autocast takes the generic path: two WARNING lines a step)."""
    import logging
    import torch.nn.functional as F
    from torchsso2 import SecondOrderOptimizer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))  # 2080 parameters in '0'
    opt = SecondOrderOptimizer(model, curvature="hessian", approx="diag", damping=10.0)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))

    def closure():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        return loss, out
    with caplog.at_level(logging.WARNING, logger="curvature"):
        for _ in range(3):
            opt.step(closure, targets=y)
    announced = [r.getMessage() for r in caplog.records if "Hessian-vector products" in r.getMessage()]
    assert len(announced) == 1 and "module '0'" in announced[0], announced


def test_grouped_diagonal_in_slabs_of_one_group(monkeypatch: pytest.MonkeyPatch, fast_calls: list) -> None:
    monkeypatch.setattr(hessian_diag, "SLAB_ELEMENTS", 1)  # one group a slab
    torch.manual_seed(0)
    model = GroupedNet().double().eval()
    x, y = torch.randn(4, 8, 2, 2, dtype=torch.float64), torch.randint(0, 3, (4,))
    c = curvature.compute(model, x, y, kind="hessian", approx="diag")
    torch.testing.assert_close(c.dense().diagonal(), brute_diag(model, x, y), rtol=1e-9, atol=1e-12)
    assert fast_calls.count("Conv2d") == 2


def _instance_norm_eval(c: int) -> nn.Module:
    norm = nn.InstanceNorm2d(c, track_running_stats=True)
    with torch.no_grad():
        norm.running_mean.normal_(generator=torch.Generator().manual_seed(3))
        norm.running_var.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(4))
    return norm.eval()


@pytest.mark.parametrize("norm", ["group_norm", "instance_norm_eval", "batch_norm_eval"])
@pytest.mark.parametrize("approx", ["full", "diag"])
def test_hessian_of_a_layer_before_a_norm_layer_for_one_example(norm: str, approx: str) -> None:
    """torch 2.13 bugs the products walked into, for a batch of ONE example: the batched double backward
    through GroupNorm (silently wrong; it raises for more examples), and instance_norm / eval batch_norm
    backward of a channels-last-strided grad_output (the diagonal's unit vectors). 0.3-0.99 relative off."""
    torch.manual_seed(0)
    c = 6
    layer = {"group_norm": lambda: nn.GroupNorm(6, 6, affine=False), "instance_norm_eval": lambda: _instance_norm_eval(c),
             "batch_norm_eval": lambda: nn.BatchNorm2d(c).eval()}[norm]()
    model = nn.Sequential(nn.Conv2d(c, c, 1), layer, nn.Tanh(), nn.Flatten(), nn.Linear(c * 6, 2)).double()
    x, y = torch.randn(1, c, 2, 3, dtype=torch.float64), torch.randn(1, 2, dtype=torch.float64)
    conv = model[0]
    theta = torch.cat([conv.weight.detach().reshape(-1), conv.bias.detach()])

    def loss(t: Tensor) -> Tensor:
        params = {"0.weight": t[:c * c].reshape(c, c, 1, 1), "0.bias": t[c * c:]}
        return 0.5 * (functional_call(model, params, (x,)) - y).pow(2).sum()

    want = torch.autograd.functional.hessian(loss, theta)  # reverse over reverse, one vector at a time
    got = curvature.compute(model, x, y, loss="mse", kind="hessian", approx=approx).blocks["0"].dense()
    torch.testing.assert_close(got, want if approx == "full" else torch.diag(want.diagonal()), rtol=1e-9, atol=1e-12)


def test_hessian_with_an_empty_layer_past_the_probe_vectors() -> None:
    """A covered Linear(0, 20): its 20 bias entries reach the batched products, whose check took the max of an
    empty weight row (a RuntimeError)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.empty, self.a, self.out = nn.Linear(0, 20), nn.Linear(6, 20), nn.Linear(20, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.out(torch.tanh(self.a(x) + self.empty(x[:, :0])))

    model = Net().double()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    for approx in ("full", "diag"):
        c = curvature.compute(model, x, y, kind="hessian", approx=approx)
        assert c.blocks["empty"].dense().shape == (20, 20)

        def loss(b: Tensor) -> Tensor:
            return F.cross_entropy(functional_call(model, {"empty.bias": b}, (x,)), y)

        want = hessian(loss)(model.empty.bias.detach())
        torch.testing.assert_close(c.blocks["empty"].dense(), want if approx == "full" else torch.diag(want.diagonal()))
