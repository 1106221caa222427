"""A skipped step is a no-op (issue 28 items 4 and 8, issue 33 item 6): SecondOrderOptimizer and
VIOptimizer with ``on_nonfinite="skip"``.

* training with a NaN batch inserted (and skipped) equals training without that batch, bit for bit:
  same step count, curvature / decomposition schedule, label sampling (``fisher_mc``) and VI noise;
* BatchNorm running statistics written by the NaN batch's forward are given back;
* after ``max_consecutive_skips`` skipped steps in a row the step raises ``NonFiniteError``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import batch, make_closure, param_vec, tiny_mlp
from test_optim_common import assert_same_state
from torchsso2 import NonFiniteError, SecondOrderOptimizer, VIOptimizer


def _opt(face: str, model: nn.Module, approx: str = "kfac", **kw):
    common = dict(curvature="fisher_mc", approx=approx, ema_decay=0.9, momentum=0.9, curv_update_interval=2,
                  inv_update_interval=3, seed=3)
    common.update(kw)
    if face == "second_order":
        return SecondOrderOptimizer(model, lr=0.05, damping=0.05, **common)
    # init_precision: weight noise from the first step on
    return VIOptimizer(model, dataset_size=100, lr=0.01, prior_precision=1.0, init_precision=50.0, **common)


def _nan_input(x):
    bad = x.clone()
    bad[1, 2] = float("nan")
    return bad


FACES = [("second_order", "kfac"), ("second_order", "diag"), ("vi", "diag"), ("vi", "kfac")]


@pytest.mark.parametrize("face,approx", FACES)
@pytest.mark.parametrize("where", ["input", "gradient"])
@pytest.mark.parametrize("at", [0, 2, 3, 4, 5])
def test_a_skipped_batch_equals_training_without_it(face, approx, where, at):
    """Batches b0..b6; run B inserts a NaN batch before b_at (skipped; curvature every 2 steps,
    decompositions every 3, so the bad step estimates and/or decomposes or neither): same parameters and state
    as run A without it, bit for bit (counter ``num_skipped`` aside)."""
    batches = [batch(n=10, seed=i) for i in range(7)]

    model_a = tiny_mlp(seed=0)
    opt_a = _opt(face, model_a, approx)
    for x, y in batches:
        opt_a.step(make_closure(opt_a, model_a, x, y))

    model_b = tiny_mlp(seed=0)
    opt_b = _opt(face, model_b, approx)
    for i, (x, y) in enumerate(batches):
        if i == at:
            if where == "input":
                bad = make_closure(opt_b, model_b, _nan_input(x), y)
            else:
                def poison() -> None:
                    model_b.fc2.weight.grad[0, 0] = float("inf")
                bad = make_closure(opt_b, model_b, x, y, after_backward=poison)
            steps = opt_b.num_steps
            opt_b.step(bad)
            assert opt_b.num_skipped == 1 and opt_b.num_steps == steps
        opt_b.step(make_closure(opt_b, model_b, x, y))
    assert torch.equal(param_vec(model_b), param_vec(model_a))
    assert opt_b.num_steps == opt_a.num_steps == len(batches)
    assert_same_state(opt_b.state_dict(), opt_a.state_dict(), ignore=("num_skipped", "consecutive_skips"))


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


@pytest.mark.parametrize("face", ["second_order", "vi"])
def test_batchnorm_running_statistics_are_restored_on_skip(face):
    torch.manual_seed(0)
    model = BNNet().double()
    opt = _opt(face, model, approx="diag")
    x, y = batch(n=10, seed=0)
    for _ in range(2):
        opt.step(make_closure(opt, model, x, y))
    before = {k: v.clone() for k, v in model.bn.state_dict().items()}
    opt.step(make_closure(opt, model, _nan_input(x), y))
    assert opt.num_skipped == 1
    for k, v in model.bn.state_dict().items():
        assert torch.equal(v, before[k]), k
    # a finite step afterwards moves them as usual
    opt.step(make_closure(opt, model, x, y))
    assert torch.isfinite(model.bn.running_mean).all()
    assert int(model.bn.num_batches_tracked) == int(before["num_batches_tracked"]) + 1
    model.eval()
    assert torch.isfinite(model(x)).all()


@pytest.mark.parametrize("face", ["second_order", "vi"])
def test_a_stall_raises_after_max_consecutive_skips(face):
    """Default bound 20: 19 skips in a row are tolerated, the 20th raises with what diverged and
    what to try; a finite step ends the streak; the state is the one before the first skip."""
    model, (x, y) = tiny_mlp(), batch()
    opt = _opt(face, model)
    assert opt.max_consecutive_skips == 20
    opt.step(make_closure(opt, model, x, y))
    bad = make_closure(opt, model, _nan_input(x), y)
    for _ in range(19):
        opt.step(bad)
    opt.step(make_closure(opt, model, x, y))  # ends the streak
    before = param_vec(model)
    for _ in range(19):
        opt.step(bad)
    with pytest.raises(NonFiniteError, match="20 consecutive steps") as err:
        opt.step(bad)
    msg = str(err.value)
    assert "lower lr" in msg and "damping" in msg and "max_consecutive_skips" in msg
    assert "the loss" in msg and "model output" in msg
    assert torch.equal(param_vec(model), before) and opt.num_steps == 2 and opt.num_skipped == 39


@pytest.mark.parametrize("face", ["second_order", "vi"])
def test_max_consecutive_skips_is_configurable(face):
    model, (x, y) = tiny_mlp(), batch()
    opt = _opt(face, model, max_consecutive_skips=3)
    opt.step(make_closure(opt, model, x, y))

    def inf_grad() -> None:
        model.fc1.weight.grad[1, 1] = float("inf")
    bad = make_closure(opt, model, x, y, after_backward=inf_grad)
    opt.step(bad)
    opt.step(bad)
    with pytest.raises(NonFiniteError, match=r"3 consecutive steps.*gradients of fc1.weight"):
        opt.step(bad)
    never = _opt(face, tiny_mlp(), max_consecutive_skips=None)
    for _ in range(25):
        never.step(make_closure(never, never.model, _nan_input(x), y))
    assert never.num_skipped == 25 and never.num_steps == 0
    for value, exc in [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)]:
        with pytest.raises(exc, match="max_consecutive_skips"):
            _opt(face, tiny_mlp(), max_consecutive_skips=value)


def test_skip_keeps_the_label_stream_of_fisher_mc():
    """The control: the sampled labels matter (another generator state gives another trajectory),
    so the equality above holds because the skipped step gave the generator back."""
    model_a, model_b = tiny_mlp(seed=0), tiny_mlp(seed=0)
    opt_a, opt_b = _opt("second_order", model_a, "diag"), _opt("second_order", model_b, "diag")
    x, y = batch(n=10, seed=0)
    opt_b.generator.manual_seed(999)
    for _ in range(3):
        opt_a.step(make_closure(opt_a, model_a, x, y))
        opt_b.step(make_closure(opt_b, model_b, x, y))
    assert not torch.equal(param_vec(model_a), param_vec(model_b))
    assert F.cross_entropy(model_a(x), y).isfinite()


def test_one_step_call_counts_at_most_one_skip():
    """A failed decomposition (indefinite Hessian; the old decomposition serves) followed by an adaptive
    quadratic model that is not positive definite (the step skipped) added 2 to num_skipped in one call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    opt = SecondOrderOptimizer(model, curvature="hessian", approx="diag", damping=0.2, ema_decay=0.0,
                               use_adaptive_learning_rate=True, use_adaptive_momentum=True)
    g = torch.Generator().manual_seed(0)
    increments = []
    for _ in range(12):
        x = 2 * torch.randn(8, 4, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=g)
        before = opt.num_skipped
        opt.step(make_closure(opt, model, x, y), targets=y)
        increments.append(opt.num_skipped - before)
    assert max(increments) == 1 and sum(increments) >= 3, increments  # skips happened, one per call at most


