"""A ``KFACPreconditioner`` on some layers of a model and a ``SecondOrderOptimizer`` / ``VIOptimizer`` on
others: the native optimizer's own passes over the model (the Monte-Carlo and exact Fisher's backward
passes, the Hessian's, adaptive mode's products and its loss evaluation) are hidden from the
preconditioner, whose factors take the user's forward and backward only
(``curvature.hook_marks.HiddenPasses``)."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner
from torchsso2.optim import sequential_jvp


class Net(nn.Module):
    """Not an ``nn.Sequential``: adaptive mode takes its products by forward-mode passes of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


ADAPTIVE = dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True, adaptive_damping=True,
                damping_adaptation_interval=1)
CASES: Dict[str, Callable[[Net], Any]] = {
    "fisher_mc": lambda n: SecondOrderOptimizer(n, params=n.body.parameters()),
    "fisher": lambda n: SecondOrderOptimizer(n, params=n.body.parameters(), curvature="fisher"),
    "hessian_full": lambda n: SecondOrderOptimizer(n, params=n.body.parameters(), curvature="hessian",
                                                   approx="full", damping=1.0),
    "adaptive_fisher_mc": lambda n: SecondOrderOptimizer(n, params=n.body.parameters(), **ADAPTIVE),
    "adaptive_hessian": lambda n: SecondOrderOptimizer(n, params=n.body.parameters(), curvature="hessian",
                                                       approx="diag", damping=1.0, **ADAPTIVE),
    "submodule_fisher_mc": lambda n: SecondOrderOptimizer(n.body),
    "vi_kfac": lambda n: VIOptimizer(n, params=n.body.parameters(), dataset_size=100, approx="kfac"),
    "vi_diag": lambda n: VIOptimizer(n, params=n.body.parameters(), dataset_size=100),
}


def _head_factors(case: str, x: torch.Tensor, y: torch.Tensor, steps: int = 3):
    """The head's factors, and its fold counts at each step, after ``steps`` of (the body's optimizer, then
    the preconditioner); ``case=None``: the closure alone (the user's forward and backward) in place of
    the body's optimizer step."""
    torch.manual_seed(0)
    net = Net()
    pre = KFACPreconditioner(net, skip_layers=["body"], factor_update_steps=1, inv_update_steps=1)
    opt = CASES[case](net) if case is not None else None
    counts = []

    def closure():
        net.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        return loss
    for _ in range(steps):
        if opt is None:
            closure()
        else:
            opt.step(closure, targets=y)
        counts.append(dict(pre.layers["head"].fold_counts))
        pre.step()
    layer = pre.layers["head"]
    return layer.a_factor.clone(), layer.g_factor.clone(), counts, net


