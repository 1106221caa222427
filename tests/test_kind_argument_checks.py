"""Arguments that depend on the curvature kind. ``mc_samples`` (labels sampled per example) only means
something for the Monte-Carlo Fisher: with another curvature it is a ValueError on every face (it was
accepted without effect; a VI user who meant weight samples, ``num_mc_samples``, is told so).
VIOptimizer needs ``prior_precision·kl_weighting + damping > 0`` with the Hessian too."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import curvature
from torchsso2 import SecondOrderOptimizer, VIOptimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher", "hessian"])
def test_compute_refuses_mc_samples_without_sampling(kind: str) -> None:
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    with pytest.raises(ValueError, match=f"mc_samples=3 has no effect with kind='{kind}'.*'fisher_mc'"):
        curvature.compute(_model(), x, y, kind=kind, approx="diag", mc_samples=3)
    curvature.compute(_model(), x, y, kind=kind, approx="diag", mc_samples=1)


@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher", "hessian"])
def test_second_order_refuses_mc_samples_without_sampling(kind: str) -> None:
    with pytest.raises(ValueError, match=f"mc_samples=2 has no effect with curvature='{kind}'"):
        SecondOrderOptimizer(_model(), curvature=kind, mc_samples=2)


@pytest.mark.parametrize("kw,shown", [({}, "reparam"), ({"curvature": "reparam"}, "reparam"),
                                      ({"approx": "kfac", "curvature": "fisher"}, "fisher")])
def test_vi_refuses_mc_samples_without_sampling_and_names_num_mc_samples(kw: dict, shown: str) -> None:
    with pytest.raises(ValueError, match=f"mc_samples=10 has no effect with curvature='{shown}'.*num_mc_samples"):
        VIOptimizer(_model(), dataset_size=10, mc_samples=10, **kw)


def test_mc_samples_with_the_monte_carlo_fisher_is_taken() -> None:
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    curvature.compute(_model(), x, y, kind="fisher_mc", approx="diag", mc_samples=3)
    assert SecondOrderOptimizer(_model(), mc_samples=2).settings.mc_samples == 2  # fisher_mc: the default
    assert VIOptimizer(_model(), dataset_size=10, approx="kfac", mc_samples=4).settings.mc_samples == 4


@pytest.mark.parametrize("curv", ["hessian", "fisher"])
def test_vi_needs_a_positive_prior_or_damping_with_every_kind(curv: str) -> None:
    with pytest.raises(ValueError, match="prior_precision=0.0, kl_weighting=1.0, damping=0.0"):
        VIOptimizer(_model(), dataset_size=10, approx="full", curvature=curv, prior_precision=0.0, damping=0.0)
    VIOptimizer(_model(), dataset_size=10, approx="full", curvature=curv, prior_precision=0.0, damping=1e-3)


def test_vi_parses_the_curvature_name_before_checking_mc_samples() -> None:
    with pytest.raises(ValueError, match="did you mean 'fisher_mc'"):
        VIOptimizer(_model(), dataset_size=10, approx="kfac", curvature="fisher-mc", mc_samples=2)


@pytest.mark.parametrize("name", ["reparm", "Reparm", "repram", "re-param"])  # ("Reparam" is taken: any case)
def test_vi_suggests_reparam(name: str) -> None:
    with pytest.raises(ValueError, match="did you mean 'reparam'"):
        VIOptimizer(_model(), dataset_size=10, curvature=name)
