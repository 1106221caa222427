"""torch.optim conventions the optimizers keep (found by an audit against torch.optim's behaviour).

* ``copy.deepcopy((model, opt))`` after an LR scheduler wrapped ``opt.step``: the copy steps itself
  (the wrapper of the original is not copied, as with torch.optim's own optimizers).
* pickling the optimizer object is a TypeError naming ``state_dict()``.
* a parameter of a curvature block frozen mid-run (a Linear's bias): the block still preconditions
  the others, ``(C + λI)⁻¹ [g | 0]``; VIOptimizer does not sample the frozen parameter.
* VIOptimizer has no weight decay: a non-zero group ``weight_decay`` is a ValueError naming
  ``prior_precision``.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer

X = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(1))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _closure(model: nn.Module, opt: torch.optim.Optimizer):
    def closure():
        opt.zero_grad()
        out = model(X)
        loss = F.cross_entropy(out, Y)
        loss.backward()
        return loss, out
    return closure


@pytest.mark.parametrize("face", ["second_order", "vi"])
def test_deepcopy_after_a_scheduler_steps_the_copy(face):
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.05, seed=0) if face == "second_order" else \
        VIOptimizer(model, dataset_size=100, approx="kfac", seed=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    for _ in range(3):
        opt.step(_closure(model, opt))
        sched.step()
    model2, opt2 = copy.deepcopy((model, opt))
    before, before2 = model[0].weight.detach().clone(), model2[0].weight.detach().clone()
    opt2.step(_closure(model2, opt2))
    assert torch.equal(model[0].weight, before)  # the original did not move
    assert (model2[0].weight - before2).abs().max() > 0
    assert (opt.num_steps, opt2.num_steps) == (3, 4)


def test_deepcopy_drops_the_hooks_as_torch_optim_does():
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.05)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append(1))
    _, opt2 = copy.deepcopy((model, opt))
    assert len(opt2._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_pre_hooks) == 1


def test_pickling_the_optimizer_names_state_dict():
    model = _mlp()
    opt = SecondOrderOptimizer(model)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)


def _freeze_bias_run(approx: str):
    """Two steps, freeze the last Linear's bias, one more step (curvature and decomposition every step)."""
    model = _mlp()
    opt = SecondOrderOptimizer(model, approx=approx, lr=0.1, momentum=0.0, kl_clip=None, damping=0.1,
                               curv_update_interval=1, inv_update_interval=1)
    for _ in range(2):
        opt.step(_closure(model, opt))
    model[2].bias.requires_grad_(False)
    model[2].bias.grad = None
    weight, bias = model[2].weight.detach().clone(), model[2].bias.detach().clone()
    opt.step(_closure(model, opt))
    return model, opt, weight, bias


@pytest.mark.parametrize("approx", ["kfac", "diag", "full"])
def test_second_order_frozen_bias_keeps_the_weight_preconditioned(approx):
    model, opt, weight, bias = _freeze_bias_run(approx)
    assert torch.equal(model[2].bias, bias)
    blk = opt.running.blocks["2"]
    g = model[2].weight.grad
    expected = blk.solve([g, torch.zeros_like(bias)])[0]  # the step's solve (the block the step decomposed)
    update = (weight - model[2].weight.detach()) / 0.1
    assert (update - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert (update - g).abs().max() > 0.1 * g.abs().max()  # not the plain gradient


@pytest.mark.parametrize("approx", ["kfac", "diag"])
def test_vi_frozen_bias_is_not_sampled(approx):
    model = _mlp()
    opt = VIOptimizer(model, dataset_size=100, approx=approx, seed=0)
    opt.step(_closure(model, opt))
    model[2].bias.requires_grad_(False)
    bias = model[2].bias.detach().clone()
    seen = []

    def closure():
        seen.append(model[2].bias.detach().clone())
        return _closure(model, opt)()
    opt.step(closure)
    assert torch.equal(seen[0], bias)  # the forward saw the frozen bias as it is
    assert torch.equal(model[2].bias, bias)


def test_vi_group_weight_decay_is_refused():
    model = _mlp()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if n.endswith("bias")]
    with pytest.raises(ValueError, match="prior_precision"):
        VIOptimizer(model, dataset_size=100, params=[{"params": decay, "weight_decay": 0.5},
                                                     {"params": rest, "weight_decay": 0.0}])
    opt = VIOptimizer(model, dataset_size=100, params=[{"params": decay, "weight_decay": 0.0}, {"params": rest}])
    opt.param_groups[0]["weight_decay"] = 1e-4  # set by hand later: refused at the next step
    with pytest.raises(ValueError, match="weight_decay"):
        opt.step(_closure(model, opt))
