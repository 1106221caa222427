"""VIOptimizer: a checkpoint loaded under other posterior settings, the padding row's variance, and
the warnings about a closure's batch (a scaled loss, a dataset_size below the batch)."""
from __future__ import annotations

import math

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import VIOptimizer


def _data():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(32, 6, generator=gen), torch.randint(0, 3, (32,), generator=gen)


def _trained(approx: str, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = VIOptimizer(model, approx=approx, **kwargs)
    x, y = _data()

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss
    for _ in range(3):
        opt.step(closure)
    return model, opt, closure


@pytest.mark.parametrize("approx", ["kfac", "diag"])
@pytest.mark.parametrize("changed", [dict(dataset_size=10000), dict(dataset_size=100, prior_precision=1000.0)])
def test_a_checkpoint_loaded_under_other_posterior_settings_samples_the_new_posterior(approx, changed) -> None:
    """The saved decompositions hold N·C + τδ + damping of the saving optimizer; loaded into one built with
    another dataset_size or prior they were kept, so the samples were of the old posterior (K-FAC's
    100× wider, for up to inv_update_interval steps) while posterior_variance() gave the new one. Now they
    are redone from the curvature before the next sample: the samples' variance is posterior_variance()."""
    model, opt, _ = _trained(approx, dataset_size=100)
    fresh = VIOptimizer(model, approx=approx, **changed)
    fresh.load_state_dict(opt.state_dict())
    gen = torch.Generator().manual_seed(0)
    draws = []
    for _ in range(2000):
        with torch.no_grad(), fresh.sampled_params(generator=gen):
            draws.append(model.weight.detach().clone())
    sampled = torch.stack(draws).var(0).mean()
    expected = fresh.posterior_variance()[model.weight].mean()
    # 2000 draws of 18 weights: the mean of the variances within 10% (its standard error is about 1%)
    assert float(sampled / expected) == pytest.approx(1.0, abs=0.1)
    old = opt.posterior_variance()[model.weight].mean()
    assert float(old / expected) > 5  # the settings changed the posterior by far more than the tolerance


def test_a_checkpoint_loaded_under_the_same_settings_keeps_its_decompositions() -> None:
    model, opt, _ = _trained("kfac", dataset_size=100)
    fresh = VIOptimizer(model, approx="kfac", dataset_size=100)
    fresh.load_state_dict(opt.state_dict())
    assert fresh._decomposed
    for name, blk in opt.running.blocks.items():
        for key, value in blk.decomposition.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(fresh.running.blocks[name].decomposition[key], value)


def test_the_padding_row_of_an_embedding_has_variance_zero() -> None:
    """It is never sampled; posterior_variance() gave it the variance of an untouched row."""
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4, padding_idx=0)
            self.fc = nn.Linear(4, 3)

        def forward(self, t):
            return self.fc(self.emb(t).mean(1))

    torch.manual_seed(0)
    model = Bag()
    tokens, y = torch.randint(0, 10, (16, 5)), torch.randint(0, 3, (16,))
    for approx in ("diag", "kfac"):
        opt = VIOptimizer(model, dataset_size=100, approx=approx)
        assert bool((opt.posterior_variance()[model.emb.weight][0] == 0).all())  # before the first step too

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(tokens), y)
            loss.backward()
            return loss
        opt.step(closure)
        var = opt.posterior_variance()[model.emb.weight]
        assert bool((var[0] == 0).all()) and bool((var[1:] > 0).all())


def _warnings_of_first_step(loss_fn, dataset_size: int = 100, targets: bool = True, out_dim: int = 3,
                            loss: str = "cross_entropy"):
    torch.manual_seed(0)
    model = nn.Linear(6, out_dim)
    x, y = _data()
    t = torch.randn(32, out_dim) if loss == "mse" else y
    opt = VIOptimizer(model, dataset_size=dataset_size, loss=loss)

    def closure():
        opt.zero_grad()
        out = model(x)
        value = loss_fn(out, t)
        value.backward()
        return value, out
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.step(closure, targets=t if targets else None)
    return [str(w.message) for w in rec if "VIOptimizer:" in str(w.message)]


def test_a_loss_that_is_not_the_mean_nll_warns_once_naming_the_factor() -> None:
    assert _warnings_of_first_step(lambda o, t: F.cross_entropy(o, t)) == []
    summed = _warnings_of_first_step(lambda o, t: F.cross_entropy(o, t, reduction="sum"))
    assert len(summed) == 1 and "32×" in summed[0] and "reduction='sum'" in summed[0]
    # F.mse_loss of one output per example is 2× the Gaussian NLL ½‖y − f‖²; of two outputs it is the NLL
    one = _warnings_of_first_step(lambda o, t: F.mse_loss(o, t), out_dim=1, loss="mse")
    assert len(one) == 1 and "2×" in one[0]
    assert _warnings_of_first_step(lambda o, t: F.mse_loss(o, t), out_dim=2, loss="mse") == []
    # without the targets nothing can be told
    assert _warnings_of_first_step(lambda o, t: F.cross_entropy(o, t, reduction="sum"), targets=False) == []


def test_the_loss_factor_is_that_of_the_gradient_not_of_the_value() -> None:
    """A constant in the loss (F.gaussian_nll_loss's ½·log σ², log 2π) moved the value-based factor: the
    exact NLL plus a constant was warned about as 2.2×, a 4×-scaled Gaussian NLL as 3.04×."""
    def nll_plus_constant(o, t):
        return 0.5 * (o - t).pow(2).sum(-1).mean() + 0.5 * o.shape[-1] * math.log(2 * math.pi)
    assert _warnings_of_first_step(nll_plus_constant, out_dim=3, loss="mse") == []
    var = _warnings_of_first_step(lambda o, t: F.gaussian_nll_loss(o, t, torch.full_like(o, 0.25)), out_dim=1,
                                  loss="mse")
    assert len(var) == 1 and "is 4× that of the mean negative log-likelihood" in var[0]
    three = _warnings_of_first_step(lambda o, t: F.gaussian_nll_loss(o, t, torch.full_like(o, 0.25)), out_dim=3,
                                    loss="mse")
    assert len(three) == 1 and "is 1.333× that" in three[0]


def test_a_dataset_size_below_the_batch_warns_once() -> None:
    small = _warnings_of_first_step(lambda o, t: F.cross_entropy(o, t), dataset_size=8)
    assert len(small) == 1 and "dataset_size=8 is smaller than this step's batch of 32" in small[0]
    assert _warnings_of_first_step(lambda o, t: F.cross_entropy(o, t), dataset_size=32) == []


def test_weight_decay_in_the_constructor_names_the_prior() -> None:
    """IVON's constructor takes weight_decay; here it was Python's 'unexpected keyword argument'."""
    with pytest.raises(ValueError, match=r"weight_decay=0.0001.*prior_precision = wd \* dataset_size"):
        VIOptimizer(nn.Linear(3, 2), dataset_size=10, weight_decay=1e-4)
    VIOptimizer(nn.Linear(3, 2), dataset_size=10, weight_decay=0.0)
