"""nn.Conv1d: covered as the Conv2d of a ``1 × k`` kernel over ``[N, C, 1, L]`` (curvature/modules/conv.py).

Every kind × shape is also checked against the brute-force reference (``tests/models.py``'s ``cnn1d``
in ``test_curvature_reference.py``, the one-position exact case in ``test_curvature_exact.py``, the
Hessian diagonal's fast path in ``test_hessian_diag.py``). Here: a Conv1d model gives the same blocks
as the Conv2d model it is equivalent to (K-FAC-reduce and the offset-correlation input factor too), the
offset route against the patches cut out by slicing, the refused configurations, and the optimizers.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvature
from optim_helpers import make_closure
from reference import conv1d_patches
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner


class Net1d(nn.Module):
    """Conv1d (padding) → tanh → Conv1d (stride 2, dilation 3, no bias) → flatten → Linear."""

    def __init__(self, length: int, k2: int = 2, conv=nn.Conv1d) -> None:
        super().__init__()
        two_d = conv is nn.Conv2d
        self.c1 = conv(2, 3, (1, 3) if two_d else 3, padding=(0, 1) if two_d else 1)
        self.c2 = conv(3, 2, (1, k2) if two_d else k2, stride=(1, 2) if two_d else 2,
                       dilation=(1, 3) if two_d else 3, bias=False)
        out = (length - 3 * (k2 - 1) - 1) // 2 + 1
        self.fc = nn.Linear(2 * out, 3)
        self.two_d = two_d

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 2, L]
        h = x.unsqueeze(2) if self.two_d else x
        return self.fc(torch.tanh(self.c2(torch.tanh(self.c1(h)))).flatten(1))


def _pair(length: int = 9):
    torch.manual_seed(0)
    one = Net1d(length).double()
    two = Net1d(length, conv=nn.Conv2d).double()
    with torch.no_grad():  # the same numbers: [C_out, C_in, k] = [C_out, C_in, 1, k]
        for p1, p2 in zip(one.parameters(), two.parameters()):
            p2.copy_(p1.reshape(p2.shape))
    return one, two


@pytest.mark.parametrize("kind, approx", [  # (K-FAC of the Hessian is not defined: NotImplementedError)
    (k, a) for k in ("fisher", "fisher_mc", "empirical_fisher", "hessian")
    for a in ("full", "diag", "kfac", "kfac-reduce") if not (k == "hessian" and a.startswith("kfac"))])
def test_conv1d_equals_the_equivalent_conv2d(kind: str, approx: str) -> None:
    one, two = _pair()
    x = torch.randn(4, 2, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 2, 1, 2])
    extra = {"kfac_approx": "reduce"} if approx == "kfac-reduce" else {}
    shape = approx.split("-")[0]
    if kind == "fisher_mc":
        extra.update(mc_samples=2)
    blocks = [curvature.compute(m, x, y, kind=kind, approx=shape, generator=torch.Generator().manual_seed(5), **extra)
              for m in (one, two)]
    torch.testing.assert_close(blocks[0].dense(), blocks[1].dense(), rtol=1e-12, atol=1e-13)
    assert blocks[0].dense().abs().max() > 0


@pytest.mark.parametrize("bias", [True, False])
def test_long_sequences_take_the_offset_factor_and_equal_the_sliced_patches(bias: bool) -> None:
    """Stride 1 over 300 positions: the input factor from offset correlations (no unfolded patches),
    against the Gram matrix of the patches cut out by slicing."""
    from curvature.modules import conv_factor
    from curvature.modules.conv import as_conv2d
    torch.manual_seed(2)
    conv = nn.Conv1d(3, 4, 5, padding=2, dilation=1, bias=bias).double()
    model = nn.Sequential(conv, nn.Tanh(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 3)).double()
    x = torch.randn(3, 3, 300, dtype=torch.float64)
    assert conv_factor.offset_factor_pays(as_conv2d(conv), (1, 300))
    c = curvature.compute(model, x, torch.tensor([0, 1, 2]), kind="fisher", approx="kfac")
    patches = conv1d_patches(x, conv)  # [N, T, C·k]
    if bias:
        patches = torch.cat([patches, torch.ones(patches.shape[:2] + (1,), dtype=patches.dtype)], dim=2)
    flat = patches.reshape(-1, patches.shape[-1])
    torch.testing.assert_close(c.blocks["0"].A, flat.t() @ flat / flat.shape[0], rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # torch's, for the even kernel
@pytest.mark.parametrize("layer, match", [
    (lambda: nn.Conv1d(4, 4, 3, padding=1, padding_mode="reflect"), r"Conv1d with padding_mode='reflect'"),
    (lambda: nn.Conv1d(4, 4, 2, padding="same"), r"Conv1d with padding='same', kernel_size=\(2,\)"),
])
def test_configurations_outside_the_formulas_are_refused_by_name(layer, match: str) -> None:
    model = nn.Sequential(layer(), nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(2, 4, 6))
    with pytest.raises(ValueError, match=match):
        SecondOrderOptimizer(model)
    # VIOptimizer's default diagonal takes such a layer's curvature from its gradients
    VIOptimizer(model, dataset_size=10)


def _sequence_task(n: int = 64, length: int = 16):
    """Which of two bumps (at the start or the end) a noisy sequence holds."""
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (n,), generator=gen)
    x = 0.3 * torch.randn(n, 1, length, generator=gen)
    x[y == 0, 0, 2:5] += 1.0
    x[y == 1, 0, -5:-2] += 1.0
    return x, y


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 4, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(64, 2))


@pytest.mark.parametrize("make", [
    lambda m: SecondOrderOptimizer(m, lr=0.1),
    lambda m: SecondOrderOptimizer(m, approx="diag", lr=0.1),
    lambda m: SecondOrderOptimizer(m, use_adaptive_learning_rate=True, use_adaptive_momentum=True),
    lambda m: VIOptimizer(m, dataset_size=64, approx="kfac", lr=0.1),
], ids=["kfac", "diag", "adaptive", "vi-kfac"])
def test_optimizers_train_a_conv1d_model(make) -> None:
    x, y = _sequence_task()
    model = _model()
    opt = make(model)
    if isinstance(opt, SecondOrderOptimizer) and opt.engine.approx["0"].value == "kfac":
        assert {n: a.value for n, a in opt.engine.approx.items()} == {"0": "kfac", "2": "kfac", "5": "kfac"}

    closure = make_closure(opt, model, x, y)

    with torch.no_grad():
        first = float(F.cross_entropy(model(x), y))
    for _ in range(20):
        opt.step(closure, targets=y) if getattr(opt, "use_adaptive_learning_rate", False) else opt.step(closure)
    with torch.no_grad():
        assert float(F.cross_entropy(model(x), y)) < 0.5 * first
    assert getattr(opt, "num_skipped", 0) == 0


def test_kfac_preconditioner_registers_linear_and_conv2d_only_as_kfac_pytorch() -> None:
    """kfac_pytorch registers Linear and Conv2d layers; the drop-in does the same (a Conv1d takes the
    plain update of the optimizer it preconditions)."""
    pre = KFACPreconditioner(_model())
    try:
        assert sorted(name for name, _ in pre._layers.values()) == ["5"]  # noqa: SLF001 (kfac_pytorch's attribute)
    finally:
        pre.remove_hooks()


@pytest.mark.parametrize("curv", ["fisher_mc", "empirical_fisher"])  # empirical: from the closure's backward
@pytest.mark.parametrize("approx", ["kfac", "diag"])
def test_an_optimizers_curvature_of_a_conv1d_equals_the_equivalent_conv2ds(curv: str, approx: str) -> None:
    one, two = _pair()
    x = torch.randn(5, 2, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 2, 1, 2, 0])
    running = []
    for model in (one, two):
        opt = SecondOrderOptimizer(model, approx=approx, curvature=curv, seed=3)

        opt.step(make_closure(opt, model, x, y))
        running.append({n: [t.clone() for t in b.tensors()] for n, b in opt.running.blocks.items()})
    assert running[0].keys() == running[1].keys() == {"c1", "c2", "fc"}
    for name in running[0]:
        for a, b in zip(running[0][name], running[1][name]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.cat([p.flatten() for p in one.parameters()]),
                               torch.cat([p.flatten() for p in two.parameters()]), rtol=1e-12, atol=1e-14)


class Unbatched(nn.Module):
    """A batch of one whose convolution is called on the example alone (``[C, L]`` / ``[C, H, W]``)."""

    def __init__(self, conv: nn.Module, features: int) -> None:
        super().__init__()
        self.conv, self.fc = conv, nn.Linear(features, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv(x[0])).reshape(1, -1))


@pytest.mark.parametrize("conv, shape, features", [(lambda: nn.Conv1d(2, 3, 3), (1, 2, 6), 12),
                                                   (lambda: nn.Conv2d(2, 3, 3), (1, 2, 4, 4), 12)],
                         ids=["conv1d", "conv2d"])
def test_a_convolution_called_without_its_batch_dimension_is_refused_by_name(conv, shape, features) -> None:
    """Its channels would be read as the examples (a wrong block, no error, for a Conv1d before)."""
    torch.manual_seed(0)
    model = Unbatched(conv(), features).double()
    x, y = torch.randn(*shape, dtype=torch.float64), torch.tensor([1])
    for kind in ("fisher", "fisher_mc", "empirical_fisher"):
        with pytest.raises(ValueError, match=r"modules \{'conv': \[3, .*without a batch dimension.*unsqueeze\(0\)"):
            curvature.compute(model, x, y, kind=kind, approx="diag")
    opt = SecondOrderOptimizer(model, curvature="empirical_fisher")  # from the closure's own backward too

    closure = make_closure(opt, model, x, y)

    with pytest.raises(ValueError, match="without a batch dimension"):
        opt.step(closure)
    # the Hessian differentiates the loss itself: the unbatched call is the batched one's
    batched = Unbatched(conv(), features).double()
    batched.load_state_dict(model.state_dict())
    batched.forward = lambda x: batched.fc(torch.tanh(batched.conv(x)).reshape(1, -1))
    h = curvature.compute(model, x, y, kind="hessian", approx="full").dense()
    torch.testing.assert_close(h, curvature.compute(batched, x, y, kind="hessian", approx="full").dense())
