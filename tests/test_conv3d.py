"""nn.Conv3d: the weight applied to unfolded 3-D patches (curvature/modules/conv.py: Conv3dFamily).

Every kind × shape is checked against the brute-force reference (``tests/models.py``'s ``cnn3d``, patches
cut by slicing) in ``test_curvature_reference.py``, the Hessian diagonal's fast path in
``test_hessian_diag.py``. Here: a Conv3d of depth-1 kernels over ``[N, C, 1, H, W]`` gives the blocks of the
equal Conv2d model, refused configurations, an unbatched call, and training.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvature
from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer


class Net(nn.Module):
    def __init__(self, three_d: bool) -> None:
        super().__init__()
        conv = nn.Conv3d if three_d else nn.Conv2d
        k = (lambda *v: (1,) + v) if three_d else (lambda *v: v)
        self.c1 = conv(2, 3, k(3, 3), padding=k(1, 1) if not three_d else (0, 1, 1))
        self.c2 = conv(3, 2, k(2, 2), stride=k(2, 2) if not three_d else (1, 2, 2), dilation=k(1, 2) if not three_d
                       else (1, 1, 2), bias=False)
        self.fc = nn.Linear(2 * 2 * 1, 3)
        self.three_d = three_d

    def forward(self, x):  # [N, 2, 5, 4]
        h = x.unsqueeze(2) if self.three_d else x
        return self.fc(torch.tanh(self.c2(torch.tanh(self.c1(h)))).flatten(1))


@pytest.mark.parametrize("kind, approx", [(k, a) for k in ("fisher", "fisher_mc", "empirical_fisher", "hessian")
                                          for a in ("full", "diag", "kfac") if not (k == "hessian" and a == "kfac")])
def test_a_depth_one_conv3d_equals_the_conv2d(kind, approx) -> None:
    torch.manual_seed(0)
    three, two = Net(True).double(), Net(False).double()
    with torch.no_grad():
        for p3, p2 in zip(three.parameters(), two.parameters()):
            p3.copy_(p2.reshape(p3.shape))
    x = torch.randn(4, 2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 2, 1, 2])
    extra = {"mc_samples": 2} if kind == "fisher_mc" else {}
    got = [curvature.compute(m, x, y, kind=kind, approx=approx, generator=torch.Generator().manual_seed(5),
                             **extra).dense() for m in (three, two)]
    torch.testing.assert_close(got[0], got[1], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("layer, match", [
    (lambda: nn.Conv3d(4, 4, 3, padding=1, padding_mode="replicate"), r"Conv3d with padding_mode='replicate'"),
])
def test_configurations_outside_the_formulas_are_refused_by_name(layer, match) -> None:
    model = nn.Sequential(layer(), nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(2, 4, 3, 3, 3))
    with pytest.raises(ValueError, match=match):
        SecondOrderOptimizer(model)


def test_an_unbatched_call_is_refused_and_optimizers_train() -> None:
    class Unbatched(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = nn.Conv3d(2, 2, 2), nn.Linear(2, 3)

        def forward(self, x):
            return self.fc(self.conv(x[0]).reshape(1, -1))

    with pytest.raises(ValueError, match=r"Conv3d modules \{'conv': \[2, 1, 1, 1\]\} were called without a batch"):
        curvature.compute(Unbatched(), torch.randn(1, 2, 2, 2, 2), torch.tensor([1]), kind="fisher_mc")
    torch.manual_seed(0)
    x, y = torch.randn(32, 1, 4, 4, 4), torch.randint(0, 2, (32,))
    for make in (lambda m: SecondOrderOptimizer(m, lr=0.1), lambda m: VIOptimizer(m, dataset_size=32, approx="kfac",
                                                                                   lr=0.1)):
        model = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(256, 2))
        opt = make(model)
        with torch.no_grad():
            first = float(F.cross_entropy(model(x), y))
        closure = make_closure(opt, model, x, y)
        for _ in range(15):
            opt.step(closure)
        with torch.no_grad():
            assert float(F.cross_entropy(model(x), y)) < 0.5 * first
        assert opt.num_skipped == 0


@pytest.mark.parametrize("bias", [True, False])
def test_the_feature_major_input_factor_equals_the_normal_forms(bias) -> None:
    from curvature.modules.conv import Conv3dFamily, unfold_patches_3d
    from reference import conv3d_patches
    torch.manual_seed(1)
    conv = nn.Conv3d(3, 2, (2, 3, 2), stride=(1, 2, 1), dilation=(2, 1, 1), padding=(1, 1, 0), bias=bias).double()
    x = torch.randn(4, 3, 5, 6, 4, dtype=torch.float64)
    # the normal form (a view of the feature-major rows) against the patches cut out by slicing
    torch.testing.assert_close(unfold_patches_3d(x, conv), conv3d_patches(x, conv), rtol=0, atol=0)
    out = conv(x)
    g = torch.randn((1,) + tuple(out.shape), dtype=torch.float64)
    fam, names = Conv3dFamily(), ["weight", "bias"] if bias else ["weight"]
    gn = fam.normal_output_grad(conv, g)
    want = fam.kfac_factors(conv, fam.normal_input(conv, (x,), out), gn, names)
    got = fam.kfac_factors_from_inputs(conv, (x,), out, gn, names)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
