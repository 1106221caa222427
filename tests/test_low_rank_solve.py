"""Low-rank preconditioning of Linear K-FAC blocks (torchsso2/optim/lowrank.py): same steps as the
dense path, really taken where it pays, and refused whenever p.grad is not the user's gᵀã."""
from __future__ import annotations

from typing import Callable, Tuple

import pytest
import torch
from torch import nn

from torchsso2 import SecondOrderOptimizer
from torchsso2.optim import lowrank
from torchsso2.optim.lowrank import low_rank_pays


@pytest.fixture(autouse=True)
def tiny_layers_count(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The models here are tiny (float64 exactness); let them take the low-rank path by FLOPs
    alone, except in the test of the size threshold itself."""
    if "threshold" not in request.node.name:
        monkeypatch.setattr(lowrank, "MIN_DENSE_WORK", 0)


class MeanOverPositions(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def wide_model(bias: bool = True, seq: bool = False) -> nn.Module:
    """Wide Linear layers (20 -> 30 -> 25) and a narrow head; on ``[N, T, 20]`` inputs with ``seq``."""
    torch.manual_seed(0)
    layers = [nn.Linear(20, 30, bias=bias), nn.ReLU(inplace=True), nn.Linear(30, 25, bias=bias),
              nn.Tanh(), nn.Linear(25, 3)] + ([MeanOverPositions()] if seq else [])
    return nn.Sequential(*layers).double()


def train(model: nn.Module, steps: int = 6, batch: int = 3, tamper: Callable[[nn.Module], None] = lambda m: None,
          seq: bool = False, **kw) -> Tuple[SecondOrderOptimizer, nn.Module]:
    opt = SecondOrderOptimizer(model, lr=0.1, momentum=0.9, damping=0.1, curv_update_interval=2,
                               inv_update_interval=2, seed=0, **kw)
    gen = torch.Generator().manual_seed(1)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(batch, 2, 20, generator=gen, dtype=dtype) if seq else \
            torch.randn(batch, 20, generator=gen, dtype=dtype)
        y = torch.randint(0, 3, (batch,), generator=gen)

        def closure():
            opt.zero_grad()
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            loss.backward()
            tamper(model)
            return loss, out
        opt.step(closure)
    return opt, model


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("seq", [False, True], ids=["batch", "sequence"])
def test_low_rank_equals_dense(bias: bool, seq: bool) -> None:
    fast, m1 = train(wide_model(bias, seq), seq=seq)
    dense, m2 = train(wide_model(bias, seq), seq=seq, low_rank_solve=False)
    assert dense.low_rank is None
    assert fast.low_rank.num_low_rank >= 2 * 6, "both wide layers must take the low-rank path every step"
    assert fast.low_rank.num_rejected == 0
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def assert_refused_and_dense(tamper: Callable[[nn.Module], None]) -> None:
    """Training with ``tamper`` applied to the gradients after each backward: the probe refuses every
    low-rank solve (2 wide layers × 6 steps at least) and the result is the dense path's."""
    fast, m1 = train(wide_model(), tamper=tamper)
    dense, m2 = train(wide_model(), tamper=tamper, low_rank_solve=False)
    assert fast.low_rank.num_low_rank == 0 and fast.low_rank.num_rejected >= 2 * 6
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_gradient_changed_after_backward_takes_the_dense_path() -> None:
    def clip(model: nn.Module) -> None:
        for p in model.parameters():
            p.grad.mul_(0.5)
    assert_refused_and_dense(clip)


def test_weight_decay_and_narrow_layers_take_the_dense_path() -> None:
    opt, _ = train(wide_model(), weight_decay=1e-3)
    assert opt.low_rank.num_low_rank == 0
    opt, _ = train(wide_model(), batch=64)  # R = 64 rows: dense rotation is cheaper
    assert opt.low_rank.num_low_rank == 0
    assert low_rank_pays(3, 30, 21) and not low_rank_pays(64, 30, 21)


def test_size_threshold_leaves_small_models_unhooked() -> None:
    """Below MIN_DENSE_WORK the hooks and probe cost more than the FLOPs saved: no recorder at all."""
    opt, _ = train(wide_model())
    assert opt.low_rank is None
    assert not low_rank_pays(3, 30, 21)
    wide = nn.Sequential(nn.Linear(200, 300), nn.ReLU(), nn.Linear(300, 3))
    opt = SecondOrderOptimizer(wide, lr=0.1, damping=0.1)
    assert list(opt.low_rank.modules) == ["0"]  # 300·201·501 multiply-adds; the 3-wide head is not
    assert low_rank_pays(8, 300, 201) and not low_rank_pays(8, 3, 301)


def test_gradient_accumulation_takes_the_dense_path() -> None:
    model = wide_model()
    opt = SecondOrderOptimizer(model, lr=0.1, damping=0.1, seed=0)
    x, y = torch.randn(6, 20, dtype=torch.float64), torch.randint(0, 3, (6,))

    def closure():
        opt.zero_grad()
        for xs, ys in ((x[:3], y[:3]), (x[3:], y[3:])):
            out = model(xs)
            nn.functional.cross_entropy(out, ys).div(2).backward()
        return torch.tensor(0.0), out
    for _ in range(3):
        opt.step(closure)
    assert opt.low_rank.num_low_rank == 0


def test_low_rank_solve_type_error() -> None:
    with pytest.raises(TypeError, match="low_rank_solve"):
        SecondOrderOptimizer(wide_model(), low_rank_solve="yes")


def test_recorder_skips_calls_whose_batch_cannot_pay() -> None:
    """A call whose batch is too large for the low-rank path is counted but not recorded: no
    output clone, no gradient hook (they cost ~10% of a K-FAC step on a wide MLP at B=512)."""
    lin = nn.Linear(20, 30).double()
    for batch, pays in ((3, True), (64, False)):
        x = torch.randn(batch, 20, dtype=torch.float64)
        with lowrank.recorder({"lin": lin}) as cap:
            out = lin(x)
        out.sum().backward()
        assert low_rank_pays(batch, 30, 21) is pays
        assert cap.calls == {"lin": 1}
        assert ("lin" in cap.records) is pays
        assert out.grad_fn is not None and (type(out.grad_fn).__name__ == "CloneBackward0") is pays
        if pays:
            assert lowrank.recorded_factors(cap, "lin")[0].shape == (batch, 30)


@pytest.mark.parametrize("pen", [1e-6, 1e-5])
def test_a_small_change_of_the_gradient_takes_the_dense_path(pen: float) -> None:
    """A closure whose loss carries a small L2 penalty (or that adds ``c·θ`` to ``p.grad``): the gradient
    differs from the recorded ``gᵀã`` by ~1e-6–1e-5 of it. The probe accepted mismatches up to 1e-3 of the
    gradient, so the low-rank path dropped that part, which ``(C + λI)⁻¹`` amplifies in the directions
    of little curvature (2% of the step at damping 1e-4); it now takes the dense path: the same step."""
    def penalty(model: nn.Module) -> None:
        for p in model.parameters():
            p.grad.add_(p.detach(), alpha=2 * pen)
    assert_refused_and_dense(penalty)


def test_float32_gradients_keep_the_low_rank_path() -> None:
    """The probe's tolerance is the rounding of float32 sums: clean float32 gradients are not refused."""
    fast, m1 = train(wide_model().float(), batch=3)
    assert fast.low_rank.num_low_rank >= 2 * 6 and fast.low_rank.num_rejected == 0


@pytest.mark.parametrize("scale", [1e20, 1e-22])
def test_huge_or_tiny_float32_gradients_changed_after_backward_take_the_dense_path(scale: float) -> None:
    """A float32 norm of 1e20-sized entries overflows (the tolerance was inf) and one of 1e-25-sized
    entries underflows (0 <= 0): a clip (p.grad halved) passed the probe. Norms are taken in float64."""
    def clip(model: nn.Module) -> None:
        for p in model.parameters():
            p.grad.mul_(0.5)
    torch.manual_seed(0)
    model = wide_model().float()
    opt = SecondOrderOptimizer(model, lr=1e-3 / max(scale, 1.0), damping=0.1, seed=0)
    x, y = torch.randn(3, 20, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2])

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.cross_entropy(out, y) * scale
        loss.backward()
        clip(model)
        return loss, out
    opt.step(closure)
    assert opt.low_rank.num_low_rank == 0 and opt.low_rank.num_rejected == 2


