"""GradScaler misuse with SecondOrderOptimizer / VIOptimizer: a step without ``scaler.update()`` after the
last one is an error (the gradients would stay scaled, 65536× too large, silently); a closure that
unscales under ``adaptive_damping`` (whose second closure call cannot unscale again) is refused at its
first step, before anything changed."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("face", ["second_order", "vi"])
def test_a_step_without_update_since_the_last_is_refused(face: str) -> None:
    x, y = _data()
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    opt = SecondOrderOptimizer(model, grad_scaler=scaler) if face == "second_order" \
        else VIOptimizer(model, dataset_size=1000, grad_scaler=scaler)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        scaler.scale(loss).backward()
        return loss, out
    opt.step(closure)
    scaler.update()
    opt.step(closure)  # the recipe: update after every step
    before = [p.detach().clone() for p in model.parameters()]
    steps = opt.num_steps
    with pytest.raises(RuntimeError, match=r"without scaler.update\(\)"):
        opt.step(closure)  # update() forgotten
    assert opt.num_steps == steps and all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    scaler.update()
    opt.step(closure)
    assert opt.num_steps == steps + 1


def test_unscaling_closure_with_adaptive_damping_is_refused_at_the_first_step() -> None:
    x, y = _data()
    model = _model()
    scaler = torch.amp.GradScaler("cpu")
    opt = SecondOrderOptimizer(model, grad_scaler=scaler, adaptive_damping=True)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss, out
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="adaptive_damping calls the closure a second time"):
        opt.step(closure)
    assert opt.num_steps == 0 and all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not opt.state_dict()["state"]
