"""A model whose forward runs inside a wrapper's call of the same module (PyTorch Lightning's forward
redirection under its DDP / FSDP / DeepSpeed strategies).

The strategy patches the LightningModule's ``forward`` to run ``training_step`` and calls the wrapper
(DDP), which calls the module; ``training_step`` calls the module again (``self(x)``). The module's
forward hooks fire twice per batch: the inner call's output is the model's, the outer call's is the
loss. The optimizers built on that module must take the steps of the plain loop, where the closure
calls ``model(x)`` once (curvature/root_calls.py). Here the redirection is written out as Lightning's
``_ForwardRedirection`` does it, with a plain wrapper module standing in for DDP, in one process.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict

import pytest
import torch
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer

from optim_helpers import nll, param_vec


class _Lit(nn.Module):
    """A LightningModule's shape: a network, ``forward`` calling it, ``training_step`` calling ``self``."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        self.loss = loss

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch):
        x, y = batch
        return nll(self.loss, self(x), y)


class _Wrapper(nn.Module):
    """Stands in for DistributedDataParallel: its forward calls the wrapped module."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def redirect(wrapper: nn.Module, module: nn.Module, method: str, *args: Any) -> Any:
    """``module.<method>(*args)`` through ``wrapper``'s forward, as Lightning's ``_ForwardRedirection``:
    ``module.forward`` is patched to run the method (and unpatched as it starts), then ``wrapper`` is called."""
    original = module.forward

    def wrapped_forward(*a: Any) -> Any:
        module.forward = original
        return getattr(module, method)(*a)
    module.forward = wrapped_forward
    try:
        return wrapper(*args)
    finally:
        module.__dict__.pop("forward", None)


CASES: Dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sso-kfac-fisher_mc": lambda m: SecondOrderOptimizer(m, lr=0.1, seed=3),
    "sso-kfac-empirical": lambda m: SecondOrderOptimizer(m, lr=0.1, curvature="empirical_fisher",
                                                         curv_update_interval=2),
    "sso-adaptive": lambda m: SecondOrderOptimizer(m, use_adaptive_learning_rate=True, use_adaptive_momentum=True,
                                                   adaptive_damping=True, damping_adaptation_interval=2, seed=3),
    "vi-diag": lambda m: VIOptimizer(m, dataset_size=100, seed=3),
    "vi-kfac": lambda m: VIOptimizer(m, dataset_size=100, approx="kfac", seed=3),
}


def _steps(opt: torch.optim.Optimizer, loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], loss: str,
           with_targets: bool, steps: int = 5) -> None:
    """``steps`` steps on seeded batches ``x [12, 5]``, ``y`` (labels, or ``[12, 3]`` for mse) with a
    closure returning ``loss_of(x, y)`` alone."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(12, 5, generator=g)
        y = torch.randint(0, 3, (12,), generator=g) if loss == "cross_entropy" else torch.randn(12, 3, generator=g)

        def closure():
            opt.zero_grad()
            value = loss_of(x, y)
            value.backward()
            return value
        opt.step(closure, **({"targets": y} if with_targets else {}))


def _train(make, loss: str, redirected: bool, with_targets: bool) -> torch.Tensor:
    lit = _Lit(loss)
    wrapper = _Wrapper(lit)
    opt = make(lit)
    _steps(opt, lambda x, y: redirect(wrapper, lit, "training_step", (x, y)) if redirected else nll(loss, lit(x), y),
           loss, with_targets)
    return param_vec(lit)


@pytest.mark.parametrize("name, with_targets", [(n, t) for n in sorted(CASES) for t in (False, True)])
def test_a_redirected_forward_takes_the_plain_steps(name, with_targets):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = _train(CASES[name], "cross_entropy", redirected=False, with_targets=with_targets)
        got = _train(CASES[name], "cross_entropy", redirected=True, with_targets=with_targets)
    assert torch.equal(got, ref)


def test_vi_learned_noise_reads_the_inner_forward():
    """The residuals come from the model output (the inner call), not from the loss the outer call returns."""
    def make(m):
        return VIOptimizer(m, dataset_size=100, loss="mse", noise_variance="learned", seed=3)
    ref = _train(make, "mse", redirected=False, with_targets=True)
    got = _train(make, "mse", redirected=True, with_targets=True)
    assert torch.equal(got, ref)


class _SelfCalling(nn.Module):
    """Calls itself inside its own forward: once under no_grad (a probe), or, with ``body``, for its body."""

    def __init__(self, probe: bool = False, body: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3)
        self.probe, self.body = probe, body

    def forward(self, x, head: bool = True):
        if not head:
            return torch.tanh(self.a(x))
        if self.probe:
            with torch.no_grad():
                self.seen = self(x, head=False)  # a no-grad call of itself: not the batch's forward
        return self.b(self(x, head=False) if self.body else torch.tanh(self.a(x)))


def _train_self_calling(make, model: nn.Module, with_targets: bool) -> torch.Tensor:
    _steps(make(model), lambda x, y: nll("cross_entropy", model(x), y), "cross_entropy", with_targets, steps=4)
    return param_vec(model)


@pytest.mark.parametrize("name, with_targets", [(n, t) for n in sorted(CASES) for t in (False, True)])
def test_a_model_calling_itself_is_not_a_wrapper(name, with_targets):
    """Only a call that started with a forward set on the instance (the redirection) is a wrapper's: a
    module calling itself under no_grad trains as without the call, and one calling itself with
    gradients for its body is refused as before (its two forwards do not fit one batch), not read as a
    wrapper around its own body."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = _train_self_calling(CASES[name], _SelfCalling(), with_targets)
        assert torch.equal(_train_self_calling(CASES[name], _SelfCalling(probe=True), with_targets), ref)
        if name == "vi-diag":  # its curvature needs no capture of the forward
            return
        with pytest.raises(ValueError, match="24 examples|not called in the forward pass|one forward per closure"):
            _train_self_calling(CASES[name], _SelfCalling(body=True), with_targets)


@pytest.mark.parametrize("with_targets", [False, True])
def test_adaptive_mode_does_not_replay_a_forward_that_raised(with_targets):
    """A closure that catches a failed forward of the model, then runs the batch: the quadratic model
    replays the completed forward only."""
    class Picky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3)

        def forward(self, x):
            if x.shape[-1] != 5:
                raise ValueError("bad input")
            return self.b(torch.tanh(self.a(x)))

    results = []
    for try_bad_first in (False, True):
        model = Picky()
        opt = CASES["sso-adaptive"](model)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(12, 5, generator=g), torch.randint(0, 3, (12,), generator=g)

            def closure():
                opt.zero_grad()
                if try_bad_first:
                    with pytest.raises(ValueError, match="bad input"):
                        model(torch.randn(12, 4))
                loss = nll("cross_entropy", model(x), y)
                loss.backward()
                return loss
            opt.step(closure, **({"targets": y} if with_targets else {}))
        results.append(param_vec(model))
    assert torch.equal(results[0], results[1])
