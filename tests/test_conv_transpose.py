"""nn.ConvTranspose1d/2d/3d: the stride-1 convolution of the zero-inserted input (curvature/modules/conv_transpose.py).

Every kind × shape is checked against the brute-force reference in ``test_curvature_reference.py``
(``tests/models.py``'s ``convt``: stride 2 called with ``output_size``, a padding that crops, dilation; ``convt13``:
ConvTranspose1d with ``output_padding`` and ConvTranspose3d; patches from the layer's definition), the Hessian
diagonal's output-space path in ``test_hessian_diag.py``. Here: a stride-1 transposed convolution gives the
blocks of the Conv2d it equals (every kind and shape, K-FAC-reduce), the one-position exact case, the offset
input factor, tied weights, refusals and the optimizers.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import curvature
from curvature.blocks.layout import kfac_dims
from optim_helpers import make_closure
from reference import Reference, transposed_patches
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner


class Pair(nn.Module):
    """A layer of 2 → 3 channels (3×3 kernel, dilation ``d``, transposed or not) → tanh → Linear."""

    def __init__(self, transposed: bool, d: int = 1, bias: bool = True) -> None:
        super().__init__()
        # ConvTranspose2d(padding p) = Conv2d(padding d(k − 1) − p) with the swapped, flipped kernel
        self.c = nn.ConvTranspose2d(2, 3, 3, padding=1, dilation=d, bias=bias) if transposed else \
            nn.Conv2d(2, 3, 3, padding=2 * d - 1, dilation=d, bias=bias)
        self.fc = nn.Linear(3 * (2 + 2 * d) ** 2, 3)  # output (2 + 2d)²

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 2, 4, 4]
        return self.fc(torch.tanh(self.c(x)).flatten(1))


def _pair(d: int = 1, bias: bool = True):
    torch.manual_seed(0)
    t, c = Pair(True, d, bias).double(), Pair(False, d, bias).double()
    with torch.no_grad():
        c.c.weight.copy_(t.c.weight.transpose(0, 1).flip(2, 3))
        if bias:
            c.c.bias.copy_(t.c.bias)
        c.fc.load_state_dict(t.fc.state_dict())
    # the parameter vector of the transposed model in the conv model's order
    n = t.c.weight.numel()
    perm = torch.arange(n).reshape(t.c.weight.shape).transpose(0, 1).flip(2, 3).reshape(-1)
    perm = torch.cat([perm, torch.arange(n, sum(p.numel() for p in t.parameters()))])
    return t, c, perm


@pytest.mark.parametrize("kind, approx", [  # (K-FAC of the Hessian is not defined)
    (k, a) for k in ("fisher", "fisher_mc", "empirical_fisher", "hessian")
    for a in ("full", "diag", "kfac", "kfac-reduce") if not (k == "hessian" and a.startswith("kfac"))])
@pytest.mark.parametrize("d", [1, 2])
def test_a_stride_one_transposed_conv_equals_the_conv2d(kind: str, approx: str, d: int) -> None:
    t, c, perm = _pair(d)
    x = torch.randn(4, 2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(t(x), c(x), rtol=1e-12, atol=1e-12)  # the same function
    y = torch.tensor([0, 2, 1, 2])
    extra = {"kfac_approx": "reduce"} if approx == "kfac-reduce" else {}
    if kind == "fisher_mc":
        extra["mc_samples"] = 2
    got = [curvature.compute(m, x, y, kind=kind, approx=approx.split("-")[0],
                             generator=torch.Generator().manual_seed(5), **extra).dense() for m in (t, c)]
    assert got[1].abs().max() > 0
    torch.testing.assert_close(got[0][perm][:, perm], got[1], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
def test_one_output_position_kfac_is_the_full_fisher_block(bias: bool) -> None:
    """One example, one output position (a 1×1 input, kernel 3, padding 1): the layer is a Linear map of the
    patch, and K-FAC of the Fisher is its full block."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.ConvTranspose2d(3, 4, 3, padding=1, bias=bias), nn.Tanh(), nn.Flatten(),
                          nn.Linear(4, 3)).double()
    x, y = torch.randn(1, 3, 1, 1, dtype=torch.float64), torch.tensor([1])
    assert model[0](x).shape[2:] == (1, 1)
    kfac = curvature.compute(model, x, y, kind="fisher", approx="kfac").blocks["0"].dense()
    full = curvature.compute(model, x, y, kind="fisher", approx="full").blocks["0"].dense()
    ref = Reference(model, x, y, "cross_entropy").shaped("fisher", "full")
    p = model[0].weight.numel() + (4 if bias else 0)
    torch.testing.assert_close(full, ref[:p, :p], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kfac, full, rtol=1e-10, atol=1e-12)


