"""VIOptimizer after training: ``predict`` keeps one output's worth of running sums (it held every
sample's output: ~70x the output's size at the default 32 samples), ``posterior_variance`` gives each
weight's variance without the dense [P, P] precision, and ``step`` / ``predict`` / a nested
``sampled_params`` inside ``sampled_params`` are refused (a step there was undone on exit)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import make_closure
from torchsso2 import VIOptimizer


def _trained(approx: str = "diag", loss: str = "cross_entropy", **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    opt = VIOptimizer(model, dataset_size=50, approx=approx, loss=loss, kl_weighting=0.3, **kwargs)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=g) if loss == "cross_entropy" else torch.randn(16, 3, generator=g,
                                                                                              dtype=torch.float64)
    for _ in range(12):
        opt.step(make_closure(opt, model, x, y, loss=loss))
    return model, opt, x


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_predict_is_the_mean_and_population_variance_of_the_samples(loss):
    model, opt, x = _trained(loss=loss, **({"noise_variance": 0.25} if loss == "mse" else {}))
    samples = []
    g = torch.Generator().manual_seed(7)
    for _ in range(9):
        with torch.no_grad(), opt.sampled_params(generator=g):
            out = model(x)
        samples.append(torch.softmax(out, -1) if loss == "cross_entropy" else out)
    stacked = torch.stack(samples)
    got = opt.predict(x, num_samples=9, generator=torch.Generator().manual_seed(7), antithetic=False,
                      return_variance=loss == "mse")
    if loss == "mse":
        mean, var = got
        torch.testing.assert_close(var, (stacked - stacked.mean(0)).square().mean(0) + 0.25, rtol=1e-12, atol=1e-14)
    else:
        mean = got
    torch.testing.assert_close(mean, stacked.mean(0), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("approx", ["diag", "kfac", "full"])
def test_posterior_variance_is_the_diagonal_of_the_inverse_precision(approx):
    model, opt, _ = _trained(approx=approx)
    variance = opt.posterior_variance()
    want = torch.linalg.inv(opt.posterior_precision()).diagonal()
    got = torch.cat([variance[p].reshape(-1) for p in opt.engine.params])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    assert all(variance[p].shape == p.shape for p in model.parameters())


def test_posterior_variance_of_embedding_and_generic_blocks():
    """A diagonal K-FAC factor (Embedding's input side) and a module without a layer family (a GRU,
    covered by the default diagonal)."""
    torch.manual_seed(0)
    emb = nn.Sequential(nn.Embedding(6, 4), nn.Flatten(), nn.Linear(8, 3)).double()
    opt = VIOptimizer(emb, dataset_size=20, approx="kfac")
    tokens, y = torch.randint(0, 6, (10, 2)), torch.randint(0, 3, (10,))
    for _ in range(3):
        opt.step(make_closure(opt, emb, tokens, y))
    got = torch.cat([opt.posterior_variance()[p].reshape(-1) for p in opt.engine.params])
    torch.testing.assert_close(got, torch.linalg.inv(opt.posterior_precision()).diagonal(), rtol=1e-10, atol=0)

    class Last(nn.Module):
        def forward(self, out):
            return out[0][:, -1]
    gru = nn.Sequential(nn.GRU(3, 4, batch_first=True), Last(), nn.Linear(4, 2))
    opt = VIOptimizer(gru, dataset_size=20)
    x, y = torch.randn(8, 5, 3), torch.randint(0, 2, (8,))
    for _ in range(3):
        opt.step(make_closure(opt, gru, x, y))
    variance = opt.posterior_variance()
    assert set(variance) == set(gru.parameters())
    got = torch.cat([variance[p].reshape(-1) for p in opt.engine.params]).double()
    torch.testing.assert_close(got, torch.linalg.inv(opt.posterior_precision().double()).diagonal(), rtol=1e-5, atol=0)


def test_step_predict_and_nested_samples_inside_sampled_params_are_refused():
    model, opt, x = _trained()
    y = torch.randint(0, 3, (16,))
    mean = [p.detach().clone() for p in model.parameters()]
    steps = opt.num_steps
    with opt.sampled_params(generator=torch.Generator().manual_seed(0)):
        with pytest.raises(RuntimeError, match=r"step\(\) inside `with opt.sampled_params\(\):`"):
            opt.step(make_closure(opt, model, x, y))
        with pytest.raises(RuntimeError, match=r"predict\(\) inside"):
            opt.predict(x)
        with pytest.raises(RuntimeError, match=r"sampled_params\(\) inside"):
            with opt.sampled_params():
                pass
    assert opt.num_steps == steps and all(torch.equal(a, b) for a, b in zip(mean, model.parameters()))
    opt.step(make_closure(opt, model, x, y))  # outside: as before
    opt.predict(x)
    assert opt.num_steps == steps + 1


def test_sampling_calls_inside_a_step_closure_are_refused():
    """IVON's `with opt.sampled_params(train=True)` ported into a closure sampled the step's sample again
    (twice the noise); predict() there sampled around the sample."""
    model, opt, x = _trained()
    y = torch.randint(0, 3, (16,))
    for call in (lambda: opt.sampled_params().__enter__(), lambda: opt.predict(x)):
        def closure():
            opt.zero_grad()
            call()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        with pytest.raises(RuntimeError, match=r"inside step\(\)'s closure"):
            opt.step(closure)
    opt.step(make_closure(opt, model, x, y))  # the flag does not outlive the refused calls
    opt.predict(x)


def test_deepcopy_inside_sampled_params_is_refused():
    import copy
    model, opt, _ = _trained()
    with opt.sampled_params(generator=torch.Generator().manual_seed(0)):
        with pytest.raises(RuntimeError, match="deepcopy of the optimizer inside"):
            copy.deepcopy((model, opt))
    copy.deepcopy((model, opt))


def test_posterior_variance_is_zero_for_frozen_weights_and_refuses_an_indefinite_precision():
    model, opt, x = _trained()
    model[0].requires_grad_(False)
    opt.step(make_closure(opt, model, x, torch.randint(0, 3, (16,))))
    variance = opt.posterior_variance()
    assert all(bool((variance[p] == 0).all()) for p in model[0].parameters())
    assert all(bool((variance[p] > 0).all()) for p in model[2].parameters())
    for blk in opt.running.blocks.values():  # an indefinite curvature (as a Hessian estimate can be)
        blk.diagonal.fill_(-1.0)
    with pytest.raises(RuntimeError, match=r"precision of block '\d' is not positive"):
        opt.posterior_variance()


def test_posterior_variance_of_float32_kfac_factors_of_low_rank_is_positive():
    """A float32 factor of rank below its size has eigenvalues a rounding below 0: unclamped they made
    some variances negative where the sampler (which clamps them) draws positive ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(50, 20), nn.Tanh(), nn.Linear(20, 3))
    opt = VIOptimizer(model, dataset_size=10 ** 6, approx="kfac", prior_precision=1e-3, curvature_init=None,
                      ema_decay=0.5)
    x, y = torch.randn(4, 50), torch.randint(0, 3, (4,))
    for _ in range(3):
        opt.step(make_closure(opt, model, x, y))
    assert all(bool((v > 0).all()) and v.dtype == torch.float32 for v in opt.posterior_variance().values())
