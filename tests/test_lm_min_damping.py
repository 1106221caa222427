"""The Levenberg–Marquardt rule's lower bound on the damping (``min_damping``, default 1e-4)."""
from __future__ import annotations

import math

import pytest

import torch
import torch.nn.functional as F

from benchmarks.kfac_robustness import load_data
from torchsso2 import SecondOrderOptimizer
from torchsso2.optim.damping import DEFAULT_MIN_DAMPING, LMDamping


def test_default_bound_is_1e_4_and_an_explicit_bound_is_used_as_given():
    assert DEFAULT_MIN_DAMPING == 1e-4
    lm = LMDamping(1e-2, decay=0.5)
    for _ in range(40):  # the model always predicts the loss exactly: the damping decays every time
        lm.update(-1.0, -1.0)
    assert lm.damping == 1e-4
    model = torch.nn.Linear(3, 2)
    opt = SecondOrderOptimizer(model, approx="kfac", damping=1e-2, adaptive_damping=True)
    assert opt.lm.min_damping == 1e-4
    opt = SecondOrderOptimizer(model, approx="kfac", damping=1e-2, adaptive_damping=True, min_damping=1e-8)
    assert opt.lm.min_damping == 1e-8



def test_an_initial_damping_below_the_bound_is_refused():
    """It sat below the bound (the floor applies to decreases) and a good step raised it to the bound."""
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"damping=1e-05 is below min_damping=0\.0001"):
        SecondOrderOptimizer(model, damping=1e-5, adaptive_damping=True)
    SecondOrderOptimizer(model, damping=1e-5, adaptive_damping=True, min_damping=1e-6)  # the fix it names
    SecondOrderOptimizer(model, damping=1e-5)  # no rule, no bound


def test_an_initial_damping_above_the_rules_cap_is_refused():
    """The rule keeps the damping within [min_damping, 1e4]: from 1e6 it could only fall by the decay per
    adjustment, the damping setter refused the value the optimizer held, and a checkpoint of it loaded clamped
    to 1e4 (a resume 5.5e-5 off the run). The cap itself is accepted; without the rule any damping is."""
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"damping=1000000\.0 is above 10000, the adaptive damping rule's upper bound"):
        SecondOrderOptimizer(model, damping=1e6, adaptive_damping=True)
    SecondOrderOptimizer(model, damping=1e4, adaptive_damping=True)
    SecondOrderOptimizer(model, damping=1e6)


def test_adaptive_kfac_stays_trained_after_its_loss_reaches_zero():
    """Digits MLP at batch 128, adaptive lr, momentum and damping from 0.01: 97% test accuracy
    after 2 epochs, training loss ~1e-5 after 25. With a bound of 1e-8 the damping reached it
    after about 20 epochs and the steps then grew: at epoch 25 the training loss was 0.4, the
    parameter norm 36 and the test accuracy 95%."""
    torch.set_num_threads(1)
    data = load_data()
    x, y, xt, yt = data["x_train"], data["y_train"], data["x_test"], data["y_test"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = SecondOrderOptimizer(model, approx="kfac", damping=1e-2, adaptive_damping=True,
                               use_adaptive_learning_rate=True, use_adaptive_momentum=True, seed=0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(25):
        perm = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), 128):
            xb, yb = x[perm[i:i + 128]], y[perm[i:i + 128]]

            def closure():
                opt.zero_grad()
                out = model(xb)
                loss = F.cross_entropy(out, yb)
                loss.backward()
                return loss, out

            opt.step(closure)
    with torch.no_grad():
        train_loss = float(F.cross_entropy(model(x), y))
        accuracy = float((model(xt).argmax(1) == yt).float().mean())
        norm = math.sqrt(sum(float(p.pow(2).sum()) for p in model.parameters()))
    assert train_loss < 1e-3 and accuracy >= 0.97 and norm < 25, (train_loss, accuracy, norm)
    assert opt.damping >= 1e-4
    assert opt.num_skipped == 0


@pytest.mark.parametrize("rho,factor", [(-1.0, 2.0), (0.2, 2.0), (0.3, 1.0), (0.4, 1.0), (0.6, 1.0), (0.74, 1.0),
                                        (0.8, 0.5), (0.85, 0.5), (1.2, 0.5)])
def test_lm_thresholds_are_a_quarter_and_three_quarters(rho: float, factor: float) -> None:
    """Martens & Grosse (2015, §6.5) and kfac-jax: λ ← λ/ω below ρ = 1/4, λ ← ω·λ above 3/4, kept between."""
    assert LMDamping(1e-2, decay=0.5).update(-rho, -1.0) == pytest.approx(1e-2 * factor, rel=1e-15)


def test_a_checkpoint_restores_the_damping_not_the_bounds():
    """A checkpoint's min_damping (1e-8) replaced the new optimizer's (1e-4) while it reported 1e-4: the damping
    kept falling below it. The bounds are the optimizer's own; a damping outside them is brought in, warned."""
    model = torch.nn.Linear(3, 2)
    old = SecondOrderOptimizer(model, damping=1e-6, adaptive_damping=True, min_damping=1e-8)
    new = SecondOrderOptimizer(model, damping=1e-2, adaptive_damping=True)
    with pytest.warns(UserWarning, match=r"damping 1e-06 is outside this optimizer's adaptive damping range \[min_damping, 1e4\]"):
        new.load_state_dict(old.state_dict())
    assert new.lm.min_damping == 1e-4 and new.lm.damping == 1e-4 and new.damping == 1e-4
    same = SecondOrderOptimizer(model, damping=1e-2, adaptive_damping=True, min_damping=1e-8)
    same.load_state_dict(old.state_dict())  # the checkpoint's own bounds: as saved
    assert same.lm.damping == 1e-6 and same.lm.min_damping == 1e-8


@pytest.mark.parametrize("bad", [float("nan"), "abc", 0.0])
def test_a_checkpoint_with_a_bad_lm_damping_is_refused_at_load(bad):
    model = torch.nn.Linear(3, 2)
    state = SecondOrderOptimizer(model, damping=1e-2, adaptive_damping=True).state_dict()
    state["torchsso2"]["extra"]["lm"]["damping"] = bad
    opt = SecondOrderOptimizer(model, damping=1e-2, adaptive_damping=True)
    with pytest.raises(ValueError, match=r"\['lm'\]\['damping'\] is .*expected a finite number > 0"):
        opt.load_state_dict(state)
    assert opt.lm.damping == 1e-2