@pytest.mark.parametrize("case", sorted(CASES))
def test_preconditioner_on_other_layers_takes_the_users_passes_only(case: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    with warnings.catch_warnings():
        # layers no preconditioner holds: nothing to warn about (built on the body, the optimizer takes the
        # body's output for the model's: the loss-scale checks say so, as documented)
        warnings.simplefilter("ignore" if case.startswith("submodule") else "error")
        a, g, counts, _ = _head_factors(case, x, y, steps=1)
    a_ref, g_ref, _, _ = _head_factors(None, x, y, steps=1)
    assert counts == [{"A": 1, "G": 1}], counts  # one forward and one backward: the user's
    if case.startswith("vi"):  # (its closure runs at sampled weights: the head's inputs differ from the reference)
        return
    torch.testing.assert_close(a, a_ref, rtol=0, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["fisher_mc", "adaptive_fisher_mc", "vi_kfac"])
def test_every_step_is_the_users_batch(case: str) -> None:
    """Over several steps (the body moving between them) the head records one forward and one backward
    per step."""
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    _, _, counts, _ = _head_factors(case, x, y, steps=4)
    assert counts == [{"A": 1, "G": 1}] * 4, counts


@pytest.mark.parametrize("curvature", ["fisher_mc", "empirical_fisher", "hessian", "vi_diag"])
def test_same_layers_as_a_live_preconditioner_warn_for_every_kind(curvature: str) -> None:
    """Both would precondition the same gradients: named at the optimizer's first step, whatever its kind
    (VIOptimizer's default diagonal estimates nothing with a capture: its first closure call)."""
    torch.manual_seed(0)
    net = Net()
    pre = KFACPreconditioner(net)
    opt = VIOptimizer(net, dataset_size=100) if curvature == "vi_diag" else \
        SecondOrderOptimizer(net, curvature=curvature, approx="diag", damping=1.0)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    closure = make_closure(opt, net, x, y)
    with pytest.warns(UserWarning, match=r"(SecondOrderOptimizer|VIOptimizer): 1 other KFACPreconditioner\(s\) attached to layers "
                                         r"\['body.0', 'body.2', 'head'\].*preconditions their gradients more than"):
        opt.step(closure, targets=y)
    pre.remove_hooks()


@pytest.mark.parametrize("built_on", ["network", "sibling"])
def test_an_optimizer_on_a_submodule_hides_its_lm_call(built_on: str) -> None:
    """The LM rule's second call of the user's closure runs the whole network: hidden from a preconditioner
    built on the network (holding the optimizer's model) and from one on a sibling module (a head beside the
    optimizer's backbone, a GAN's discriminator): every live preconditioner."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    torch.manual_seed(0)
    net = Net()
    if built_on == "network":
        pre, head = KFACPreconditioner(net, skip_layers=["body"], factor_update_steps=1, inv_update_steps=1), "head"
    else:
        pre, head = KFACPreconditioner(net.head, factor_update_steps=1, inv_update_steps=1), ""
    opt = SecondOrderOptimizer(net.body, curvature="empirical_fisher", adaptive_damping=True,
                               damping_adaptation_interval=1)

    def closure():
        net.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        return loss
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (built on the body: the output-consumers warning)
        for _ in range(3):
            opt.step(closure)
            assert dict(pre.layers[head].fold_counts) == {"A": 1, "G": 1}
            pre.step()


def test_a_copy_taken_inside_a_hidden_pass_records_its_own_steps() -> None:
    """``copy.deepcopy((net, pre))`` inside the closure (a "best model" snapshot) during the LM rule's call:
    the copy is not left hidden."""
    import copy
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    torch.manual_seed(0)
    net = Net()
    pre = KFACPreconditioner(net, skip_layers=["body"], factor_update_steps=1, inv_update_steps=1)
    opt = SecondOrderOptimizer(net, params=net.body.parameters(), adaptive_damping=True,
                               damping_adaptation_interval=1)
    snapshots = []

    def closure():
        net.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        snapshots.append(copy.deepcopy((net, pre)))
        return loss
    opt.step(closure)
    pre.step()
    assert len(snapshots) == 2  # the step's call and the LM rule's (hidden) call
    net2, pre2 = snapshots[1]
    assert dict(pre2.layers["head"].fold_counts) == {"A": 1, "G": 1}  # the step's own call, copied
    net2.zero_grad()
    F.cross_entropy(net2(x), y).backward()
    assert dict(pre2.layers["head"].fold_counts) == {"A": 2, "G": 2}  # and the copy's own batch


def test_another_models_preconditioner_is_not_hidden() -> None:
    """(Another thread's training, say): the passes are hidden from the preconditioners that concern the
    optimizer's model only."""
    torch.manual_seed(0)
    net, other = Net(), Net()
    pre = KFACPreconditioner(other, factor_update_steps=1, inv_update_steps=1)
    opt = SecondOrderOptimizer(net)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with opt.engine.hidden_passes():
        other.zero_grad()
        F.cross_entropy(other(x), y).backward()
    assert dict(pre.layers["head"].fold_counts) == {"A": 1, "G": 1}
    own = KFACPreconditioner(net, skip_layers=["body"])
    with opt.engine.hidden_passes():  # a new live preconditioner is found (the live set changed)
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
    assert dict(own.layers["head"].fold_counts) == {"A": 0, "G": 0}


def test_a_pickled_preconditioner_records_again() -> None:
    """``torch.save((model, pre))`` and back: the loaded preconditioner is attached to the loaded model."""
    import io
    torch.manual_seed(0)
    net = Net()
    pre = KFACPreconditioner(net, factor_update_steps=1, inv_update_steps=1)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    buf = io.BytesIO()
    torch.save((net, pre), buf)
    net2, pre2 = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    net2.zero_grad()
    F.cross_entropy(net2(x), y).backward()
    assert dict(pre2.layers["head"].fold_counts) == {"A": 1, "G": 1}
    assert dict(pre.layers["head"].fold_counts) == {"A": 0, "G": 0}
    pre2.step()


@pytest.mark.parametrize("face", ["sso", "vi_kfac"])
def test_a_preconditioner_on_an_attentions_out_proj_is_not_taken_for_a_users_hook(face: str) -> None:
    """kfac_pytorch's registration puts a hook on nn.MultiheadAttention's out_proj, which the attention's
    forward never calls; the capture's recorded forward calls it, hidden from the preconditioner."""
    torch.manual_seed(0)

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(4, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            return self.head(self.attn(h, h, h, need_weights=False)[0].mean(1))
    net = Attn()
    x, y = torch.randn(8, 5, 4), torch.randint(0, 3, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (out_proj never called: the preconditioner's own warning; same layers)
        pre = KFACPreconditioner(net)
    opt = SecondOrderOptimizer(net) if face == "sso" else VIOptimizer(net, dataset_size=100, approx="kfac")

    closure = make_closure(opt, net, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step(closure)
    assert "attn.out_proj" not in pre._mini_steps or pre._mini_steps["attn.out_proj"] == 0


def test_adaptive_mode_on_a_sequential_is_the_same_beside_a_preconditioner() -> None:
    """The preconditioner's hooks only record: adaptive mode keeps its hand-written J·v pass over a plain
    nn.Sequential, and its steps are bit-identical with and without a live preconditioner on other layers."""
    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    finals = []
    for with_pre in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        pre = KFACPreconditioner(net, skip_layers=["0"]) if with_pre else None
        opt = SecondOrderOptimizer(net, params=net[0].parameters(), seed=0, **ADAPTIVE)
        assert sequential_jvp.supports_model(net)  # (the hand-written pass)

        closure = make_closure(opt, net, x, y)
        for _ in range(3):
            opt.step(closure, targets=y)
        finals.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        del pre
    torch.testing.assert_close(finals[0], finals[1], rtol=0, atol=0)
