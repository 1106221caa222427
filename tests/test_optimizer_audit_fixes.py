"""SecondOrderOptimizer / VIOptimizer cases an audit found mishandled: decompositions that fail at
every step, param-group values set by hand or by a scheduler, the seed argument."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.optim.skips import NonFiniteError
from optim_helpers import make_closure


def test_decompositions_failing_at_every_step_end_in_the_stall_error(caplog: pytest.LogCaptureFixture) -> None:
    """An indefinite Hessian with too little damping has no decomposition to fall back on: every
    step leaves the parameters, so max_consecutive_skips ends it (it did not count such steps),
    and the warning is thinned out like other skips and does not suggest float64 to a float64 model."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 8, dtype=torch.float64), torch.randn(32, 1, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    opt = SecondOrderOptimizer(model, lr=0.05, loss="mse", curvature="hessian", approx="full",
                               max_consecutive_skips=5)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = 0.5 * ((out - y) ** 2).sum(1).mean()
        loss.backward()
        return loss, out

    before = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.WARNING, logger="torchsso2"), \
            pytest.raises(NonFiniteError, match="5 consecutive steps were skipped.*failed decomposition"):
        for _ in range(10):
            opt.step(closure, targets=y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    failed = [r.getMessage() for r in caplog.records if "decomposition failed" in r.getMessage()]
    assert len(failed) == 3  # skips 1, 2, 5
    assert all("float64" not in m and "increase damping" in m for m in failed)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("face", ["sso", "vi"])
@pytest.mark.parametrize("key, value, error", [("lr", -1.0, ValueError), ("lr", "a", TypeError),
                                               ("momentum", 1.5, ValueError), ("weight_decay", -1.0, ValueError),
                                               ("lr", float("nan"), ValueError)])
def test_param_group_values_are_checked(face: str, key: str, value, error) -> None:
    model = _model()
    make = (lambda params: SecondOrderOptimizer(model, lr=0.05, params=params)) if face == "sso" else \
        (lambda params: VIOptimizer(model, dataset_size=50, lr=0.01, params=params))
    groups = [{"params": list(model[0].parameters()), key: value}, {"params": list(model[2].parameters())}]
    with pytest.raises(error, match=key):
        make(groups)
    opt = make([{"params": list(model[0].parameters())}])
    with pytest.raises(error, match=key):
        opt.add_param_group({"params": list(model[2].parameters()), key: value})


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_a_scheduler_setting_a_bad_lr_is_refused_before_the_update(face: str) -> None:
    model = _model()
    opt = SecondOrderOptimizer(model, lr=0.05) if face == "sso" else VIOptimizer(model, dataset_size=50, lr=0.01)
    closure = make_closure(opt, model, torch.randn(16, 4), torch.randint(0, 3, (16,)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch == 0 else float("nan"))
    opt.step(closure)
    sched.step()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\]"):
        opt.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("seed, error", [("a", TypeError), (1.7, TypeError), (-1, ValueError), (2 ** 70, ValueError)])
def test_seed_is_checked(seed, error) -> None:
    with pytest.raises(error, match="seed"):
        SecondOrderOptimizer(_model(), seed=seed)
    with pytest.raises(error, match="seed"):
        VIOptimizer(_model(), dataset_size=50, seed=seed)


def test_numpy_integers_are_integers() -> None:
    opt = VIOptimizer(_model(), dataset_size=np.int64(100), seed=np.int64(3))
    assert opt.seed == 3


def test_an_unsupported_conv_is_named_with_the_skip_that_leaves_it_out() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Sequential(nn.ReLU(), nn.Conv2d(2, 2, 3, padding_mode="reflect")),
                          nn.Flatten(), nn.Linear(2 * 2 * 2, 3))
    with pytest.raises(ValueError, match=r"module '1\.1' \(Conv2d\): Conv2d with padding_mode='reflect'") as info:
        SecondOrderOptimizer(model)
    skip = str(info.value).split("skip_modules=[")[1].split("]")[0]
    opt = SecondOrderOptimizer(model, skip_modules=[eval(skip)])  # the suggested skip works as written
    assert "1.1" not in opt.engine.layouts and "0" in opt.engine.layouts


@pytest.mark.parametrize("approx", ["diag", "kfac"])
@pytest.mark.parametrize("form", ["list", "generator", "groups"])
def test_parameters_outside_params_are_neither_sampled_nor_covered(approx: str, form: str) -> None:
    """``params=`` a subset (a Bayesian first layer): the other layers keep their weights, in the
    closure's forward, in ``sampled_params`` and in ``predict`` (they were sampled, never updated)."""
    model = _model()
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    first = list(model[0].parameters())
    params = {"list": first, "generator": iter(first), "groups": [{"params": iter(first), "lr": 0.01}]}[form]
    opt = VIOptimizer(model, dataset_size=50, approx=approx, params=params)
    assert list(opt.engine.layouts) == ["0"]
    head = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("2.")}
    seen: list = []
    closure = make_closure(opt, model, x, y, record=seen)
    first_before = [p.detach().clone() for p in first]
    for _ in range(3):
        opt.step(closure)
    assert all(torch.equal(s[n], v) for s in seen for n, v in head.items())
    assert not all(torch.equal(a, b) for a, b in zip(first, first_before))
    with opt.sampled_params():
        assert all(torch.equal(a, b) for a, b in zip(model[2].parameters(), head.values()))
    other = _model()
    assert list(SecondOrderOptimizer(other, params=other[2].parameters()).engine.layouts) == ["2"]


