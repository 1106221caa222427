"""GroupNorm, InstanceNorm and RMSNorm: each example normalized by its own statistics, covered as diagonal or
full blocks.

Every kind and shape is checked against the brute-force reference on ``tests/models.py``'s
``group_rms_norm`` (GroupNorm and InstanceNorm2d after a Conv2d, RMSNorm after a Linear: the layers before
them exact too) in ``test_curvature_reference.py``; here RMSNorm's default ``eps=None`` (the dtype's epsilon,
as torch), multi-dimensional normalized shapes, InstanceNorm1d with running statistics in eval mode, the
shapes the optimizers give them, training, and half-precision inputs.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvature
from optim_helpers import make_closure
from reference import Reference
from torchsso2 import SecondOrderOptimizer, VIOptimizer


class Net(nn.Module):
    def __init__(self, eps) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 2)
        self.gn = nn.GroupNorm(4, 4)  # one channel a group: instance normalization
        self.rms = nn.RMSNorm([4, 2, 2], eps=eps)  # over [C, H, W]
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc(self.rms(torch.tanh(self.gn(self.conv(x)))).flatten(1))


@pytest.mark.parametrize("eps", [None, 1e-3])
@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher", "hessian"])
def test_full_blocks_equal_the_brute_force(eps, kind) -> None:
    torch.manual_seed(0)
    model = Net(eps).double().eval()
    with torch.no_grad():
        model.rms.weight.uniform_(0.5, 1.5)
        model.gn.weight.uniform_(0.5, 1.5)
        model.gn.bias.uniform_(-0.5, 0.5)
    x = torch.randn(5, 2, 3, 3, dtype=torch.float64) * 0.1  # small inputs: eps=None's 2.2e-16 vs a real eps
    y = torch.tensor([0, 1, 2, 1, 0])
    ref = Reference(model, x, y, "cross_entropy").shaped(kind, "full", None)
    got = curvature.compute(model, x, y, kind=kind, approx="full").dense()
    torch.testing.assert_close(got, ref, rtol=1e-8, atol=1e-10)


def test_optimizers_give_them_diagonal_blocks_and_train() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(32, 2, 3, 3), torch.randint(0, 3, (32,))
    for make in (lambda m: SecondOrderOptimizer(m, lr=0.05), lambda m: VIOptimizer(m, dataset_size=32, lr=0.05)):
        model = Net(None)
        opt = make(model)
        if isinstance(opt, SecondOrderOptimizer):
            assert {n: a.value for n, a in opt.engine.approx.items()} == \
                {"conv": "kfac", "gn": "diag", "rms": "diag", "fc": "kfac"}
        closure = make_closure(opt, model, x, y)
        with torch.no_grad():
            first = float(F.cross_entropy(model(x), y))
        for _ in range(30):
            opt.step(closure)
        with torch.no_grad():
            assert float(F.cross_entropy(model(x), y)) < 0.7 * first
        assert opt.num_skipped == 0


def test_without_affine_parameters_they_are_parameter_free_ops() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.GroupNorm(2, 4, affine=False), nn.Linear(4, 4),
                          nn.RMSNorm(4, elementwise_affine=False), nn.Linear(4, 2))
    opt = SecondOrderOptimizer(model)
    assert sorted(opt.engine.layouts) == ["0", "2", "4"]
    opt.step(make_closure(opt, model, torch.randn(8, 4), torch.randint(0, 2, (8,))))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_are_normalized_as_torch_does(dtype) -> None:
    """torch normalizes float16/bfloat16 in float32, with float32's epsilon for ``eps=None``: the normalized
    input (and so the blocks) of the function torch computes, not one with bfloat16's epsilon (7.8e-3: 99% off
    on inputs ~0.02)."""
    from curvature.modules.norm import GroupNormFamily, RMSNormFamily
    x = (torch.randn(4, 3, 8) * 0.02).to(dtype)
    rms = nn.RMSNorm(8).to(dtype)
    want = F.rms_norm(x.float(), (8,), eps=torch.finfo(torch.float32).eps)
    got = RMSNormFamily().normal_input(rms, (x,), rms(x))
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5, atol=1e-5)
    gn = nn.GroupNorm(3, 3).to(dtype)
    want = F.group_norm(x.float(), 3, eps=gn.eps).transpose(1, 2)
    torch.testing.assert_close(GroupNormFamily().normal_input(gn, (x,), gn(x)), want, rtol=1e-5, atol=1e-5)


class Instance1d(nn.Module):
    def __init__(self, track: bool) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.inorm = nn.InstanceNorm1d(3, affine=True, track_running_stats=track)
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.inorm(self.conv(x))).flatten(1))


@pytest.mark.parametrize("track, train", [(False, True), (True, True), (True, False)],
                         ids=["instance-stats", "tracked-training", "running-stats-eval"])
def test_instance_norm_equals_the_brute_force_in_every_mode(track, train) -> None:
    """Instance statistics in training and without tracking; the running ones in eval mode with tracking."""
    torch.manual_seed(0)
    model = Instance1d(track).double()
    with torch.no_grad():
        model.inorm.weight.uniform_(0.5, 1.5)
        model.inorm.bias.uniform_(-0.5, 0.5)
        if track:
            model.inorm.running_mean.uniform_(-0.5, 0.5)
            model.inorm.running_var.uniform_(0.5, 2.0)
    model.train(train)
    x, y = torch.randn(5, 2, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    ref = Reference(copy.deepcopy(model), x, y, "cross_entropy").shaped("fisher", "full", None)
    got = curvature.compute(model, x, y, kind="fisher", approx="full").dense()
    torch.testing.assert_close(got, ref, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("layer, shape", [(nn.InstanceNorm1d, (3, 4)), (nn.InstanceNorm3d, (3, 2, 2, 1))])
def test_an_unbatched_instance_norm_call_is_refused_by_name(layer, shape) -> None:
    class Unbatched(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inorm = layer(3, affine=True)
            self.fc = nn.Linear(12, 3)

        def forward(self, x):
            return self.fc(self.inorm(x[0]).reshape(1, -1))

    name = layer.__name__
    with pytest.raises(ValueError, match=rf"{name} modules \{{'inorm': \{list(shape)}\}} were called without a batch"):
        curvature.compute(Unbatched(), torch.randn((1,) + shape), torch.tensor([1]), kind="fisher", approx="diag")
