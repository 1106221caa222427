"""torch.compile and TorchScript: training-mode BatchNorm under a compiled model, the Hessian with an
aot_autograd backend, scripted modules."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import curvature

dynamo = pytest.importorskip("torch._dynamo")


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)).double()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_batch_norm_in_training_mode_under_compile_keeps_the_frozen_statistics_curvature(backend: str) -> None:
    x, y = torch.randn(6, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    plain = curvature.compute(_bn_net(), x, y, kind="fisher", approx="full")
    try:
        dynamo.reset()
        compiled = curvature.compute(torch.compile(_bn_net(), backend=backend), x, y, kind="fisher", approx="full")
    finally:
        dynamo.reset()
    for name, block in plain.blocks.items():  # the conv before the BatchNorm was 40% off
        torch.testing.assert_close(compiled.blocks[f"_orig_mod.{name}"].dense(), block.dense())


def test_the_hessian_of_an_aot_compiled_model_names_the_fix() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    try:
        dynamo.reset()
        with pytest.raises(ValueError, match="backend='eager'.*_orig_mod"):
            curvature.compute(torch.compile(model, backend="aot_eager"), x, y, kind="hessian", approx="diag")
        dynamo.reset()
        eager = curvature.compute(torch.compile(model, backend="eager"), x, y, kind="hessian", approx="diag")
    finally:
        dynamo.reset()
    plain = curvature.compute(model, x, y, kind="hessian", approx="diag")
    for name, block in plain.blocks.items():
        torch.testing.assert_close(eager.blocks[f"_orig_mod.{name}"].dense(), block.dense())


def test_a_scripted_layer_is_refused_with_the_fix() -> None:
    model = nn.Sequential(torch.jit.script(nn.Linear(3, 4)), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="TorchScript module .* Build the optimizer on the original nn.Module"):
        curvature.compute(model, torch.randn(5, 3), torch.randint(0, 2, (5,)))
