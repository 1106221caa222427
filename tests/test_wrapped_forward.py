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


def _train(make, loss: str, redirected: bool, with_targets: bool) -> torch.Tensor:
    lit = _Lit(loss)
    wrapper = _Wrapper(lit)
    opt = make(lit)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(12, 5, generator=g)
        y = torch.randint(0, 3, (12,), generator=g) if loss == "cross_entropy" else torch.randn(12, 3, generator=g)

        def closure():
            opt.zero_grad()
            value = redirect(wrapper, lit, "training_step", (x, y)) if redirected else nll(loss, lit(x), y)
            value.backward()
            return value
        opt.step(closure, **({"targets": y} if with_targets else {}))
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
