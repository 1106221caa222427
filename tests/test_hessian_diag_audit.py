"""The Hessian diagonal's output-space fast path: example coupling no pair of rows escapes, and a
layer whose input depends on its own weight (a use before the call) takes the generic path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import curvature


def _reference_diag(model: nn.Module, inputs: torch.Tensor, y: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """The diagonal of the mean loss's Hessian over ``module``'s parameters (every use of them)."""
    ps = list(module.parameters())
    flat0 = torch.cat([p.detach().reshape(-1) for p in ps])

    def f(flat: torch.Tensor) -> torch.Tensor:
        values, i = {}, 0
        for p in ps:
            t = flat[i:i + p.numel()].reshape(p.shape)
            i += p.numel()
            for n, q in model.named_parameters(remove_duplicate=False):
                if q is p:
                    values[n] = t
        out = functional_call(model, values, (inputs,), tie_weights=False)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return torch.autograd.functional.hessian(f, flat0).diagonal()


class _Coupled(nn.Module):
    """Examples mixed inside the model by functional batch statistics or centring."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.how = nn.Linear(4, 3), nn.Linear(3, 3), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = F.batch_norm(h, None, None, training=True) if self.how == "batch_norm" else h - h.mean(0)
        return self.fc2(torch.tanh(h))


@pytest.mark.parametrize("how", ["batch_norm", "centring"])
@pytest.mark.parametrize("n", [2, 3, 5, 16])
def test_coupled_examples_are_seen_at_every_batch_size(how: str, n: int) -> None:
    torch.manual_seed(0)
    model = _Coupled(how).double()
    x, y = torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,))
    got = curvature.compute(model, x, y, kind="hessian", approx="diag").blocks["fc1"].dense().diagonal()
    torch.testing.assert_close(got, _reference_diag(model, x, y, model.fc1), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("how", ["batch_norm", "centring"])
def test_coupled_examples_are_seen_in_float32(how: str) -> None:
    """The check that examples are independent holds in float32's rounding too (else the per-example
    diagonal misses the cross-example terms): against the Hessian's diagonal of a float64 copy."""
    torch.manual_seed(0)
    model = _Coupled(how)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    got = curvature.compute(model, x, y, kind="hessian", approx="diag").blocks["fc1"].dense().diagonal()
    m64 = _Coupled(how).double()
    m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    want = _reference_diag(m64, x.double(), y, m64.fc1)
    assert (got.double() - want).abs().max() <= 1e-4 * want.abs().max()


class _TiedHeadFirst(nn.Module):  # the head is registered first: it owns the weight the embedding uses before it
    def __init__(self) -> None:
        super().__init__()
        self.head, self.emb = nn.Linear(4, 6), nn.Embedding(6, 4)
        self.emb.weight = self.head.weight

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(t)))


class _FunctionalBefore(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(torch.tanh(F.linear(x, self.fc.weight)))))


def test_a_weight_used_before_its_layer_takes_the_generic_path() -> None:
    torch.manual_seed(0)
    tied = _TiedHeadFirst().double()
    t, yt = torch.randint(0, 6, (4, 3)), torch.randint(0, 6, (4, 3))
    got = curvature.compute(tied, t, yt, kind="hessian", approx="diag").blocks["head"].dense().diagonal()
    torch.testing.assert_close(got, _reference_diag(tied, t, yt, tied.head), rtol=1e-9, atol=1e-12)
    functional = _FunctionalBefore().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    got = curvature.compute(functional, x, y, kind="hessian", approx="diag").blocks["fc"].dense().diagonal()
    torch.testing.assert_close(got, _reference_diag(functional, x, y, functional.fc), rtol=1e-9, atol=1e-12)
