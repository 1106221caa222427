"""VIOptimizer's posterior use in cases an audit found wrong: PyTorch-SSO's ``prediction`` averaged one
sample ``mc`` times; a trainable bias beside a frozen weight dropped out of the reparam posterior; the
learned noise with an ``output_selector``; ``predict`` on 1-D logits; ``sampled_params`` without a posterior."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.compat import pytorch_sso


def _closure(opt, model, x, y, loss_fn=F.cross_entropy):
    def closure():
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        return loss, out
    return closure


def test_compat_prediction_averages_different_samples() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = pytorch_sso.VIOptimizer(model, 64, "Cov", {"Linear": "Diag"}, {"damping": 1e-3, "ema_decay": 0.1},
                                  init_precision=1e-2, val_num_mc_samples=10, num_mc_samples=1)
    x = torch.randn(16, 4)
    mean, probs = opt.prediction(x, mc=10, keep_probs=True)
    assert max(float((p - probs[0]).abs().max()) for p in probs[1:]) > 1e-3  # ten different weight samples
    torch.testing.assert_close(mean, torch.stack(probs).mean(0))


def test_reparam_samples_a_trainable_bias_beside_a_frozen_weight() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = VIOptimizer(model, dataset_size=64, ema_decay=0.5)  # diag, curvature="reparam"
    model[0].weight.requires_grad_(False)  # after construction: the layout still covers it
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    for _ in range(3):
        opt.step(_closure(opt, model, x, y))
    assert sorted(opt.running.blocks) == ["0", "2"]
    diag = opt.running.blocks["0"].diagonal
    weight_part, bias_part = diag[:24], diag[24:]
    assert torch.all(weight_part == opt.curvature_init)  # the frozen weight's entries keep the start
    assert not torch.all(bias_part == opt.curvature_init)  # the bias's are estimated
    before = model[0].bias.detach().clone()
    with opt.sampled_params(generator=torch.Generator().manual_seed(1)):
        assert not torch.equal(model[0].bias, before) and model[0].bias.shape == before.shape


def test_learned_noise_with_an_output_selector() -> None:
    class Dict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return {"pred": self.lin(x)}

    torch.manual_seed(0)
    model = Dict()
    opt = VIOptimizer(model, dataset_size=64, loss="mse", noise_variance="learned",
                      output_selector=lambda o: o["pred"])
    x, y = torch.randn(32, 3), torch.randn(32, 2)
    closure = _closure(opt, model, x, y, lambda out, t: 0.5 * (out["pred"] - t).pow(2).sum(1).mean())
    for _ in range(3):
        opt.step(closure, targets=y)
    assert opt.noise.variance != 1.0


def test_learned_noise_reads_a_returned_pick_as_the_returned_model_output() -> None:
    """A closure may return the selector's pick (``out["pred"]``) instead of the model's dict: the residuals,
    and so the learned noise, are the same (the selector applied to the pick raised ``TypeError``)."""
    class Dict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return {"pred": self.lin(x), "aux": x.sum(1)}

    x, y = torch.randn(32, 3, generator=torch.Generator().manual_seed(1)), torch.randn(32, 2)
    noise = {}
    for returns in ("dict", "pick"):
        torch.manual_seed(0)
        model = Dict()
        opt = VIOptimizer(model, dataset_size=64, loss="mse", noise_variance="learned",
                          output_selector=lambda o: o["pred"])

        def closure():
            opt.zero_grad()
            out = model(x)
            loss = 0.5 * (out["pred"] - y).pow(2).sum(1).mean()
            loss.backward()
            return loss, (out if returns == "dict" else out["pred"])
        for _ in range(3):
            opt.step(closure, targets=y)
        noise[returns] = opt.noise.variance
    assert noise["dict"] != 1.0
    assert noise["pick"] == noise["dict"]


def test_predict_refuses_logits_without_a_class_dimension() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0))
    opt = VIOptimizer(model, dataset_size=64)
    with pytest.raises(ValueError, match=r"shape \(5,\): no class dimension"):
        opt.predict(torch.randn(5, 3))


def test_sampled_params_without_a_posterior_raises_as_predict() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    opt = VIOptimizer(model, dataset_size=64, curvature_init=None, approx="diag")
    with pytest.raises(RuntimeError, match=r"sampled_params\(\) before the first step"):
        with opt.sampled_params():
            pass


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reparam_frozen_entries_do_not_drift_in_half_precision(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)
    opt = VIOptimizer(model, dataset_size=64, ema_decay=0.5)
    x, y = torch.randn(16, 4).to(dtype), torch.randint(0, 3, (16,))
    closure = _closure(opt, model, x, y, lambda out, t: F.cross_entropy(out.float(), t))
    for _ in range(3):
        opt.step(closure)
    model[0].weight.requires_grad_(False)
    frozen = opt.running.blocks["0"].diagonal[:24].clone()
    for _ in range(5):
        opt.step(closure)
    assert torch.equal(opt.running.blocks["0"].diagonal[:24], frozen)


def test_predict_on_one_unbatched_example() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    opt = VIOptimizer(model, dataset_size=64)
    x = torch.randn(3)
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    torch.testing.assert_close(opt.predict(x, num_samples=4, generator=gen()),
                               opt.predict(x[None], num_samples=4, generator=gen())[0])


def test_compat_prediction_before_a_step_without_init_precision_says_what_to_do() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    opt = pytorch_sso.VIOptimizer(model, 64, "Cov", {"Linear": "Diag"}, {"damping": 1e-3, "ema_decay": 0.1})
    with pytest.raises(RuntimeError, match=r"prediction\(mc=2\) before the first step needs init_precision"):
        opt.prediction(torch.randn(8, 4), mc=2)
    assert opt.prediction(torch.randn(8, 4), mc=0).shape == (8, 3)


@pytest.mark.parametrize("face", ["hessian", "empirical_fisher", "vi"])
@pytest.mark.parametrize("returns", ["output", "pick"])
def test_loss_scale_check_reads_a_pick_that_its_selector_also_fits(face: str, returns: str) -> None:
    """A slicing selector (``o[:, 1:]``) also fits its own pick when the batch's labels leave out the last
    class: a closure returning the pick is read as the pick (the mean NLL nearer the loss), not sliced again
    into a false loss-scale warning; a closure returning the whole output is sliced as before."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 5, generator=gen), torch.randint(0, 8, (32,), generator=gen)  # 10 classes, none ≥ 8
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 11))  # column 0 is not a class
    pick = lambda o: o[:, 1:]  # noqa: E731
    if face == "vi":
        opt = VIOptimizer(model, dataset_size=64, output_selector=pick)
    else:
        opt = SecondOrderOptimizer(model, curvature=face, approx="diag", output_selector=pick)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(pick(out), y)
        loss.backward()
        return loss, (out if returns == "output" else pick(out))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(closure, targets=y)

    def scaled():  # the check still warns about a loss that is not the mean NLL of either
        opt.zero_grad()
        out = model(x)
        loss = 3 * F.cross_entropy(pick(out), y)
        loss.backward()
        return loss, (out if returns == "output" else pick(out))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 11))
    opt = VIOptimizer(model, dataset_size=64, output_selector=pick) if face == "vi" else \
        SecondOrderOptimizer(model, curvature=face, approx="diag", output_selector=pick)
    with pytest.warns(UserWarning, match="mean negative log-likelihood"):
        opt.step(scaled, targets=y)