def _indefinite_case(damping=0.2, **kw):
    """The Hessian of a tanh MLP with a small damping: adaptive mode's quadratic model has negative curvature
    along some steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    opt = SecondOrderOptimizer(model, curvature="hessian", approx="diag", damping=damping, ema_decay=0.0,
                               use_adaptive_learning_rate=True, use_adaptive_momentum=True, **kw)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(12):
        x = 2 * torch.randn(8, 4, generator=g, dtype=torch.float64)
        batches.append((x, torch.randint(0, 3, (8,), generator=g)))
    return model, opt, batches


@pytest.mark.parametrize("adaptive_damping", [False, True])
def test_a_quadratic_model_without_minimum_is_skipped_under_its_own_name(adaptive_damping, caplog):
    """Negative curvature along the step is no non-finite value: the skip says so (and names the ways out), and
    with ``adaptive_damping`` the damping is raised as after a failed step, which the skip keeps. (With the rule,
    the damping 0.2 fails the diagonal's decomposition at the second step and is raised past its shortfall,
    after which this case's model has a minimum at every step: it starts at 1.5, where the diagonal
    decomposes and the model along one step still has none.)"""
    model, opt, batches = _indefinite_case(damping=1.5 if adaptive_damping else 0.2, adaptive_damping=adaptive_damping)
    seen = False
    for x, y in batches:
        before, damping = opt.num_skipped, opt.damping
        caplog.clear()
        with caplog.at_level("DEBUG", logger="torchsso2"):
            opt.step(make_closure(opt, model, x, y), targets=y)
        if opt.num_skipped > before and "has no minimum" in caplog.text:
            seen = True
            assert "non-finite" not in caplog.text
            assert "take a Fisher kind" in caplog.text
            assert (opt.damping > damping) is adaptive_damping
    assert seen


def test_a_step_failing_for_a_named_reason_raises_with_it():
    """Under ``on_nonfinite="raise"`` a skip with a reason (no minimum of the quadratic model) raises with that
    reason, not as a non-finite value."""
    _, opt, _ = _indefinite_case(on_nonfinite="raise")
    with pytest.raises(NonFiniteError, match=r"^the reason at step 0; the optimizer state is unchanged$"):
        opt._nonfinite("preconditioned update", reason="the reason")


def test_a_streak_of_steps_without_minimum_stalls_under_its_own_name():
    model, opt, batches = _indefinite_case(max_consecutive_skips=1)
    with pytest.raises(NonFiniteError, match=r"consecutive steps were skipped at step \d+: the adaptive step's "
                                             r"quadratic model has no minimum"):
        for x, y in batches:
            opt.step(make_closure(opt, model, x, y), targets=y)


def test_a_non_finite_quadratic_model_is_a_non_finite_skip_not_a_missing_minimum(caplog):
    """A NaN gradient at a step that neither estimates nor decomposes (its gradients are not checked there)
    reaches the quadratic model as NaN entries, which fail its positive-definiteness test too: that is a
    non-finite step, and the damping stays."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = SecondOrderOptimizer(model, curvature="fisher", approx="kfac", curv_update_interval=2, inv_update_interval=2,
                               use_adaptive_learning_rate=True, use_adaptive_momentum=True, adaptive_damping=True)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    opt.step(make_closure(opt, model, x, y), targets=y)

    def poisoned():
        loss, out = make_closure(opt, model, x, y)()
        model[0].weight.grad[0, 0] = float("nan")
        return loss, out

    damping = opt.damping
    with caplog.at_level("DEBUG", logger="torchsso2"):
        opt.step(poisoned, targets=y)
    assert opt.num_skipped == 1 and opt.damping == damping
    assert "non-finite" in caplog.text and "has no minimum" not in caplog.text


@pytest.mark.parametrize("estimate", [True, False])
def test_a_raise_after_the_curvature_took_the_batch_says_so(monkeypatch, estimate):
    """A non-finite preconditioned update (an overflow in the solve, simulated) at a curvature step: the running
    curvature has taken the batch's finite estimate before it, which the raise-mode error says (it said the state
    was unchanged); at a step without an estimate the state is unchanged."""
    model = tiny_mlp()
    x, y = batch()
    opt = SecondOrderOptimizer(model, on_nonfinite="raise", curv_update_interval=2)
    opt.step(make_closure(opt, model, x, y))  # step 0 estimates; step 1 does not, step 2 does
    if estimate:
        opt.step(make_closure(opt, model, x, y))
    monkeypatch.setattr(SecondOrderOptimizer, "_apply_update", lambda self, params, groups: False)
    updates = opt.running.num_updates
    text = ("the parameters are unchanged \\(the running curvature has taken this batch's estimate\\)" if estimate
            else "the optimizer state is unchanged")
    with pytest.raises(NonFiniteError, match=rf"non-finite preconditioned update at step {1 + estimate}; {text}$"):
        opt.step(make_closure(opt, model, x, y))
    assert opt.running.num_updates == updates + estimate
