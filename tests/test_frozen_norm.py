"""Routing of training-mode BatchNorm outputs (curvature/frozen_norm.py): the user's backward
sees the true gradient, the curvature's backward the frozen-statistics Jacobian."""
import copy

import pytest
import torch
from torch import nn

from curvature.capture import Capture
from curvature.frozen_norm import frozen_input_scale, uses_batch_statistics
from torchsso2 import SecondOrderOptimizer


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                      nn.Linear(3 * 4 * 4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).double()
    with torch.no_grad():
        for bn in (m[1], m[5]):
            bn.weight.uniform_(0.5, 2.0)
            bn.bias.uniform_(-1.0, 1.0)
    return m


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(6, 2, 4, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)


def test_user_backward_is_unchanged():
    model, (x, y) = _model(), _batch()
    plain = copy.deepcopy(model)
    nn.functional.cross_entropy(plain(x), y).backward()
    with Capture({"0": model[0]}, root=model, freeze_batch_stats=True) as cap:
        out = model(x)
    assert torch.equal(out, plain(x))
    nn.functional.cross_entropy(out, y).backward()
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-12), n
    assert not cap.frozen.active


def test_frozen_backward_is_the_frozen_statistics_jacobian():
    model, (x, _) = _model(), _batch()
    bn = model[1]
    x0 = model[0](x).detach().requires_grad_(True)
    with Capture({}, root=model, freeze_batch_stats=True) as cap:
        out = bn(x0)
    v = torch.randn_like(out)
    with cap.frozen.on():
        (g,) = torch.autograd.grad(out, x0, v, retain_graph=True)
    assert torch.allclose(g, v * frozen_input_scale(bn, x0), rtol=1e-12, atol=1e-12)
    # the frozen-statistics model: eval mode with the batch statistics as running statistics
    frozen = copy.deepcopy(bn).eval()
    with torch.no_grad():
        frozen.running_mean.copy_(x0.mean(dim=(0, 2, 3)))
        frozen.running_var.copy_(x0.var(dim=(0, 2, 3), unbiased=False))
    (g_ref,) = torch.autograd.grad(frozen(x0), x0, v)
    assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-12)
    (g_true,) = torch.autograd.grad(out, x0, v)  # outside frozen.on(): the true Jacobian
    assert (g_true - g).abs().max() > 1e-3


def test_only_batchnorms_with_batch_statistics_are_routed():
    model = _model()
    assert uses_batch_statistics(model[1]) and not uses_batch_statistics(model[0])
    model.eval()
    assert not uses_batch_statistics(model[1])
    no_stats = nn.BatchNorm1d(4, track_running_stats=False).eval()
    assert uses_batch_statistics(no_stats)  # normalizes with the batch even in eval mode
    assert not uses_batch_statistics(nn.SyncBatchNorm(4).train())  # global statistics: not routed
    x, _ = _batch()
    for train in (True, False):
        model.train(train)
        seen = []
        with Capture({}, root=model, freeze_batch_stats=True):
            # registered after the capture's hook: sees the BatchNorm output as routed (or not)
            h = model[1].register_forward_hook(lambda m, i, o: seen.append(type(o.grad_fn).__name__))
            model(x)
            h.remove()
        assert ("_Route" in seen[0]) == train, seen


@pytest.mark.parametrize("approx", ["kfac", "diag"])
def test_optimizer_steps_with_the_true_gradient(approx):
    model, (x, y) = _model(), _batch()
    plain = copy.deepcopy(model)
    nn.functional.cross_entropy(plain(x), y).backward()
    opt = SecondOrderOptimizer(model, lr=0.1, approx={nn.Conv2d: approx, nn.Linear: approx,
                                                       nn.BatchNorm2d: "diag", nn.BatchNorm1d: "diag"},
                               curvature="fisher", damping=0.1)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        return loss, out

    opt.step(closure)
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-12), n
    assert opt.num_skipped == 0
