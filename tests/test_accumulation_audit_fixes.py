"""Gradient accumulation: micro-batches of sequence logits with different lengths are weighted by tokens."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvature
from torchsso2 import SecondOrderOptimizer


def _flat(blocks) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for name in sorted(blocks) for t in blocks[name].tensors()])


@pytest.mark.parametrize("reshaped", [False, True])
def test_sequence_micro_batches_of_different_lengths_are_weighted_by_their_tokens(reshaped: bool) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    g = torch.Generator().manual_seed(1)
    micro = [(torch.randn(2, t, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (2, t), generator=g))
             for t in (2, 8)]
    tokens = sum(y.numel() for _, y in micro)
    model = copy.deepcopy(base)
    opt = SecondOrderOptimizer(model, curvature="fisher", approx="diag", ema_decay=0.0,
                               output_selector=(lambda o: o.reshape(-1, o.shape[-1])) if reshaped else None)

    def closure():
        opt.zero_grad()
        total = 0.0
        for x, y in micro:  # the token mean over all micro-batches
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, 3), y.reshape(-1)) * y.numel() / tokens
            loss.backward()
            total = total + loss.detach()
        return total, out
    opt.step(closure)
    ref = sum(_flat(curvature.compute(copy.deepcopy(base), x, y, kind="fisher", approx="diag").blocks)
              * y.numel() / tokens for x, y in micro)
    torch.testing.assert_close(_flat(opt.running.blocks), ref, rtol=1e-12, atol=1e-14)


def test_learned_noise_with_the_last_micro_batch_output_says_to_concatenate() -> None:
    from torchsso2 import VIOptimizer
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    opt = VIOptimizer(model, dataset_size=8, loss="mse", noise_variance="learned")

    def closure():
        opt.zero_grad()
        for xb, yb in ((x[:5], y[:5]), (x[5:], y[5:])):
            out = model(xb)
            (0.5 * (out - yb).pow(2).sum(-1).mean() * len(xb) / 8).backward()
        return torch.zeros(()), out  # the last micro-batch's output only
    with pytest.raises(ValueError, match=r"return \(loss, torch.cat\(outs\)\) from the closure: all micro-batches' outputs concatenated"):
        opt.step(closure, targets=y)
