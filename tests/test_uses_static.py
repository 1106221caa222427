"""curvature/uses_static.py: the use check is left out only where it provably passes (a plain
``nn.Sequential`` of torch layers, every layer holding a covered parameter covered, no hooks);
everywhere else it still runs and still raises for a functional tied use."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from torch import nn

from curvature.capture import Capture
from curvature.uses import UseWindows
from curvature.uses_static import uses_stay_inside
import curvature.capture as capture_module
from torchsso2 import SecondOrderOptimizer
from optim_helpers import make_closure


def cnn() -> nn.Sequential:
    return nn.Sequential(nn.Unflatten(1, (1, 6, 6)), nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Sequential(nn.Flatten(), nn.Linear(27, 8)), nn.Tanh(), nn.Linear(8, 4))


def covered(model: nn.Module) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}


def test_plain_sequential_skips_the_check_and_the_full_check_agrees() -> None:
    torch.manual_seed(0)
    model = cnn()
    mods = covered(model)
    assert uses_stay_inside(model, mods)
    assert Capture(mods, root=model, check_uses=True)._uses is None
    windows = UseWindows(mods)  # the check it stands for passes
    handles = windows.attach()
    out = model(torch.randn(5, 36))
    for h in handles:
        h.remove()
    windows.check(out)


class SubSeq(nn.Sequential):
    pass


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


class Sym(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + 0.0


def _hooked() -> nn.Sequential:
    m = cnn()
    m[2].register_forward_hook(lambda mod, i, o: None)
    return m


def _patched_forward() -> nn.Sequential:
    m = cnn()
    m[5].forward = lambda x: torch.tanh(x)  # an instance forward could use any parameter
    return m


def _parametrized() -> nn.Sequential:
    m = cnn()
    parametrize.register_parametrization(m[6], "weight", Sym())
    return m


@pytest.mark.parametrize("make", [
    lambda: SubSeq(*cnn()),
    lambda: nn.Sequential(*cnn()[:6], Scale(), cnn()[6]),
    _hooked, _patched_forward, _parametrized,
], ids=["subclass", "custom-child", "hooked-child", "patched-forward", "parametrized"])
def test_anything_else_keeps_the_check(make) -> None:
    model = make()
    mods = covered(model)
    assert not uses_stay_inside(model, mods)
    assert Capture(mods, root=model, check_uses=True)._uses is not None


def test_a_global_forward_hook_keeps_the_check() -> None:
    model = cnn()
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert not uses_stay_inside(model, covered(model))
    finally:
        handle.remove()
    assert uses_stay_inside(model, covered(model))


def test_a_covered_parameter_held_by_an_uncovered_layer_keeps_the_check_and_raises() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4, bias=False), nn.Linear(4, 3))
    model[2].weight = model[0].weight  # tied, but the second holder is left out of the curvature
    mods = {"0": model[0], "3": model[3]}
    assert not uses_stay_inside(model, mods)
    with pytest.raises(ValueError, match="0.weight"):
        with Capture(mods, root=model, on_output=lambda out: None, check_uses=True):
            model(torch.randn(5, 4))


def test_a_functional_tied_use_in_a_custom_model_still_raises_in_the_optimizer() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(3, 3, bias=False)
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(torch.tanh(self.lin(self.emb(x))), self.emb.weight)

    model = Tied()
    opt = SecondOrderOptimizer(model, approx="kfac", curvature="empirical_fisher", lr=0.1, damping=0.1)
    x, y = torch.randn(6, 3), torch.randint(0, 3, (6,))

    closure = make_closure(opt, model, x, y)

    with pytest.raises(ValueError, match="emb.weight"):
        opt.step(closure)


@pytest.mark.parametrize("curvature", ["empirical_fisher", "fisher_mc"])
def test_training_is_bit_equal_with_and_without_the_check(monkeypatch, curvature: str) -> None:
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 36, generator=data), torch.randint(0, 4, (8,), generator=data)

    def run() -> list:
        torch.manual_seed(0)
        model = cnn()
        opt = SecondOrderOptimizer(model, approx="kfac", curvature=curvature, lr=0.1, damping=0.1,
                                   curv_update_interval=2, inv_update_interval=3, seed=0)
        for _ in range(6):
            closure = make_closure(opt, model, x, y)
            opt.step(closure)
        return [p.detach().clone() for p in model.parameters()]

    skipped = run()
    monkeypatch.setattr(capture_module, "uses_stay_inside", lambda root, modules: False)
    checked = run()
    for a, b in zip(skipped, checked):
        assert torch.equal(a, b)


def test_an_observer_hook_keeps_the_model_plain_and_any_other_hook_does_not() -> None:
    from curvature.uses_static import observer_hook, plain_module
    model = cnn()
    seen = []
    handles = [model.register_forward_pre_hook(observer_hook(lambda m, a: seen.append(a[0].shape))),
               model[1].register_forward_hook(observer_hook(lambda m, a, o: seen.append(o.shape)))]
    assert plain_module(model) and plain_module(model[1])
    assert uses_stay_inside(model, covered(model))
    model(torch.randn(5, 36))
    assert len(seen) == 2
    other = model[1].register_forward_hook(lambda m, a, o: None)  # not marked: it could do anything
    assert not plain_module(model[1]) and not uses_stay_inside(model, covered(model))
    for h in handles + [other]:
        h.remove()


def test_adaptive_mode_records_its_inputs_without_turning_the_use_check_on(monkeypatch) -> None:
    """The adaptive step's input recorder (a forward pre-hook on the model during the closure) is an
    observer: the capture of a plain nn.Sequential still leaves the check out."""
    made = []
    original = Capture.__init__

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Capture, "__init__", init)
    torch.manual_seed(0)
    model = cnn()
    opt = SecondOrderOptimizer(model, approx="kfac", damping=0.1, use_adaptive_learning_rate=True,
                               use_adaptive_momentum=True)
    x, y = torch.randn(8, 36), torch.randint(0, 4, (8,))
    for _ in range(2):
        opt.step(make_closure(opt, model, x, y))
    checked = [c for c in made if c.root is model]
    assert checked and all(c._uses is None for c in checked)
    assert not model._forward_pre_hooks and not model._forward_hooks  # the recorder's hooks are gone after the step


def test_a_parameter_of_the_sequential_itself_keeps_the_check_and_a_missing_bias_does_not() -> None:
    """The modules' own parameters as ``_parameters`` holds them: an entry set to None (a layer
    built with ``bias=False``) is no parameter; one registered on the ``nn.Sequential`` is (its
    forward cannot use it, but a subclass-free model holding one is left to the full check)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 3))
    assert model[0]._parameters["bias"] is None
    assert uses_stay_inside(model, covered(model))
    model.register_parameter("extra", nn.Parameter(torch.zeros(2)))
    assert not uses_stay_inside(model, covered(model))
    del model._parameters["extra"]
    model.register_parameter("unset", None)  # a None entry on the Sequential: still no parameter
    assert uses_stay_inside(model, covered(model))
