"""What a realistic-size model meets first (a language model's vocabulary-wide head, tied weights).

* A dense K-FAC factor too large to decompose often is announced when the optimizer is built (an
  8000-token LM's tied [8000, 8000] factor took 3 minutes a step, silently), by both faces; a diagonal
  factor (an untied Embedding's token counts) is not.
* A module sharing a covered parameter that the curvature does not cover (a tied head left out with
  ``skip_modules``) is named by the error, which no longer tells the user to tie the weights they tied.
* ``KFACPreconditioner`` warns about a registered layer tied to a module it does not register.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer
from torchsso2.kfac import KFACPreconditioner


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def _rows(out: torch.Tensor) -> torch.Tensor:
    return out.reshape(-1, out.shape[-1])


def _kfac_warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.name == "curvature" and "dense factor" in r.getMessage()]


def test_a_large_dense_kfac_factor_is_announced_at_construction(caplog):
    with caplog.at_level(logging.WARNING, logger="curvature"):
        SecondOrderOptimizer(nn.Sequential(nn.Linear(10, 5000), nn.ReLU(), nn.Linear(5000, 3)))
    (one, two) = _kfac_warnings(caplog)
    assert "module '0'" in one and "5000x5000" in one and "approx={'0': 'diag'}" in one
    assert "module '2'" in two and "5001x5001" in two  # the input side, with the bias column


def test_a_tied_vocabulary_factor_is_announced_an_untied_embedding_is_not(caplog):
    with caplog.at_level(logging.WARNING, logger="curvature"):
        SecondOrderOptimizer(nn.Sequential(nn.Embedding(9000, 16), nn.Flatten(), nn.Linear(32, 3)))
        assert not _kfac_warnings(caplog)  # its token counts are a diagonal factor
        SecondOrderOptimizer(TiedLM(vocab=4100), output_selector=_rows)
    (msg,) = _kfac_warnings(caplog)
    assert "module 'emb'" in msg and "4100x4100" in msg and "minutes" not in msg.split("FLOPs")[0]


def test_small_models_announce_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="curvature"):
        SecondOrderOptimizer(TiedLM(), output_selector=_rows)
        SecondOrderOptimizer(nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4095, 10)))  # sides <= 4096
    assert not _kfac_warnings(caplog)


def test_kfac_preconditioner_announces_large_factors_and_a_tie_to_an_unregistered_module(caplog):
    with caplog.at_level(logging.WARNING, logger="curvature"), \
            pytest.warns(UserWarning, match=r"layer 'head' shares a parameter with module 'emb', which is not "
                                            r"registered.*skip_layers=\['head'\]"):
        pre = KFACPreconditioner(TiedLM(vocab=4200))
    pre.remove_hooks()
    (msg,) = _kfac_warnings(caplog)
    assert "module 'head'" in msg and "4200x4200" in msg and "skip_layers=['head']" in msg


def test_a_skipped_tied_head_is_named_as_the_cause():
    model = TiedLM()
    opt = SecondOrderOptimizer(model, skip_modules=["head"], output_selector=_rows)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 50, (4, 6), generator=g), torch.randint(0, 50, (4, 6), generator=g)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(_rows(out), y.reshape(-1))
        loss.backward()
        return loss, out

    with pytest.raises(ValueError, match=r"emb.weight is also held by \['head'\], which the curvature does not "
                                         r"cover.*skip all of them \(skip_modules=\['emb', 'head'\]\)"):
        opt.step(closure)
    # skipping both holders, or none, trains
    for skip in (["head", "emb"], None):
        model = TiedLM()
        opt = SecondOrderOptimizer(model, skip_modules=skip, output_selector=_rows)
        opt.step(closure)


def test_an_aliased_covered_module_is_not_taken_for_an_uncovered_holder():
    """A covered layer also reachable under a second attribute (never called) is the same module: a
    functional use of its weight gets the functional-use error, not the tied-holder one."""
    class Aliased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.again = self.fc
            self.out = nn.Linear(4, 3)

        def forward(self, x):
            return self.out(self.fc(x) + F.linear(x, self.fc.weight))

    model = Aliased()
    opt = SecondOrderOptimizer(model)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))

    closure = make_closure(opt, model, x, y)

    with pytest.raises(ValueError, match="used in the forward outside") as err:
        opt.step(closure)
    assert "also held by" not in str(err.value) and "F.linear(h, emb.weight)" in str(err.value)
