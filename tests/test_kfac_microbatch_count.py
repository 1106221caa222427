"""KFACPreconditioner with ``update_factors_in_hook=True`` counts a micro-batch per forward of the model
*with a backward after it*: a model called twice per micro-batch (two views, one backward) folded its
factors twice per step at ``accumulation_steps=2`` (0.19 off the documented single fold of the step's
average), and a training-mode forward that no backward reaches (a metric computed with grad on) shifted
the fold. The hook's fold now equals the fold at ``step()`` (``update_factors_in_hook=False``), which
is the docs' formula. Loading factors without decompositions and ``compute_inverses=False`` warns
that the layers stay unpreconditioned until the next inverse step (kfac_pytorch raises at step())."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import KFACPreconditioner


def _run(ufih: bool, pattern: str, acc: int = 2, steps: int = 3):  # noqa: ANN202
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    p = KFACPreconditioner(m, accumulation_steps=acc, update_factors_in_hook=ufih, factor_decay=0.5,
                           inv_dtype=torch.float64, factor_dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(steps):
        for k in range(acc):
            x1, x2 = (torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(2))
            if pattern == "two-views":
                loss = m(x1).pow(2).mean() + m(x2).pow(2).mean()
            else:  # "metric": a forward with grad on that no backward reaches, then the micro-batch
                m(x2).sum().detach()
                loss = m(x1).pow(2).mean()
            loss.backward()
        p.step()
        grads.append([q.grad.clone() for q in m.parameters()])
        m.zero_grad()
    return p, grads


@pytest.mark.parametrize("pattern", ["two-views", "metric"])
@pytest.mark.parametrize("acc", [1, 2, 3])
def test_hook_fold_equals_the_step_fold(pattern: str, acc: int) -> None:
    hook, g_hook = _run(True, pattern, acc)
    step, g_step = _run(False, pattern, acc)
    for name in hook.layers:
        torch.testing.assert_close(hook.layers[name].a_factor, step.layers[name].a_factor, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(hook.layers[name].g_factor, step.layers[name].g_factor, rtol=1e-12, atol=1e-14)
    for a, b in zip(g_hook, g_step):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_two_views_fold_once_by_the_formula() -> None:
    """One step, 2 micro-batches × 2 forwards of a single Linear: ``A = ε·I + (1−ε)·mean of the 4 pairs' A``."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 2)).double()
    p = KFACPreconditioner(m, accumulation_steps=2, factor_decay=0.5, inv_dtype=torch.float64,
                           factor_dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(4)]
    for k in range(2):
        (m(xs[2 * k]).pow(2).mean() + m(xs[2 * k + 1]).pow(2).mean()).backward()
    p.step()
    a = [torch.cat([x, torch.ones(4, 1, dtype=torch.float64)], 1) for x in xs]
    expected = 0.5 * torch.eye(4, dtype=torch.float64) + 0.5 * sum(ai.T @ ai / 4 for ai in a) / 4
    torch.testing.assert_close(p.layers["0"].a_factor, expected, rtol=1e-12, atol=1e-14)


def test_loading_factors_without_decompositions_and_compute_inverses_false_warns() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4)).double()
    p = KFACPreconditioner(m, inv_update_steps=3, inv_dtype=torch.float64)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 4, (8,))
    for _ in range(4):
        m.zero_grad()
        F.cross_entropy(m(x), y).backward()
        p.step()
    sd = p.state_dict(include_decompositions=False)  # kfac_pytorch's format
    p.remove_hooks()
    fresh = KFACPreconditioner(m, inv_update_steps=3, inv_dtype=torch.float64)
    with pytest.warns(UserWarning, match="until the next inverse step the layers precondition with the decompositions"):
        fresh.load_state_dict(sd, compute_inverses=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KFACPreconditioner(m, inv_update_steps=3, inv_dtype=torch.float64).load_state_dict(sd)  # decomposes: quiet
