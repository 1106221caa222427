"""Usage patterns an audit found mishandled: a torch.compile'd forward inside the closure, a
channels_last model under VIOptimizer's flat diagonal step, zero_grad outside a several-sample VI
closure, an empty batch at a step that records nothing, a layer frozen mid-run with the empirical
Fisher from the user's backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner
from optim_helpers import make_closure


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_compiled_forward_inside_the_closure_gives_the_uncompiled_curvature() -> None:
    """The compiled copy runs the modules' hooks registered at each step (the recorded calls)."""
    dynamo = pytest.importorskip("torch._dynamo")
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    blocks = []
    for compiled in (False, True):
        model = _mlp()
        call = torch.compile(model, backend="aot_eager") if compiled else model
        opt = SecondOrderOptimizer(model, curvature="fisher")
        opt.step(make_closure(opt, call, x, y))
        blocks.append({n: b.dense() for n, b in opt.running.blocks.items()})
        dynamo.reset()
    for name in blocks[0]:
        torch.testing.assert_close(blocks[1][name], blocks[0][name])


class _Holder(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("held", [False, True], ids=["compiled-model", "compiled-submodule"])
def test_a_compiled_model_traced_before_the_optimizer_gets_the_fix_named(held: bool) -> None:
    """A compiled model whose graph was traced before the optimizer was built, or a module holding such
    a network (a LightningModule with ``self.net = torch.compile(net)``): the compile advice, not
    'not called in the forward pass'."""
    dynamo = pytest.importorskip("torch._dynamo")
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5):
        pytest.skip("torch 2.4's dynamo traces the graph again when the hooks are added: the step runs with them "
                    "(equal to the eager model), nothing to refuse")
    from torchsso2.kfac import KFACPreconditioner
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    try:
        for face in ("second_order", "empirical_fisher", "kfac"):
            dynamo.reset()
            compiled = torch.compile(_mlp(), backend="eager")
            compiled(x)  # a warm-up call: its graph has no curvature hooks
            model = _Holder(compiled) if held else compiled
            if face == "kfac":
                pre = KFACPreconditioner(model)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                with pytest.raises(RuntimeError, match="traced before the preconditioner's hooks existed"):
                    pre.step()
                continue
            opt = SecondOrderOptimizer(model, curvature="fisher" if face == "second_order" else face)
            with pytest.raises(ValueError, match=r"traced before the optimizer's hooks existed.*torch._dynamo.reset"):
                opt.step(make_closure(opt, model, x, y))
    finally:
        dynamo.reset()


def test_channels_last_trains_as_contiguous_under_vi_diag() -> None:
    """The flat step's fused kernels pair elements by memory position: a channels_last weight was
    paired with the wrong momentum entries from the second step on."""
    finals = []
    x, y = torch.randn(8, 2, 5, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    for fmt in (torch.contiguous_format, torch.channels_last):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(27, 3)).double()
        model = model.to(memory_format=fmt)
        xs = x.contiguous(memory_format=fmt)
        opt = VIOptimizer(model, dataset_size=50, seed=0)
        for _ in range(3):
            opt.step(make_closure(opt, model, xs, y))
        finals.append(_flat(model))
    torch.testing.assert_close(finals[0], finals[1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("approx", ["diag", "kfac"])
def test_several_vi_samples_do_not_need_zero_grad_in_the_closure(approx: str) -> None:
    """With zero_grad() outside the closure the second sample's backward added to the first's."""
    finals = []
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    for inside in (True, False):
        model = _mlp()
        opt = VIOptimizer(model, dataset_size=50, approx=approx, num_mc_samples=2, seed=0)

        def closure():
            if inside:
                opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            return loss, out

        for _ in range(3):
            if not inside:
                opt.zero_grad()
            opt.step(closure)
        finals.append(_flat(model))
    torch.testing.assert_close(finals[0], finals[1], rtol=0, atol=0)


def test_an_empty_batch_is_named_at_every_step() -> None:
    model = _mlp()
    opt = VIOptimizer(model, dataset_size=50, seed=0)  # its default steps record nothing
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    for _ in range(7):
        opt.step(make_closure(opt, model, x, y))
    before = _flat(model)
    with pytest.raises(ValueError, match="empty batch"):
        opt.step(make_closure(opt, model, x[:0], y[:0]))
    assert torch.equal(_flat(model), before) and opt.num_skipped == 0
    kfac_model = _mlp()
    pre = KFACPreconditioner(kfac_model)
    with pytest.raises(ValueError, match="the model ran on an empty batch"):
        kfac_model(torch.randn(0, 4))
    next(iter(pre.layers.values())).module(torch.randn(0, 4))  # one layer on no rows: not recorded, no error
    assert not any(pre._mini_steps.values())


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_empirical_fisher_from_the_backward_after_freezing_the_first_layer(face: str) -> None:
    model = _mlp()
    kw = dict(curvature="empirical_fisher", approx="kfac")
    opt = SecondOrderOptimizer(model, **kw) if face == "sso" else VIOptimizer(model, dataset_size=50, **kw)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    opt.step(make_closure(opt, model, x, y))
    model[0].requires_grad_(False)
    frozen = _flat(model[0])
    for _ in range(2):
        opt.step(make_closure(opt, model, x, y))
    assert torch.equal(_flat(model[0]), frozen)
    assert torch.isfinite(_flat(model)).all()
