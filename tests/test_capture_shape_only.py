"""The empirical Fisher from the user's backward returns Linear/Conv2d outputs without a clone
(``Capture(shape_only=...)``, chosen by the engine from ``LayerFamily.reads_output_values``): an
in-place op right after such a layer must not change the factors (checked against the float64
brute force of tests/reference.py) and a capture whose owner runs its own backward keeps cloning."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvature.capture import Capture
from curvature.engine import CurvatureEngine
from reference import Reference


def _model(inplace: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(inplace=inplace), nn.Flatten(),
                         nn.Linear(3 * 4 * 4, 6), nn.ReLU(inplace=inplace), nn.Linear(6, 4)).double()


def _from_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    engine = CurvatureEngine(model, kind="empirical_fisher", approx="kfac")
    with engine.capture(record_backward=True) as cap:
        out = model(x)
        outputs = {n: rec.output for n, rec in cap.records.items()}
        F.cross_entropy(out, y).backward()
    return engine, cap, outputs, engine.estimate_from_backward(cap)


def test_no_clone_for_weight_matrix_layers_from_the_users_backward() -> None:
    model = _model(inplace=True)
    x, y = torch.randn(5, 2, 4, 4, dtype=torch.float64), torch.randint(0, 4, (5,))
    engine, cap, outputs, _ = _from_backward(model, x, y)
    assert cap.shape_only == {"0", "3", "5"}
    # the layer's own output was passed on (the ReLU wrote into the recorded tensor), not a clone
    assert bool((outputs["0"] >= 0).all()) and bool((outputs["3"] >= 0).all())
    with engine.capture() as own:  # the engine's own backward passes need the outputs unchanged
        assert own.shape_only == frozenset()


@pytest.mark.parametrize("inplace", [True, False])
def test_factors_after_an_inplace_relu_equal_the_brute_force(inplace: bool) -> None:
    model = _model(inplace)
    x, y = torch.randn(5, 2, 4, 4, dtype=torch.float64), torch.randint(0, 4, (5,))
    *_, blocks = _from_backward(model, x, y)
    ref = Reference(_model(False), x, y, "cross_entropy")  # the same weights, out-of-place ReLUs
    for name in ("0", "3", "5"):
        a, g, _ = ref.kfac(name, "empirical_fisher")
        torch.testing.assert_close(blocks[name].A, a, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(blocks[name].G, g, rtol=1e-10, atol=1e-12)


def test_shape_only_is_ignored_without_record_backward() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 8)
    with Capture({"fc": lin}, shape_only=["fc"]) as cap:
        assert cap.shape_only == frozenset()
        out = nn.ReLU(inplace=True)(lin(torch.randn(4, 3)))
    assert bool((out >= 0).all())
    assert bool((cap.records["fc"].output < 0).any())  # a clone was passed on: the record kept its values
