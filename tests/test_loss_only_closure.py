"""Closures that return the loss alone (torch.optim's convention), on SecondOrderOptimizer and VIOptimizer.

A closure may return ``(loss, output)`` or only the loss; ``step`` returns what the closure returned.
The steps must be the same either way: the curvature is captured from the model's forward, and where
a step reads the output itself (VI's learned noise, its first-step output check, the adaptive mode's
loss check and LM forward) it is taken from the closure's forward (torchsso2/optim/closure_output.py).
Each case trains two copies of one model from one seed, one with each form of closure, and compares
the parameters bit for bit.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Dict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer

from optim_helpers import nll, param_vec


def _mlp(out: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, out))


def _batches(loss: str, out: int = 3, steps: int = 5):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(12, 5, generator=g)
        y = torch.randint(0, out, (12,), generator=g) if loss == "cross_entropy" else torch.randn(12, out, generator=g)
        yield x, y


def _closure(opt: torch.optim.Optimizer, model: nn.Module, x, y, loss: str, loss_only: bool,
             extra_nograd_forward: bool = False) -> Callable[[], Any]:
    def closure():
        opt.zero_grad()
        out = model(x)
        val = nll(loss, out, y)
        val.backward()
        if extra_nograd_forward:  # a metric on another batch, not the loss's forward
            with torch.no_grad():
                model(torch.zeros(3, x.shape[1]))
        return val if loss_only else (val, out)
    return closure


CASES: Dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sso-kfac-fisher_mc": lambda m: SecondOrderOptimizer(m, lr=0.1, curv_update_interval=2, inv_update_interval=2,
                                                         seed=3),
    "sso-diag-empirical": lambda m: SecondOrderOptimizer(m, lr=0.1, approx="diag", curvature="empirical_fisher"),
    "sso-full-fisher": lambda m: SecondOrderOptimizer(m, lr=0.1, approx="full", curvature="fisher"),
    "sso-hessian-diag": lambda m: SecondOrderOptimizer(m, lr=0.05, approx="diag", curvature="hessian", damping=1.0),
    "sso-adaptive": lambda m: SecondOrderOptimizer(m, use_adaptive_learning_rate=True, use_adaptive_momentum=True,
                                                   adaptive_damping=True, damping_adaptation_interval=2, seed=3),
    "vi-diag": lambda m: VIOptimizer(m, dataset_size=100, seed=3),
    "vi-diag-2-samples": lambda m: VIOptimizer(m, dataset_size=100, num_mc_samples=2, seed=3),
    "vi-kfac": lambda m: VIOptimizer(m, dataset_size=100, approx="kfac", curv_update_interval=2, seed=3),
}


def _train(make: Callable[[nn.Module], torch.optim.Optimizer], loss: str, loss_only: bool, with_targets: bool,
           extra_nograd_forward: bool = False):
    model = _mlp()
    opt = make(model)
    returned = []
    for x, y in _batches(loss):
        result = opt.step(_closure(opt, model, x, y, loss, loss_only, extra_nograd_forward),
                          **({"targets": y} if with_targets else {}))
        returned.append(result)
    return param_vec(model), returned, opt


@pytest.mark.parametrize("name, with_targets", [(n, t) for n in sorted(CASES) for t in (False, True)
                                                 if t or n != "sso-hessian-diag"])  # the Hessian needs targets
def test_loss_only_closure_takes_the_same_steps(name, with_targets):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same warnings (if any) for both forms
        ref, pairs, _ = _train(CASES[name], "cross_entropy", loss_only=False, with_targets=with_targets)
        got, losses, _ = _train(CASES[name], "cross_entropy", loss_only=True, with_targets=with_targets)
    assert torch.equal(got, ref)
    assert not torch.equal(ref, param_vec(_mlp())), "the steps moved the parameters"
    for pair, loss in zip(pairs, losses):  # step returns what the closure returned
        assert isinstance(pair, tuple) and len(pair) == 2 and pair[1].shape == (12, 3)
        assert isinstance(loss, torch.Tensor) and loss.shape == () and torch.equal(loss, pair[0])


def test_vi_learned_noise_reads_the_closures_forward():
    """noise_variance='learned' takes each sample's residuals from the output of the closure's forward
    (a later no-grad forward in the closure is not it)."""
    def make(m):
        return VIOptimizer(m, dataset_size=100, loss="mse", noise_variance="learned", seed=3)
    ref, _, opt_ref = _train(make, "mse", loss_only=False, with_targets=True)
    got, losses, opt = _train(make, "mse", loss_only=True, with_targets=True, extra_nograd_forward=True)
    assert torch.equal(got, ref)
    assert opt.noise.variance == opt_ref.noise.variance and opt.noise.variance != 1.0
    assert all(isinstance(v, torch.Tensor) for v in losses)


def test_vi_learned_noise_without_a_forward_of_the_model_is_a_clear_error():
    model = _mlp()
    opt = VIOptimizer(model, dataset_size=100, loss="mse", noise_variance="learned")
    x, y = torch.randn(6, 5), torch.randn(6, 3)

    def around_the_root():  # runs the children, not the model the optimizer was built with
        opt.zero_grad()
        loss = nll("mse", model[2](model[1](model[0](x))), y)
        loss.backward()
        return loss
    opt.step(_closure(opt, model, x, y, "mse", loss_only=True), targets=y)  # the first step checks the output
    with pytest.raises(ValueError, match=r"returned the loss alone without running the optimizer's model.*"
                                         r"return \(loss, output\)"):
        opt.step(around_the_root, targets=y)


class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x):
        return {"logits": self.net(x)}


@pytest.mark.parametrize("loss_only", [False, True])
def test_vi_first_step_checks_a_dict_output_either_way(loss_only):
    """A dict-returning model without output_selector fails at the first step, not at predict."""
    model = _DictOut()
    opt = VIOptimizer(model, dataset_size=100)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out["logits"], y)
        loss.backward()
        return loss if loss_only else (loss, out)
    with pytest.raises(TypeError, match="output_selector"):
        opt.step(closure)


@pytest.mark.parametrize("make", [lambda m: SecondOrderOptimizer(m, lr=0.1), lambda m: VIOptimizer(m, dataset_size=10)],
                         ids=["second_order", "vi"])
@pytest.mark.parametrize("returned, error, match", [
    (None, TypeError, r"must return the loss \(a tensor of one element\), or \(loss, output\).*got None"),
    ("loss", TypeError, r"must return the loss.*got str"),
    ((1.0, 2.0, 3.0), TypeError, r"must return the loss, or \(loss, output\).*tuple of 3 items"),
    ("per-example", ValueError, r"single number.*shape \[6\]; return the mean loss of the batch"),
])
def test_what_a_closure_may_return(make, returned, error, match):
    model = _mlp()
    opt = make(model)
    before = param_vec(model)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))

    def closure():
        opt.zero_grad()
        per = F.cross_entropy(model(x), y, reduction="none")
        per.mean().backward()
        return per if returned == "per-example" else returned
    with pytest.raises(error, match=match):
        opt.step(closure)
    assert torch.equal(param_vec(model), before)


@pytest.mark.parametrize("make", [lambda ps, m: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps, m: SecondOrderOptimizer(m, lr=0.1),
                                  lambda ps, m: VIOptimizer(m, dataset_size=100, lr=0.1)],
                         ids=["torch-sgd", "second_order", "vi"])
def test_a_torch_optim_loop_runs_unchanged(make):
    """A loop written for torch.optim (closure returning the loss, ``loss = opt.step(closure)``,
    ``loss.item()``) trains with either optimizer, as with SGD."""
    model = _mlp()
    opt = make(model.parameters(), model)
    x, y = next(_batches("cross_entropy"))

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss
    first = opt.step(closure).item()
    for _ in range(30):
        last = opt.step(closure).item()
    assert last < 0.5 * first


def test_a_closure_may_switch_form_between_steps():
    """Each step returns what its own closure returned."""
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.1)
    x, y = next(_batches("cross_entropy"))
    a = opt.step(_closure(opt, model, x, y, "cross_entropy", loss_only=True))
    b = opt.step(_closure(opt, model, x, y, "cross_entropy", loss_only=False))
    c = opt.step(_closure(opt, model, x, y, "cross_entropy", loss_only=True))
    assert isinstance(a, torch.Tensor) and isinstance(b, tuple) and isinstance(c, torch.Tensor)


def test_deepcopy_and_checkpoint_after_loss_only_steps():
    """The form of the last closure is not state: a copy and a resumed optimizer step alike."""
    model = _mlp()
    opt = VIOptimizer(model, dataset_size=100, seed=1)
    batches = list(_batches("cross_entropy", steps=4))
    for x, y in batches[:2]:
        opt.step(_closure(opt, model, x, y, "cross_entropy", loss_only=True))
    model2, opt2 = copy.deepcopy((model, opt))
    model3 = _mlp()
    model3.load_state_dict(model.state_dict())
    opt3 = VIOptimizer(model3, dataset_size=100, seed=1)
    opt3.load_state_dict(opt.state_dict())
    for x, y in batches[2:]:
        r1 = opt.step(_closure(opt, model, x, y, "cross_entropy", loss_only=True))
        r2 = opt2.step(_closure(opt2, model2, x, y, "cross_entropy", loss_only=False))
        r3 = opt3.step(_closure(opt3, model3, x, y, "cross_entropy", loss_only=True))
        assert torch.equal(r1, r2[0]) and torch.equal(r1, r3)
    assert torch.equal(param_vec(model), param_vec(model2)) and torch.equal(param_vec(model), param_vec(model3))


EMPTY_CASES = {
    "vi-diag": lambda m: VIOptimizer(m, dataset_size=100, seed=1),  # its steps estimate no captured curvature
    "vi-kfac-interval-2": lambda m: VIOptimizer(m, dataset_size=100, approx="kfac", curv_update_interval=2, seed=1),
    "sso-interval-2": lambda m: SecondOrderOptimizer(m, lr=0.1, curv_update_interval=2, seed=1),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", sorted(EMPTY_CASES))
def test_an_empty_batch_is_a_clear_error_on_steps_that_estimate_nothing(name, reduction):
    """An empty batch is the ValueError of a (loss, output) closure, also at steps without a curvature
    estimate (where nothing else sees the forward): not a skipped step (mean: NaN) nor a step taken (sum: 0)."""
    model = _mlp()
    opt = EMPTY_CASES[name](model)
    x, y = next(_batches("cross_entropy"))

    def closure(n):
        opt.zero_grad()
        loss = F.cross_entropy(model(x[:n]), y[:n], reduction=reduction)
        loss.backward()
        return loss
    opt.step(lambda: closure(12))  # step 0 estimates; step 1 does not
    before = param_vec(model)
    with pytest.raises(ValueError, match=r"empty batch \(output of shape \[0, 3\]\).*drop_last=True"):
        opt.step(lambda: closure(0))
    assert torch.equal(param_vec(model), before) and opt.num_steps == 1 and opt.num_skipped == 0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_an_empty_batch_at_the_first_call_after_a_resume_is_a_clear_error(reduction):
    """A fresh optimizer that loaded a checkpoint (its next step estimates nothing) checks the first
    call's output too."""
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.1, curv_update_interval=2, seed=1)
    x, y = next(_batches("cross_entropy"))
    opt.step(_closure(opt, model, x, y, "cross_entropy", loss_only=True))
    resumed = SecondOrderOptimizer(model, lr=0.1, curv_update_interval=2, seed=1)
    resumed.load_state_dict(opt.state_dict())
    before = param_vec(model)

    def closure():
        resumed.zero_grad()
        loss = F.cross_entropy(model(x[:0]), y[:0], reduction=reduction)
        loss.backward()
        return loss
    with pytest.raises(ValueError, match=r"empty batch \(output of shape \[0, 3\]\)"):
        resumed.step(closure)
    assert torch.equal(param_vec(model), before) and resumed.num_steps == 1