@pytest.mark.parametrize("approx, curvature", [("diag", None), ("diag", "fisher_mc"), ("kfac", None)])
def test_an_embedding_padding_row_is_not_sampled(approx: str, curvature) -> None:
    """torch keeps ``padding_idx``'s row fixed (no gradient); the posterior leaves it alone too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4, padding_idx=0), nn.Flatten(), nn.Linear(12, 3))
    x, y = torch.randint(0, 6, (16, 3)), torch.randint(0, 3, (16,))
    kw = {} if curvature is None else {"curvature": curvature}
    opt = VIOptimizer(model, dataset_size=50, approx=approx, **kw)
    row = model[0].weight[0].detach().clone()
    seen: list = []
    closure = make_closure(opt, model, x, y, record=seen)
    for _ in range(4):
        opt.step(closure)
    assert all(torch.equal(s["0.weight"][0], row) for s in seen)
    rest = model[0].weight[1:].detach().clone()
    with opt.sampled_params():
        assert torch.equal(model[0].weight[0], row)
        assert not torch.equal(model[0].weight[1:], rest)  # the other rows are sampled


class _WithToken(nn.Module):
    """A container holding parameters itself (a ViT's cls token, a learned temperature)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)
        self.token = nn.Parameter(torch.zeros(4))
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.token) * self.scale


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_parameters_of_a_container_take_the_route_the_error_names(face: str) -> None:
    model = _WithToken()
    # (VIOptimizer's default diagonal covers such parameters by their gradients: tests/test_vi_any_module.py)
    make = (lambda **kw: SecondOrderOptimizer(model, lr=0.05, **kw)) if face == "sso" else \
        (lambda **kw: VIOptimizer(model, dataset_size=50, lr=0.01, approx="kfac", **kw))
    with pytest.raises(ValueError, match="holds trainable parameters itself \\(token, scale\\)") as info:
        make()
    assert "n not in {'token', 'scale'}" in str(info.value)
    opt = make(params=[p for n, p in model.named_parameters() if n not in {'token', 'scale'}])
    opt.add_param_group({"params": [model.token, model.scale]})
    assert list(opt.engine.layouts) == ["fc"]
    closure = make_closure(opt, model, torch.randn(16, 4), torch.randint(0, 3, (16,)))
    token = model.token.detach().clone()
    for _ in range(3):
        opt.step(closure)
    assert not torch.equal(model.token.detach(), token)  # the plain update moves it


def test_skip_modules_as_a_string_or_a_bad_regex_is_named() -> None:
    """A string was split into characters, each a regex ('fc' skipped 'encoder' through its 'c')."""
    with pytest.raises(TypeError, match=r"got the string 'fc'; pass skip_modules=\['fc'\]"):
        SecondOrderOptimizer(_model(), skip_modules="fc")
    with pytest.raises(ValueError, match=r"skip_modules entry '\*x' is not a valid regular expression"):
        SecondOrderOptimizer(_model(), skip_modules=["*x"])
    with pytest.raises(ValueError, match=r"left after skip_modules=\['0', '2'\]"):
        SecondOrderOptimizer(_model(), skip_modules=["0", "2"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_probabilities_are_accepted_by_the_metrics(dtype) -> None:
    from torchsso2 import metrics
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(256, 10) * 3, dim=1).to(dtype)
    labels = torch.randint(0, 10, (256,))
    assert abs(metrics.ece(probs, labels) - metrics.ece(probs.float() / probs.float().sum(1, keepdim=True),
                                                        labels)) < 0.02
    with pytest.raises(ValueError, match="not logits"):
        metrics.ece(torch.rand(8, 10).to(dtype), torch.randint(0, 10, (8,)))  # positive, rows far from 1


def test_vi_decompositions_that_keep_failing_count_once_per_step_and_predict_says_why() -> None:
    """An indefinite diagonal Hessian without damping: every decomposition fails. A step counts one
    skip (a retry at the start of every step had counted two), and predict names the cause instead
    of "before the first step"."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(64, 4))
    x, y = torch.randn(12, 2, 8, 8), torch.randint(0, 4, (12,))
    opt = VIOptimizer(model, dataset_size=100, curvature="hessian", approx="diag", curvature_init=None,
                      prior_variance=1.0, damping=0.0)
    for step in range(3):
        opt.step(make_closure(opt, model, x, y), targets=y)
        assert opt.num_skipped == step + 1
    with pytest.raises(RuntimeError, match="none of whose decompositions of the posterior precision succeeded"):
        opt.predict(x, num_samples=4)