def test_stride_one_inputs_take_the_offset_factor() -> None:
    """A stride-1 ConvTranspose2d over 16×16 maps: the input factor from offset correlations of the padded input,
    equal to the Gram matrix of the patches from the layer's definition."""
    from curvature.modules import conv_factor
    torch.manual_seed(4)
    conv = nn.ConvTranspose2d(3, 2, 3, padding=1).double()
    model = nn.Sequential(conv, nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 3)).double()
    x = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    calls = []
    real = conv_factor.conv_input_factor

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    conv_factor.conv_input_factor, saved = counted, real
    try:
        c = curvature.compute(model, x, torch.tensor([0, 1, 2]), kind="fisher", approx="kfac")
    finally:
        conv_factor.conv_input_factor = saved
    assert calls, "the offset route was taken"
    patches = transposed_patches(x, conv, (16, 16))
    patches = torch.cat([patches, torch.ones(patches.shape[:2] + (1,), dtype=patches.dtype)], dim=2)
    flat = patches.reshape(-1, patches.shape[-1])
    torch.testing.assert_close(c.blocks["0"].A, flat.t() @ flat / flat.shape[0], rtol=1e-10, atol=1e-12)


def test_the_matrix_permutes_the_weight_and_back() -> None:
    """``M = [W' | b]`` with ``W'[o, i, κ] = W[i, o, k − 1 − κ]``; from_matrix inverts to_matrix; kfac_dims reads
    its shape without building it."""
    from curvature.modules.conv_transpose import ConvTransposeFamily
    conv = nn.ConvTranspose3d(2, 3, (2, 1, 3))
    fam = ConvTransposeFamily()
    w, b = torch.randn(conv.weight.shape), torch.randn(3)
    m = fam.to_matrix(conv, [w, b], ["weight", "bias"])
    assert m.shape == (3, 2 * 6 + 1)
    assert m[2, 1 * 6 + 0 * 3 + 0 * 3 + 2] == w[1, 2, 1, 0, 0]  # κ' = (0, 0, 2) is κ = (1, 0, 0)
    torch.testing.assert_close(m[:, -1], b)
    back = fam.from_matrix(conv, m, ["bias", "weight"])
    torch.testing.assert_close(back[0], b, rtol=0, atol=0)
    torch.testing.assert_close(back[1], w, rtol=0, atol=0)
    model = nn.Sequential(conv, nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(2, 2, 2, 2, 2))
    opt = SecondOrderOptimizer(model)
    lay = opt.engine.layouts["0"]
    assert kfac_dims(lay) == (3, 13)
    assert opt.engine.approx["0"].value == "kfac"  # the default shape, as for a convolution


