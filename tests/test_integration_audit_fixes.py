"""Fixes from an ecosystem-integration audit (each test fails on the code before it): a step under
torch.inference_mode() names it (SecondOrderOptimizer blamed frozen parameters, VIOptimizer raised
torch's bare 'does not require grad'); params that are none of the model's are a ValueError saying
so (it was 'the model has no module with curvature support'); a tensor lr or momentum, which
torch.optim takes, gets the fix with its TypeError; a one-rank torch.distributed group no longer
logs the cross-rank timeout warning (no other rank can leave it waiting)."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer

X, Y = torch.randn(8, 3), torch.arange(8) % 2


def _build(face: str, model: nn.Module, **kw):
    return SecondOrderOptimizer(model, **kw) if face == "sso" else VIOptimizer(model, dataset_size=8, **kw)


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_a_step_under_inference_mode_names_it(face):
    model = nn.Linear(3, 2)
    opt = _build(face, model)

    closure = make_closure(opt, model, X, Y)
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"step\(\) cannot run under "
                                                                    r"torch.inference_mode\(\).*torch.no_grad\(\)"):
        opt.step(closure)
    assert opt.num_steps == 0
    with torch.no_grad():  # the step enables gradients for its closure
        opt.step(closure)
    assert opt.num_steps == 1


def test_curvature_compute_under_inference_mode_names_it():
    import curvature
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"curvature.compute cannot run under "
                                                                    r"torch.inference_mode\(\)"):
        curvature.compute(model, x, y)
    with torch.no_grad():
        assert curvature.compute(model, x, y).dense().shape == (43, 43)


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_params_of_another_model_are_named_as_such(face):
    with pytest.raises(ValueError, match=r"none of the 2 parameters in params belongs to the model the "
                                         r"(SecondOrderOptimizer|VIOptimizer) was built on"):
        _build(face, nn.Linear(3, 2), params=nn.Linear(3, 2).parameters())
    # one of the model's parameters among them is enough (a parameter outside it takes the plain update)
    model, scale = nn.Linear(3, 2), nn.Parameter(torch.ones(()))
    _build(face, model, params=[model.weight, model.bias, scale])


@pytest.mark.parametrize("key", ["lr", "momentum"])
def test_a_tensor_hyperparameter_gets_the_fix(key):
    with pytest.raises(TypeError, match=rf"{key} must be a real number, got Tensor .*one-element tensor: pass a "
                                        r"Python float, float\(t\)"):
        SecondOrderOptimizer(nn.Linear(3, 2), **{key: torch.tensor(0.1)})
    with pytest.raises(TypeError, match=r"must be a real number, got Tensor tensor\(\[0.1000, 0.2000\]\)$"):
        SecondOrderOptimizer(nn.Linear(3, 2), lr=torch.tensor([0.1, 0.2]))  # no float() hint for two numbers


def test_a_one_rank_group_logs_no_timeout_warning(tmp_path, caplog):
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)  # 30-min timeout
    try:
        from torchsso2.distributed import TorchCommunicator

        with caplog.at_level(logging.WARNING, logger="torchsso2"):
            comm = TorchCommunicator(timeout=60.0)
        assert comm.world_size == 1
        assert not [r for r in caplog.records if "timeout" in r.getMessage()], caplog.text
    finally:
        dist.destroy_process_group()