def test_autocast_bfloat16_gradients_keep_the_low_rank_path() -> None:
    """Under torch.autocast(bfloat16) a float32 gradient carries bfloat16's rounding: the probe's eps is
    the coarsest of the recorded tensors' and the gradient's (float32's refused every block)."""
    torch.manual_seed(0)
    model = wide_model().float()
    opt = SecondOrderOptimizer(model, lr=1e-3, damping=0.1, curv_update_interval=1, inv_update_interval=1, seed=0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(3, 20, generator=gen), torch.randint(0, 3, (3,), generator=gen)

        def closure():
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = nn.functional.cross_entropy(out.float(), y)
            loss.backward()
            return loss, out
        opt.step(closure)
    assert opt.low_rank.num_low_rank == 2 * 4 and opt.low_rank.num_rejected == 0


def test_probe_stream_is_its_own_and_is_saved() -> None:
    """The probe's generator is seeded apart from the label stream, saved in the checkpoint and restored
    (a checkpoint without it, or another seed, derives it from the loaded seed)."""
    opt, model = train(wide_model(), steps=3)
    assert opt.low_rank is not None and opt.low_rank.num_low_rank > 0
    assert not torch.equal(torch.Generator().manual_seed(opt.seed).get_state(), opt.low_rank.generator.get_state())
    state = opt.state_dict()
    fresh = SecondOrderOptimizer(model, lr=0.1, momentum=0.9, damping=0.1, curv_update_interval=2,
                                 inv_update_interval=2, seed=5)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.low_rank.generator.get_state(), opt.low_rank.generator.get_state())
    state["torchsso2"]["extra"].pop("low_rank_generator")  # an older checkpoint: derived from its seed (0)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.low_rank.generator.get_state(),
                       torch.Generator().manual_seed(lowrank.low_rank_seed(0)).get_state())