@pytest.mark.parametrize("make", [lambda m: SecondOrderOptimizer(m, lr=0.1), lambda m: VIOptimizer(m, dataset_size=10)],
                         ids=["second_order", "vi"])
@pytest.mark.parametrize("backward", [True, False], ids=["forgotten-return", "lightning-skip"])
def test_a_closure_returning_none_is_an_error(make, backward):
    """A forgotten ``return loss``, and Lightning's skipped batch (its closure zeroes the gradients, runs
    no backward and returns None), are a TypeError that says which; nothing changes."""
    model = _mlp()
    opt = make(model)
    x, y = next(_batches("cross_entropy"))
    opt.step(_closure(opt, model, x, y, "cross_entropy", loss_only=True))
    before = param_vec(model)

    def closure():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        if backward:
            loss.backward()
    with pytest.raises(TypeError, match=r"must return the loss .*got None \(a closure without `return loss`; "
                                        r"PyTorch Lightning's training_step returning None .* not supported"):
        opt.step(closure)
    assert opt.num_steps == 1 and opt.num_skipped == 0 and torch.equal(param_vec(model), before)


def test_the_loss_check_warning_points_at_the_users_step_call():
    """The warning about a loss that is not a function of softmax(output) names the line calling step
    (not a frame of the library or of torch's step wrapper)."""
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.1)
    x, y = next(_batches("cross_entropy"))

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), F.one_hot(y, 3).float())
        loss.backward()
        return loss
    with pytest.warns(UserWarning, match="not a function of softmax") as record:
        opt.step(closure)
    ours = [w for w in record if "softmax" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__


@pytest.mark.parametrize("name", ["sso-adaptive", "vi-diag", "vi-kfac"])
def test_a_pair_closure_pays_the_output_hook_at_its_first_call_only(name):
    """The output tap is registered at the first call and after a loss-alone call: a closure returning
    (loss, output) runs without it from the second call on."""
    model = _mlp()
    opt = CASES[name](model)
    hooks_seen = {}  # step -> taps during its first closure call (the LM rule may call it again)
    for i, (x, y) in enumerate(_batches("cross_entropy", steps=5)):
        def closure(x=x, y=y, i=i, loss_only=(i == 3)):
            hooks_seen.setdefault(i, sum("OutputTap" in h.__qualname__ for h in model._forward_hooks.values()))
            opt.zero_grad()
            out = model(x)
            val = nll("cross_entropy", out, y)
            val.backward()
            return val if loss_only else (val, out)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step(closure, targets=y)
    # the first call, then after pair-returning calls, then the loss-alone call, then the call after it
    assert list(hooks_seen.values()) == [1, 0, 0, 0, 1]


def test_a_closure_changing_form_on_a_learned_noise_step_is_a_clear_error():
    """The output of a loss-alone call right after pair-returning ones is not recorded: VI's learned
    noise says to return (loss, output)."""
    model = _mlp()
    opt = VIOptimizer(model, dataset_size=100, loss="mse", noise_variance="learned", seed=1)
    batches = list(_batches("mse", steps=2))
    x, y = batches[0]
    opt.step(_closure(opt, model, x, y, "mse", loss_only=False), targets=y)
    x, y = batches[1]
    with pytest.raises(ValueError, match=r"return \(loss, output\)"):
        opt.step(_closure(opt, model, x, y, "mse", loss_only=True), targets=y)
    assert opt.num_steps == 1
    opt.step(_closure(opt, model, x, y, "mse", loss_only=True), targets=y)  # the form is known now
    assert opt.num_steps == 2
