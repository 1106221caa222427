"""Findings of an audit of README.md's claims: the empirical Fisher from the user's backward with a
head the batch did not call (or a layer run under no_grad), and nn.MultiheadAttention's options."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer


class _TwoHeads(nn.Module):
    def __init__(self, no_grad_body: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(5, 3)
        self.no_grad_body = no_grad_body
        self.head = "b"

    def forward(self, x):
        if self.no_grad_body:
            with torch.no_grad():
                h = torch.relu(self.a(x))
        else:
            h = torch.relu(self.a(x))
        return self.b(h) if self.head == "b" else self.c(h)


def test_empirical_fisher_from_the_backward_keeps_an_uncalled_heads_curvature() -> None:
    """A head this batch did not call keeps its running curvature, as with fisher_mc (a bare KeyError
    before); the called modules' blocks are this batch's."""
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = SecondOrderOptimizer(model, curvature="empirical_fisher", ema_decay=0.0)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    opt.step(make_closure(opt, model, x, y))
    assert sorted(opt.running.blocks) == ["a", "b"]
    kept = opt.running.blocks["b"].A.clone()
    model.head = "c"
    opt.step(make_closure(opt, model, x, y))
    assert sorted(opt.running.blocks) == ["a", "b", "c"]
    assert torch.equal(opt.running.blocks["b"].A, kept)


def test_empirical_fisher_from_the_backward_names_a_layer_run_without_gradients() -> None:
    """A covered layer under torch.no_grad (or reentrant checkpointing): the fisher kinds' ValueError
    naming it and use_reentrant=False (a bare KeyError before)."""
    model = _TwoHeads(no_grad_body=True)
    opt = SecondOrderOptimizer(model, curvature="empirical_fisher")
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with pytest.raises(ValueError, match=r"covered modules \['a'\] were not called.*use_reentrant=False"):
        opt.step(make_closure(opt, model, x, y))


@pytest.mark.parametrize("options,named", [(dict(kdim=6, vdim=6), "kdim/vdim"), (dict(add_bias_kv=True), "add_bias_kv")])
def test_multihead_attention_options_are_named(options, named) -> None:
    """kdim/vdim and add_bias_kv hold parameters of their own: the error names the option (it called them
    a weight_norm-style reparametrization)."""
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.MultiheadAttention(4, 2, batch_first=True, **options)
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            return self.head(x)
    with pytest.raises(ValueError, match=f"MultiheadAttention with {named}"):
        SecondOrderOptimizer(Attn())


def test_uncalled_head_checks_follow_the_outputs_graph() -> None:
    """An L2 penalty in the closure's loss gives an uncalled head a gradient: still not a use of it by the
    model (kept, as with fisher_mc; it was refused); a head tied to the called one is refused with the
    ValueError (a bare KeyError before)."""
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = SecondOrderOptimizer(model, curvature="empirical_fisher")
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    def penalised():
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.cross_entropy(out, y) + 1e-4 * sum(p.pow(2).sum() for p in model.parameters())
        loss.backward()
        return loss, out
    for head in ("b", "c", "b"):
        model.head = head
        opt.step(penalised)
    assert sorted(opt.running.blocks) == ["a", "b", "c"]
    tied = _TwoHeads()
    tied.c.weight = tied.b.weight
    opt = SecondOrderOptimizer(tied, curvature="empirical_fisher", approx="diag")
    with pytest.raises(ValueError, match=r"covered modules \['c'\] were not called"):
        opt.step(make_closure(opt, tied, x, y))
