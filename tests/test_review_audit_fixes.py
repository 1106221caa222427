"""Review of the audit fixes: in-place ops after a layer with a view output, a zero gradient in adaptive
mode, VI's reparam estimate when the closure unscales, NumPy hyperparameters in checkpoints, a
KFACPreconditioner step with no recorded forward."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner


class _Residual(nn.Module):
    """A Linear on [N, T, d] (its output a view) followed by in-place ops."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.proj, self.head, self.inplace = nn.Linear(4, 4), nn.Linear(4, 3), inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.inplace:
            h += x
            h = torch.relu_(h)
        else:
            h = torch.relu(h + x)
        return self.head(h.mean(1))


def _residual_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def _params_after(face: str, inplace: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = _Residual(inplace)
    x, y = _residual_data()
    if face == "kfac":
        pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            sgd.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            sgd.step()
    else:
        opt = SecondOrderOptimizer(model, curvature="empirical_fisher", approx=face)
        for _ in range(2):
            opt.step(make_closure(opt, model, x, y))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("face", ["kfac", "diag"])
def test_in_place_ops_after_a_layer_with_a_view_output_keep_its_curvature(face: str) -> None:
    torch.testing.assert_close(_params_after(face, True), _params_after(face, False))


def test_a_zero_gradient_in_adaptive_mode_is_no_step_not_a_skip() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = SecondOrderOptimizer(model, loss="mse", use_adaptive_learning_rate=True, use_adaptive_momentum=True,
                               damping=1e-2, max_consecutive_skips=3)
    x, y = torch.randn(16, 4), torch.randn(16, 2)

    def step(targets):
        def closure():
            opt.zero_grad()
            out = model(x)
            loss = 0.5 * (out - targets).pow(2).sum(1).mean()
            loss.backward()
            return loss, out
        opt.step(closure, targets=targets)
    step(y)
    step(y)
    for _ in range(5):
        before = [p.detach().clone() for p in model.parameters()]
        step(model(x).detach())  # fitted exactly: a zero gradient
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.num_skipped == 0 and opt.num_steps == 7
    step(y)
    assert opt.num_skipped == 0


def test_vi_reparam_estimate_when_the_closure_unscales_itself() -> None:
    def run(unscale_in_closure: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        opt = VIOptimizer(model, dataset_size=100, curvature="reparam", grad_scaler=scaler, seed=0)
        x, y = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), torch.randint(0, 3, (16,))

        def closure():
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            scaler.scale(loss).backward()
            if unscale_in_closure:  # torch's recipe to clip
                scaler.unscale_(opt)
            return loss, out
        opt.step(closure)
        return torch.cat([b.dense().diagonal() for b in opt.running.blocks.values()])
    torch.testing.assert_close(run(True), run(False))


def test_a_numpy_learning_rate_survives_a_checkpoint() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = SecondOrderOptimizer(model, lr=np.float32(0.05))
    state = opt.state_dict()  # before any step converts it
    SecondOrderOptimizer(nn.Linear(3, 2), lr=0.1).load_state_dict(state)


def test_kfac_step_with_gradients_but_no_recorded_forward_raises_as_kfac_pytorch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    pre = KFACPreconditioner(model)
    with torch.no_grad():
        out = model(torch.randn(6, 4))  # a forward the hooks ignore
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    del out
    with pytest.raises(RuntimeError, match="no forward of a registered layer was recorded before step"):
        pre.step()


def test_kfac_warns_about_multihead_attention_out_proj_it_never_sees() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.attn(x, x, x)[0].mean(1))
    with pytest.warns(UserWarning, match=r"\['attn.out_proj'\] are nn.MultiheadAttention out_proj layers"):
        KFACPreconditioner(Attention())
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KFACPreconditioner(Attention(), skip_layers=["out_proj"])
