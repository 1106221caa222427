"""A layer reparametrized after the optimizer was built (pruning mid-training, a spectral norm added
later), and a registered K-FAC layer whose weight is used without calling it.

torch moves the weight Parameter to ``parametrizations.weight.original`` (``weight_orig`` for prune,
``weight_g``/``weight_v`` for the old weight_norm) and computes ``weight`` from it; the optimizers'
blocks describe the old Parameter. Each face now refuses at its next step, naming what happened,
instead of preconditioning a computed tensor that nothing updates (SecondOrderOptimizer gave the layer
plain SGD, VIOptimizer froze its posterior, KFACPreconditioner raised a bare ``KeyError``).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from torch import nn
from torch.nn.utils import parametrizations

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner

REPARAMETRIZE = {
    "spectral_norm": parametrizations.spectral_norm,
    "orthogonal": parametrizations.orthogonal,
    "weight_norm": parametrizations.weight_norm,
    "prune": lambda m: prune.l1_unstructured(m, "weight", amount=0.5),
    "old_weight_norm": nn.utils.weight_norm,
}


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def _model() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4))


@pytest.mark.parametrize("face", ["second_order", "vi", "kfac"])
@pytest.mark.parametrize("how", sorted(REPARAMETRIZE))
def test_a_layer_reparametrized_after_construction_is_refused_at_the_next_step(face: str, how: str) -> None:
    x, y = _data()
    model = _model()
    if face == "kfac":
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        pre = KFACPreconditioner(model)

        def step() -> None:
            sgd.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            sgd.step()
    else:
        opt = SecondOrderOptimizer(model, lr=0.05) if face == "second_order" else \
            VIOptimizer(model, dataset_size=100, lr=1e-2)
        closure = make_closure(opt, model, x, y)

        def step() -> None:
            opt.step(closure)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step()
        REPARAMETRIZE[how](model[0])
        with pytest.raises(ValueError) as err:
            step()
    text = str(err.value)
    # (prune and the old weight_norm compute the weight from the moved Parameter in a pre-hook: a use outside
    # the module's call, which the capture refused under that name before it checked the parameters it holds)
    assert "module '0' (" in text and "no longer holds its parameter 'weight'" in text, text
    assert "after the optimizer was built" in text and "skip_modules" in text, text
    if how in ("spectral_norm", "orthogonal", "weight_norm"):
        assert "parametrizations.weight.original" in text, text


def test_removing_the_pruning_again_trains_on() -> None:
    """``prune.remove`` registers the original Parameter object as ``weight`` again (pruned in place):
    the optimizer steps on and updates it."""
    x, y = _data()
    model = _model()
    opt = SecondOrderOptimizer(model, lr=0.05)
    closure = make_closure(opt, model, x, y)
    opt.step(closure)
    weight = model[0].weight
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    prune.remove(model[0], "weight")
    assert model[0].weight is weight
    before = weight.detach().clone()
    opt.step(closure)
    assert not torch.equal(before, model[0].weight)


class _UsesChildWeight(nn.Module):
    """A registered Linear whose weight is used through ``F.linear`` without calling the Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.lin.weight, self.lin.bias))


def test_kfac_preconditioner_warns_once_about_a_layer_with_a_gradient_and_no_recorded_forward() -> None:
    x, y = _data()
    torch.manual_seed(5)
    model = nn.Sequential(_UsesChildWeight(), nn.Linear(6, 4))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            sgd.zero_grad()
            F.cross_entropy(model(x), y).backward()
            raw = model[0].lin.weight.grad.clone()
            pre.step()
            assert torch.equal(model[0].lin.weight.grad, raw)  # unpreconditioned, as the warning says
            sgd.step()
    texts = [str(w.message) for w in caught if "no forward of them was recorded" in str(w.message)]
    assert len(texts) == 1 and "['0.lin']" in texts[0] and "skip_layers" in texts[0], texts


def test_kfac_preconditioner_warns_about_a_layer_put_in_eval_mode_after_it_had_factors() -> None:
    """Its factors stop updating while its gradient is preconditioned with them."""
    x, y = _data()
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            if step == 1:
                model[0].eval()
            sgd.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            sgd.step()
    texts = [str(w.message) for w in caught if "no forward of them was recorded" in str(w.message)]
    assert len(texts) == 1 and "['0']" in texts[0] and "factors do not update" in texts[0], texts


@pytest.mark.parametrize("set_to_none", [True, False])
def test_kfac_preconditioner_does_not_warn_for_a_head_unused_this_step_or_attention_out_proj(
        set_to_none: bool) -> None:
    """A head not called this step is not such a layer, with no gradient or with a zero one
    (``zero_grad(set_to_none=False)``, DDP's ``find_unused_parameters``): it has factors from the steps
    that called it. nn.MultiheadAttention's out_proj was named at registration and is not named again."""
    torch.manual_seed(0)

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
            h = self.attn(x, x, x, need_weights=False)[0].mean(1)
            return (self.a if head == "a" else self.b)(h)

    model = TwoHeads()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre = KFACPreconditioner(model)
        x, y = torch.randn(6, 3, 8), torch.randint(0, 4, (6,))
        for head in "aab":
            sgd.zero_grad(set_to_none=set_to_none)
            F.cross_entropy(model(x, head), y).backward()
            pre.step()
            sgd.step()
    at_registration = [w for w in caught if "out_proj" in str(w.message)]
    assert len(at_registration) == 1
    assert not [w for w in caught if "no forward of them was recorded" in str(w.message)]