def test_tied_to_a_conv2d_full_and_diag_are_exact_kfac_is_refused() -> None:
    """A tied autoencoder: the decoder's ConvTranspose2d holds the encoder Conv2d's weight. The full and
    diagonal blocks of the empirical Fisher are those of the summed per-example gradients (torch.func); K-FAC
    would add factors of two matrix layouts: refused where asked by name, the diagonal by default."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=False)
            self.dec = nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1, bias=False)
            self.dec.weight = self.enc.weight
            self.fc = nn.Linear(2 * 16, 3)

        def forward(self, x):  # [N, 2, 4, 4]
            return self.fc(self.dec(torch.tanh(self.enc(x))).flatten(1))

    torch.manual_seed(5)
    model = Tied().double()
    x, y = torch.randn(4, 2, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    pe = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([pe[k].reshape(4, -1) for k in params], 1)  # enc.weight (the tied one), fc
    want = flat.t() @ flat / 4
    diag = curvature.compute(model, x, y, kind="empirical_fisher", approx="diag").dense()
    torch.testing.assert_close(diag, torch.diag(want.diagonal()), rtol=1e-10, atol=1e-12)
    full = curvature.compute(model, x, y, kind="empirical_fisher", approx="full").dense()
    n = model.enc.weight.numel()  # block-diagonal over modules: the tied weight's block, the head's
    torch.testing.assert_close(full[:n, :n], want[:n, :n], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(full[n:, n:], want[n:, n:], rtol=1e-10, atol=1e-12)
    with pytest.raises(NotImplementedError, match=r"modules \['dec'\] hold its tied parameter in another matrix layout"):
        curvature.compute(model, x, y, kind="fisher", approx={"enc": "kfac", "fc": "kfac"})
    opt = SecondOrderOptimizer(model)  # K-FAC by default: the tied block takes the diagonal
    assert {n: a.value for n, a in opt.engine.approx.items()} == {"enc": "diag", "fc": "kfac"}


@pytest.mark.parametrize("layer, match", [
    (lambda: nn.ConvTranspose2d(4, 4, 3, groups=2), r"ConvTranspose2d with groups=2"),
    (lambda: nn.ConvTranspose1d(4, 2, 3, groups=2), r"ConvTranspose1d with groups=2"),
])
def test_groups_are_refused_by_name(layer, match: str) -> None:
    model = nn.Sequential(layer(), nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(2, 4, *((3, 3) if "2d" in match else (3,))))
    with pytest.raises(ValueError, match=match):
        SecondOrderOptimizer(model)
    VIOptimizer(model, dataset_size=10)  # its default diagonal takes the layer's curvature from its gradients


def test_an_unbatched_call_is_refused_by_name() -> None:
    class Unbatched(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.fc = nn.ConvTranspose2d(2, 2, 2), nn.Linear(2 * 9, 3)

        def forward(self, x):
            return self.fc(self.up(x[0]).reshape(1, -1))

    with pytest.raises(ValueError, match=r"ConvTranspose2d modules \{'up': \[2, 3, 3\]\} were called without a batch"):
        curvature.compute(Unbatched(), torch.randn(1, 2, 2, 2), torch.tensor([1]), kind="fisher_mc")


def _decoder_task(n: int = 64):
    """Which of two 4×4 patterns (upsampled from a 2×2 code) a noisy code decodes to: a decoder's layers."""
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (n,), generator=gen)
    x = 0.3 * torch.randn(n, 2, 2, 2, generator=gen)
    x[y == 0, 0] += 1.0
    x[y == 1, 1] += 1.0
    return x, y


