"""Conv2d with ``padding="valid"`` / ``padding="same"`` (symmetric) against the brute-force reference.

Full and diagonal blocks are compared with ``tests/reference.py`` (torch.func, float64); K-FAC with
the same model written with the equivalent numeric padding (whose factors are checked against their
defining sums in ``test_curvature_reference.py``).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import curvature
from reference import Reference

N = 4


def _model(padding, dilation: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=padding, dilation=dilation), nn.Tanh(),
                         nn.Conv2d(3, 2, (3, 1), padding=padding), nn.Flatten(), nn.LazyLinear(3)).double()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 2, 6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)


NUMERIC = {("same", 1): 1, ("same", 2): 2, ("valid", 1): 0}


@pytest.mark.parametrize("padding,dilation", [("same", 1), ("same", 2), ("valid", 1)])
@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher", "hessian"])
@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
def test_string_padding(padding, dilation, kind, approx):
    if kind == "hessian" and approx == "kfac":
        pytest.skip("K-FAC of the Hessian is not implemented")
    x, y = _batch()
    model = _model(padding, dilation)
    model(x)  # materialize the lazy layer
    c = curvature.compute(model, x, y, kind=kind, approx=approx).dense()
    if approx == "kfac":
        numeric = _model(NUMERIC[(padding, dilation)], dilation)
        # the second conv's (3, 1) kernel: "same" pads (1, 0), "valid" (0, 0)
        numeric[2].padding = (1, 0) if padding == "same" else (0, 0)
        numeric(x)
        numeric.load_state_dict(model.state_dict())
        expected = curvature.compute(numeric, x, y, kind=kind, approx=approx).dense()
    else:
        expected = Reference(model, x, y, "cross_entropy").shaped(kind, approx, None)
    assert expected.abs().max() > 1e-3
    assert (c - expected).abs().max() <= 1e-10 * expected.abs().max()


def test_asymmetric_same_padding_is_refused():
    x, y = _batch()
    model = nn.Sequential(nn.Conv2d(2, 3, 2, padding="same"), nn.Flatten(), nn.LazyLinear(3)).double()
    model(x)
    with pytest.raises(ValueError, match="pads asymmetrically"):
        curvature.compute(model, x, y)


def test_kfac_preconditioner_same_padding_equals_numeric():
    from optim_helpers import kfac_sgd_train
    x, y = _batch()
    result = []
    for padding in ("same", 1):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=padding), nn.Tanh(), nn.Flatten(), nn.Linear(90, 3)).double()
        result.append(kfac_sgd_train(model, x, y, factor_update_steps=1, inv_update_steps=1))
    assert torch.equal(result[0], result[1])
