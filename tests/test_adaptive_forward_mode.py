"""Adaptive mode's forward-mode pass (J·v by dual numbers) on attention models, and a model op without a
forward-mode formula: a clear error, and the optimizer as if the failed call never happened."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer

ADAPTIVE = dict(damping=1e-2, adaptive_damping=True, use_adaptive_learning_rate=True, use_adaptive_momentum=True)


class _Attention(nn.Module):
    def __init__(self, layer: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.layer = layer
        if layer == "mha":  # the fused CPU SDPA kernel (flash) has no forward-mode formula
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        else:  # in eval mode the encoder layer's fast path is one fused op without one
            self.attn = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 20)

    def forward(self, tokens):
        h = self.emb(tokens)
        if self.layer == "mha":
            return self.head(h + self.attn(h, h, h, need_weights=False)[0])
        return self.head(self.attn(h))


def _next_token_closure(opt, model, tokens):
    """A closure of the token-level cross-entropy of ``model(tokens)`` ``[N, T, 20]`` against ``tokens``."""
    def closure():
        opt.zero_grad()
        out = model(tokens)
        loss = F.cross_entropy(out.reshape(-1, 20), tokens.reshape(-1))
        loss.backward()
        return loss, out
    return closure


@pytest.mark.parametrize("layer,train", [("mha", True), ("mha", False), ("encoder", False)])
def test_adaptive_mode_trains_attention_models(layer: str, train: bool) -> None:
    """These raised torch's 'Trying to use forward AD with _scaled_dot_product_flash_attention_for_cpu'
    (or _transformer_encoder_layer_fwd); the pass now runs attention on kernels with forward-mode
    formulas (the math SDPA backend, no MHA fast path), and leaves torch's settings as they were."""
    torch.manual_seed(0)
    model = _Attention(layer).train(train)
    tokens = torch.randint(0, 20, (8, 6))
    opt = SecondOrderOptimizer(model, **ADAPTIVE)
    closure = _next_token_closure(opt, model, tokens)
    fast = torch.backends.mha.get_fastpath_enabled()
    losses = [float(opt.step(closure, targets=tokens)[0].detach()) for _ in range(6)]
    assert torch.backends.mha.get_fastpath_enabled() == fast
    assert opt.num_steps == 6 and opt.num_skipped == 0
    assert losses[-1] < losses[0]


def test_adaptive_mode_with_the_hessian_runs_attention_on_kernels_with_a_double_backward() -> None:
    """curvature='hessian' takes the adaptive coefficients from Hessian-vector products (a double backward), which
    through nn.MultiheadAttention raised 'derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward
    is not implemented'; they now run on the math backend too, and equal a model written with it."""
    tokens = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(0))
    rates = []
    for math_only in (False, True):
        torch.manual_seed(0)
        model = _Attention("mha").double()
        opt = SecondOrderOptimizer(model, curvature="hessian", approx="diag", damping=1.0,
                                   use_adaptive_learning_rate=True, use_adaptive_momentum=True)
        closure = _next_token_closure(opt, model, tokens)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for _ in range(3):
            if math_only:
                with sdpa_kernel(SDPBackend.MATH):
                    opt.step(closure, targets=tokens)
            else:
                opt.step(closure, targets=tokens)
        assert opt.num_steps == 3
        rates.append(opt.adaptive.last["learning_rate"])
    assert rates[0] == pytest.approx(rates[1], rel=1e-9) and rates[0] > 0


class _NoJvpRelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return g * (x > 0)


class _Switchable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.custom = nn.Linear(10, 16), nn.Linear(16, 3), False

    def forward(self, x):
        h = self.a(x)
        return self.b(_NoJvpRelu.apply(h) if self.custom else torch.relu(h))


def test_an_op_without_a_forward_mode_formula_is_named_and_the_failed_step_leaves_no_trace() -> None:
    """The pass runs after the curvature took the batch; it raised torch's bare error and left the
    curvature, its decompositions and the label stream one batch on (parameters 0.18 apart three steps
    later). Now the error names adaptive mode's forward-mode requirement, and the optimizer is given
    back as it was: the run goes on bit for bit as one without the failed call."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 10, generator=gen), torch.randint(0, 3, (64,), generator=gen)

    def make():
        torch.manual_seed(1)
        model = _Switchable()
        return model, SecondOrderOptimizer(model, seed=0, **ADAPTIVE)

    def closure_of(model, opt):
        def closure():
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            return loss, out
        return closure

    runs = [make(), make()]
    for step in range(6):
        for i, (model, opt) in enumerate(runs):
            if i == 1 and step in (0, 3):  # at the first step (nothing yet) and later (curvature and decompositions)
                model.custom = True
                with pytest.raises(NotImplementedError, match=r"adaptive mode .* forward-mode AD .* jvp"):
                    opt.step(closure_of(model, opt))
                model.custom = False
            opt.step(closure_of(model, opt))
    (ma, oa), (mb, ob) = runs
    assert oa.num_steps == ob.num_steps == 6
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(p, q)