@pytest.mark.parametrize("face", ["second_order", "second_order_adaptive", "vi_diag", "vi_kfac", "kfac_precond"])
def test_the_optimizers_train_a_decoder(face: str) -> None:
    torch.manual_seed(0)
    x, y = _decoder_task()
    model = nn.Sequential(nn.ConvTranspose2d(2, 4, 3, stride=2, padding=1, output_padding=1), nn.ReLU(),
                          nn.ConvTranspose2d(4, 2, 3, padding=1), nn.Flatten(), nn.Linear(32, 2))
    with torch.no_grad():
        first = float(F.cross_entropy(model(x), y))
    precond = None
    if face == "second_order":
        opt = SecondOrderOptimizer(model, lr=0.1)
    elif face == "second_order_adaptive":
        opt = SecondOrderOptimizer(model, use_adaptive_learning_rate=True, use_adaptive_momentum=True)
    elif face == "vi_diag":
        opt = VIOptimizer(model, dataset_size=64, lr=0.1)
    elif face == "vi_kfac":
        opt = VIOptimizer(model, dataset_size=64, approx="kfac", lr=0.1)
    else:  # as kfac_pytorch: Linear and Conv2d layers are registered, a transposed convolution is left to SGD
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        precond = KFACPreconditioner(model)
        assert [type(layer.module).__name__ for layer in precond.layers.values()] == ["Linear"]
    closure = make_closure(opt, model, x, y)
    for _ in range(15):
        if precond is None:
            opt.step(closure)
        else:
            closure()
            precond.step()
            opt.step()
    with torch.no_grad():
        assert float(F.cross_entropy(model(x), y)) < 0.5 * first
    if hasattr(opt, "num_skipped"):
        assert opt.num_skipped == 0
    if face.startswith("second_order"):
        assert {n: a.value for n, a in opt.engine.approx.items()} == {"0": "kfac", "2": "kfac", "4": "kfac"}
    if face == "vi_kfac":
        assert opt.predict(x, num_samples=4).shape == (64, 2)


@pytest.mark.parametrize("kfac_approx, bias, classes", [("expand", False, 4), ("reduce", False, 0), ("expand", True, 0)])
def test_a_strided_input_factor_is_decomposed_per_stride_class(monkeypatch: pytest.MonkeyPatch, kfac_approx: str,
                                                               bias: bool, classes: int) -> None:
    """A stride-2 4×4 kernel reads the zero-inserted input at four stride residues of its offsets: ``A`` is zero
    between them, and its eigendecomposition is four of a quarter of the size. The solve equals the dense
    decomposition's. K-FAC-reduce's means over positions mix the classes, and a bias's constant input meets all
    of them: one dense eigendecomposition there."""
    from curvature.blocks.kfac import KFACBlock
    from curvature.modules.conv_transpose import ConvTransposeFamily
    torch.manual_seed(6)
    model = nn.Sequential(nn.ConvTranspose2d(3, 2, 4, stride=2, padding=1, bias=bias), nn.Tanh(), nn.Flatten(),
                          nn.Linear(2 * 8 * 8, 3)).double()
    x, y = torch.randn(5, 3, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    blk = curvature.compute(model, x, y, kind="fisher", approx="kfac", kfac_approx=kfac_approx).blocks["0"]
    label = ConvTransposeFamily().kfac_input_classes(model[0], ["weight"])
    assert label is not None and sorted(torch.bincount(label).tolist()) == [12, 12, 12, 12]
    if kfac_approx == "expand":  # zero between the classes, by construction (not rounding)
        a = blk.A[:48, :48]
        assert not a[label.unsqueeze(1) != label.unsqueeze(0)].any() and a.abs().max() > 0
    sizes = []
    real = KFACBlock._eig

    def counted(f, backend, dtype):
        sizes.append(f.shape[0] if f.dim() == 2 else 0)
        return real(f, backend, dtype)

    monkeypatch.setattr(KFACBlock, "_eig", staticmethod(counted))
    v = [torch.randn(p.shape, dtype=torch.float64) for p in model[0].parameters()]
    blk.decompose(0.01)
    by_class = blk.solve(v)
    assert sorted(sizes) == ([2] + [12] * classes if classes else sorted([2, 48 + bias]))
    monkeypatch.setattr(ConvTransposeFamily, "kfac_input_classes", lambda self, module, names: None)
    blk.right = blk.right.clone()  # a new factor tensor (A): the cached eigendecomposition is not reused
    blk.decompose(0.01)
    for got, want in zip(by_class, blk.solve(v)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
