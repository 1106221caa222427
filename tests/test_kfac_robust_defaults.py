"""Issue 30, "defaults that are safe": the KL clip used when ``kl_clip`` is not passed is
``DEFAULT_KL_CLIP / √inv_update_interval`` (torchsso2/optim/second_order.py, default_kl_clip),
and at kfac_pytorch's intervals 10/100 it trains issue 30's grid point better than the flat 1e-3.
"""
from __future__ import annotations

import math

import pytest
import torch

from benchmarks import kfac_robustness
from torchsso2 import SecondOrderOptimizer
from torchsso2.optim.second_order import DEFAULT_KL_CLIP, default_kl_clip


@pytest.mark.parametrize("inv", [1, 2, 20, 100])
def test_default_kl_clip_is_the_base_over_the_root_of_the_inverse_interval(inv):
    model = torch.nn.Linear(3, 2)
    expected = DEFAULT_KL_CLIP / math.sqrt(inv)
    assert default_kl_clip(inv) == expected
    assert SecondOrderOptimizer(model, inv_update_interval=inv).kl_clip == pytest.approx(expected, rel=1e-15)
    # an explicit value, or None, is taken as given
    assert SecondOrderOptimizer(model, inv_update_interval=inv, kl_clip=DEFAULT_KL_CLIP).kl_clip == DEFAULT_KL_CLIP
    assert SecondOrderOptimizer(model, inv_update_interval=inv, kl_clip=None).kl_clip is None
    assert SecondOrderOptimizer(model, inv_update_interval=inv, use_adaptive_learning_rate=True).kl_clip is None


def test_bad_interval_is_still_refused_by_its_own_check():
    with pytest.raises(ValueError, match="inv_update_interval"):
        SecondOrderOptimizer(torch.nn.Linear(3, 2), inv_update_interval=0)


def test_default_clip_at_10_100_reaches_97_percent_and_ends_above_the_flat_clip():
    """Issue 30's grid point lr 0.1, damping 1e-3 at intervals 10/100 (digits MLP, standardized
    inputs, batch 512, momentum 0.9, 15 epochs): with the default clip (1e-4 here) the median of
    seeds 0-2 reaches 97% test accuracy; with kl_clip=1e-3 (the flat default before) the run fits
    the training set faster and settles lower: over seeds 0-5 its mean test accuracy after 15 epochs
    is below the default clip's by more than 0.005 (about 2 of the 360 test digits; measured 0.948
    against 0.961, and 3 against 6 of seeds 0-9 reaching 97%)."""
    data = kfac_robustness.load_data(standardize=True)
    torch.set_num_threads(1)

    def runs(seeds, **kw):
        orig = kfac_robustness.make_optimizer

        def make(name, model, lr, damping, seed, intervals):
            return SecondOrderOptimizer(model, approx="kfac", lr=lr, damping=damping, momentum=0.9, seed=seed,
                                        curv_update_interval=intervals[0], inv_update_interval=intervals[1], **kw)
        kfac_robustness.make_optimizer = make
        try:
            out = [kfac_robustness.train("kfac", 0.1, 1e-3, s, data, 15, 512, 0.97, (10, 100)) for s in seeds]
        finally:
            kfac_robustness.make_optimizer = orig
        assert not any(r["diverged"] for r in out)
        return out

    default, flat = runs(range(6)), runs(range(6), kl_clip=DEFAULT_KL_CLIP)
    assert kfac_robustness.summarize(default[:3])["reached"]
    mean = lambda rs: sum(r["final_accuracy"] for r in rs) / len(rs)  # noqa: E731
    assert mean(default) > mean(flat) + 0.005, (mean(default), mean(flat))
