"""VIOptimizer(curvature="reparam")'s flat-buffer step (torchsso2/optim/vi_flat.py) against the
general step it replaces: the same parameters, curvature, decomposition and momentum after every
step, through checkpoints, skipped steps, hand-overs and fallbacks.

The reference is the same optimizer with the flat path switched off (its ``step`` answers None,
so :meth:`VIOptimizer.step` runs the block-by-block code). Every comparison is bitwise except
where the KL clip is active: its ``Σ uᵀm`` is one dot product on the flat path and one sum per
parameter on the general one, so there the float64 results agree to 1e-12 relative.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from optim_helpers import batch, make_closure, tiny_mlp
from torchsso2 import VIOptimizer
from torchsso2.optim.skips import NonFiniteError

N_DATA = 100


def _pair(make_model: Callable[[], nn.Module], **kwargs: Any) -> Tuple[Tuple[nn.Module, VIOptimizer, List[bool]],
                                                                     Tuple[nn.Module, VIOptimizer]]:
    """Two identical models and optimizers: the first with the flat path (and a record of which
    steps took it), the second with it switched off."""
    settings = dict(dataset_size=N_DATA, curvature="reparam", seed=3)
    settings.update(kwargs)
    fast_model, slow_model = make_model(), make_model()
    fast, slow = VIOptimizer(fast_model, **settings), VIOptimizer(slow_model, **settings)
    taken: List[bool] = []
    original = fast._flat.step

    def spy(*args: Any) -> Any:
        out = original(*args)
        taken.append(out is not None)
        return out
    fast._flat.step = spy  # type: ignore[method-assign]
    slow._flat.step = lambda *args: None  # type: ignore[method-assign]
    return (fast_model, fast, taken), (slow_model, slow)


def _state(model: nn.Module, opt: VIOptimizer) -> Dict[str, Tensor]:
    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    for name, blk in opt.running.blocks.items():
        out[f"curvature {name}"] = blk.diagonal.clone()
        out[f"denom {name}"] = blk.decomposition["denom"].clone()
    for i, p in enumerate(model.parameters()):
        buf = opt.state[p].get("momentum_buffer")
        if buf is not None:
            out[f"momentum {i}"] = buf.clone()
    out["counters"] = torch.tensor([opt.num_steps, opt.running.num_updates])  # num_skipped: asserted apart
    return out


def _assert_same(a: Dict[str, Tensor], b: Dict[str, Tensor], exact: bool = True) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), f"{key} differs: max |Δ| {float((a[key] - b[key]).abs().max()):.3e}"
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-12, atol=1e-15, msg=key)


def _run(model: nn.Module, opt: VIOptimizer, steps: int, seed0: int = 0,
         closure_of: Optional[Callable[..., Any]] = None) -> List[float]:
    losses = []
    for t in range(steps):
        x, y = batch(seed=seed0 + t)
        closure = (closure_of or make_closure)(opt, model, x, y)
        loss, _ = opt.step(closure)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("settings", [
    dict(kl_clip=None),
    dict(),  # the default clip (inactive at these steps: ν = 1)
    dict(kl_clip=1e-7),  # active: ν < 1 at every step
    dict(kl_clip=None, kl_weighting=0.5, damping=0.3, prior_precision=2.0, momentum=0.5, ema_decay=0.9),
    dict(kl_weighting=0.3, curvature_init=0.2, lr=0.1),
], ids=["no-clip", "default-clip", "active-clip", "tempered-damped", "tempered-clip"])
def test_flat_step_equals_the_general_step(settings):
    (fm, fast, taken), (sm, slow) = _pair(tiny_mlp, **settings)
    exact = settings.get("kl_clip", 0.1) is None or "kl_clip" not in settings and "lr" not in settings
    for t in range(8):
        assert _run(fm, fast, 1, seed0=t) == _run(sm, slow, 1, seed0=t)
        _assert_same(_state(fm, fast), _state(sm, slow), exact=exact)
    assert taken == [False] + [True] * 7  # the first step (isotropic noise, no decomposition) is the general one
    assert fast.num_skipped == slow.num_skipped == 0
    moved = _state(fm, fast)
    assert not torch.equal(moved["param fc1.weight"], tiny_mlp().fc1.weight)


def test_active_clip_case_is_active():
    """The "active-clip" case above really scales the step (else it would test nothing the others do not)."""
    model = tiny_mlp()
    opt = VIOptimizer(model, dataset_size=N_DATA, curvature="reparam", seed=3, kl_clip=1e-7)
    before = [p.detach().clone() for p in model.parameters()]
    _run(model, opt, 2)
    free = tiny_mlp()
    opt_free = VIOptimizer(free, dataset_size=N_DATA, curvature="reparam", seed=3, kl_clip=None)
    _run(free, opt_free, 2)
    moved = sum(float((p.detach() - b).norm()) for p, b in zip(model.parameters(), before))
    moved_free = sum(float((p.detach() - b).norm()) for p, b in zip(free.parameters(), before))
    assert moved < 0.5 * moved_free


def test_flat_step_equals_the_general_step_in_float32_on_a_wider_mlp():
    """float32, the digits MLP's shape family (two Linear layers, ReLU): bitwise the same."""
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))
    (fm, fast, taken), (sm, slow) = _pair(make, kl_clip=None)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(24, 16, generator=gen), torch.randint(0, 5, (24,), generator=gen)) for _ in range(6)]

    def closure_of(opt: VIOptimizer, model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], Any]:
        def closure() -> Any:
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            return loss, out
        return closure
    for x, y in data:
        fast.step(closure_of(fast, fm, x, y))
        slow.step(closure_of(slow, sm, x, y))
        _assert_same(_state(fm, fast), _state(sm, slow))
    assert taken[1:] and all(taken[1:])


def test_checkpoint_round_trip_relinks():
    """state_dict after flat steps, loaded into a new optimizer: the next flat steps relink to the
    loaded state and continue exactly as the uninterrupted run (and as the general path)."""
    (fm, fast, taken), (sm, slow) = _pair(tiny_mlp)
    _run(fm, fast, 4)
    _run(sm, slow, 4)
    saved = copy.deepcopy(fast.state_dict())
    weights = copy.deepcopy(fm.state_dict())
    _run(fm, fast, 3, seed0=4)
    _run(sm, slow, 3, seed0=4)
    model2 = tiny_mlp()
    model2.load_state_dict(weights)
    opt2 = VIOptimizer(model2, dataset_size=N_DATA, curvature="reparam", seed=3)
    opt2.load_state_dict(saved)
    _run(model2, opt2, 3, seed0=4)
    _assert_same(_state(model2, opt2), _state(fm, fast))
    _assert_same(_state(fm, fast), _state(sm, slow))
    assert opt2._flat._link is not None  # it took the flat path after loading
    # and the loaded optimizer's own state_dict is a copy, not views into the live buffers
    sd = opt2.state_dict()
    before = {k: v["momentum_buffer"].clone() for k, v in sd["state"].items()}
    _run(model2, opt2, 1, seed0=7)
    assert all(not torch.equal(before[k], v["momentum_buffer"]) for k, v in sd["state"].items())  # torch.optim: live


def test_load_state_dict_mid_run_into_the_same_optimizer():
    """Loading an earlier checkpoint into the optimizer that holds linked flat buffers: the
    loaded values are used (not the stale flat copies)."""
    (fm, fast, _), (sm, slow) = _pair(tiny_mlp)
    _run(fm, fast, 3)
    _run(sm, slow, 3)
    saved_f, saved_s = copy.deepcopy(fast.state_dict()), copy.deepcopy(slow.state_dict())
    wf, ws = copy.deepcopy(fm.state_dict()), copy.deepcopy(sm.state_dict())
    _run(fm, fast, 3, seed0=3)
    _run(sm, slow, 3, seed0=3)
    fast.load_state_dict(saved_f)
    slow.load_state_dict(saved_s)
    fm.load_state_dict(wf)
    sm.load_state_dict(ws)
    _run(fm, fast, 2, seed0=10)
    _run(sm, slow, 2, seed0=10)
    _assert_same(_state(fm, fast), _state(sm, slow))


def test_deepcopy_continues_identically():
    model = tiny_mlp()
    opt = VIOptimizer(model, dataset_size=N_DATA, curvature="reparam", seed=3)
    _run(model, opt, 3)
    model2, opt2 = copy.deepcopy((model, opt))
    _run(model, opt, 3, seed0=3)
    _run(model2, opt2, 3, seed0=3)
    _assert_same(_state(model, opt), _state(model2, opt2))
    assert opt2._flat._link is not None and opt2._flat._link.curv.data_ptr() != opt._flat._link.curv.data_ptr()


@pytest.mark.parametrize("on_nonfinite", ["skip", "raise"])
def test_nonfinite_gradient_skips_with_the_state_untouched(on_nonfinite):
    """A NaN gradient at a flat step: skipped (or raised) with every tensor of the state, the step
    count and the noise stream as before; the next steps equal the general path's."""
    (fm, fast, taken), (sm, slow) = _pair(tiny_mlp, on_nonfinite=on_nonfinite)
    _run(fm, fast, 3)
    _run(sm, slow, 3)
    before = _state(fm, fast)

    def poisoned(opt: VIOptimizer, model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], Any]:
        def spoil() -> None:
            model.fc1.weight.grad[0, 0] = float("nan")
        return make_closure(opt, model, x, y, after_backward=spoil)
    for model, opt in ((fm, fast), (sm, slow)):
        if on_nonfinite == "raise":
            with pytest.raises(NonFiniteError):
                _run(model, opt, 1, seed0=3, closure_of=poisoned)
        else:
            _run(model, opt, 1, seed0=3, closure_of=poisoned)
    assert taken[-1] is True or on_nonfinite == "raise"
    _assert_same(_state(fm, fast), before)
    assert fast.num_steps == slow.num_steps == 3
    assert fast.num_skipped == slow.num_skipped == (1 if on_nonfinite == "skip" else 0)
    _run(fm, fast, 2, seed0=4)
    _run(sm, slow, 2, seed0=4)
    _assert_same(_state(fm, fast), _state(sm, slow))


def test_parameter_without_gradient_hands_over_to_the_general_step():
    """A step whose closure leaves one covered parameter without a gradient: the flat path hands the
    step to the general code (same result), and takes the following steps again."""
    (fm, fast, taken), (sm, slow) = _pair(tiny_mlp)
    _run(fm, fast, 2)
    _run(sm, slow, 2)

    def no_bias_grad(opt: VIOptimizer, model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], Any]:
        def drop() -> None:
            model.fc2.bias.grad = None
        return make_closure(opt, model, x, y, after_backward=drop)
    _run(fm, fast, 1, seed0=2, closure_of=no_bias_grad)
    _run(sm, slow, 1, seed0=2, closure_of=no_bias_grad)
    _assert_same(_state(fm, fast), _state(sm, slow))
    _run(fm, fast, 2, seed0=3)
    _run(sm, slow, 2, seed0=3)
    _assert_same(_state(fm, fast), _state(sm, slow))
    assert taken[-2:] == [True, True]


def test_overflowing_curvature_update_is_a_skipped_step_on_both_paths(caplog):
    """A curvature update whose denominator overflows (N·C = inf): a non-finite step on the flat path
    and on the general one alike (skipped, the running curvature and the momentum left as they were)."""
    (fm, fast, _), (sm, slow) = _pair(tiny_mlp, dataset_size=10 ** 6)
    _run(fm, fast, 2)
    _run(sm, slow, 2)
    for opt in (fast, slow):
        blk = next(iter(opt.running.blocks.values()))
        with torch.no_grad():
            blk.diagonal[0] = 1e303  # N·C overflows float64 at the next decomposition
    with caplog.at_level(logging.WARNING):
        _run(fm, fast, 1, seed0=2)
        _run(sm, slow, 1, seed0=2)
    assert fast.num_skipped == slow.num_skipped == 1
    _assert_same(_state(fm, fast), _state(sm, slow))
    assert sum("overflowed" in r.getMessage() for r in caplog.records) == 2
    assert next(iter(fast.running.blocks.values())).diagonal[0] == 1e303  # left as it was


@pytest.mark.parametrize("case", ["two-samples", "skip-module", "group-lrs", "intervals", "momentum-0"])
def test_fallbacks_run_the_general_step(case):
    """Settings the flat path does not cover are left to the general step (and train)."""
    model = tiny_mlp()
    kwargs: Dict[str, Any] = dict(dataset_size=N_DATA, curvature="reparam", seed=3)
    params = None
    if case == "two-samples":
        kwargs["num_mc_samples"] = 2
    elif case == "skip-module":
        kwargs["skip_modules"] = ["fc2"]
    elif case == "intervals":
        kwargs["curv_update_interval"] = 2
    elif case == "momentum-0":
        kwargs["momentum"] = 0.0
    if case == "group-lrs":
        params = [{"params": [model.fc1.weight, model.fc1.bias], "lr": 0.01},
                  {"params": [model.fc2.weight, model.fc2.bias], "lr": 0.02}]
    opt = VIOptimizer(model, params=params, **kwargs)
    taken: List[bool] = []
    original = opt._flat.step
    opt._flat.step = lambda *a: taken.append(original(*a) is not None) or None  # type: ignore[method-assign]
    before = [p.detach().clone() for p in model.parameters()]
    _run(model, opt, 4)
    expected = [False, False, True, False] if case == "intervals" else [False] * 4
    assert taken == expected if case != "intervals" else taken[:2] == [False, False]
    assert opt.num_skipped == 0
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_model_double_after_flat_steps_keeps_training():
    """``model.double()`` after flat steps: the flat buffers no longer fit (float32 curvature,
    float64 weights), so the general step runs and converts the momentum as before."""
    model = tiny_mlp(dtype=torch.float32)
    opt = VIOptimizer(model, dataset_size=N_DATA, curvature="reparam", seed=3)
    x, y = batch(seed=0)
    for _ in range(3):
        opt.step(make_closure(opt, model, x.float(), y))
    assert opt._flat._link is not None
    model.double()
    for _ in range(2):
        opt.step(make_closure(opt, model, x.double(), y))
    assert all(opt.state[p]["momentum_buffer"].dtype == torch.float64 for p in model.parameters())
    assert opt.num_skipped == 0


def test_lr_schedule_and_changed_settings_are_read_at_every_step():
    """A scheduler's lr, and momentum / kl_clip / ema_decay changed between steps, reach the flat
    step as they reach the general one."""
    (fm, fast, taken), (sm, slow) = _pair(tiny_mlp)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (fast, slow)]
    for t in range(6):
        if t == 3:
            for o in (fast, slow):
                o.param_groups[0]["momentum"] = 0.5
                o.kl_clip = None
                o.ema_decay = 0.9
        _run(fm, fast, 1, seed0=t)
        _run(sm, slow, 1, seed0=t)
        for s in scheds:
            s.step()
        _assert_same(_state(fm, fast), _state(sm, slow))
    assert taken[1:] == [True] * 5


def test_changed_prior_damping_and_dataset_size_reach_the_flat_step():
    """prior_precision, damping and dataset_size changed between steps reach the flat step (it keeps N,
    τδ + damping, their ratio and 1 − β as cached 0-dim tensors: they are rebuilt when a value changes)."""
    (fm, fast, taken), (sm, slow) = _pair(tiny_mlp)
    changes = {2: ("prior_precision", 3.0), 3: ("damping", 0.25), 4: ("dataset_size", 40), 5: ("ema_decay", 0.5)}
    for t in range(7):
        if t in changes:
            for o in (fast, slow):
                setattr(o, *changes[t])
        _run(fm, fast, 1, seed0=t)
        _run(sm, slow, 1, seed0=t)
        _assert_same(_state(fm, fast), _state(sm, slow))
    assert taken[1:] == [True] * 6


def test_flat_steps_after_a_failed_decomposition_equal_the_general_ones(caplog):
    """The flat step writes the next decomposition beside the current one and swaps them once it is
    checked: after a failed check the blocks keep the old one, and the next flat steps go on from it
    as the general steps do."""
    (fm, fast, taken), (sm, slow) = _pair(tiny_mlp, dataset_size=10 ** 6)
    _run(fm, fast, 3)
    _run(sm, slow, 3)
    kept = {name: blk.decomposition["denom"].clone() for name, blk in fast.running.blocks.items()}
    for opt in (fast, slow):
        blk = next(iter(opt.running.blocks.values()))
        with torch.no_grad():
            blk.diagonal[0] = 1e303
    with caplog.at_level(logging.WARNING):
        _run(fm, fast, 1, seed0=3)
        _run(sm, slow, 1, seed0=3)
    for name, blk in fast.running.blocks.items():
        assert torch.equal(blk.decomposition["denom"], kept[name])
    for opt in (fast, slow):
        blk = next(iter(opt.running.blocks.values()))
        with torch.no_grad():
            blk.diagonal[0] = 1.0
    for t in range(4, 7):
        _run(fm, fast, 1, seed0=t)
        _run(sm, slow, 1, seed0=t)
        _assert_same(_state(fm, fast), _state(sm, slow))
    assert taken[-3:] == [True] * 3


def test_autocast_closure_gives_the_general_result():
    """Under CPU autocast (bfloat16 forward, float32 weights and gradients) the flat step equals the
    general one."""
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    (fm, fast, taken), (sm, slow) = _pair(make)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 6, generator=gen), torch.randint(0, 3, (10,), generator=gen)
    for _ in range(4):
        for model, opt in ((fm, fast), (sm, slow)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                opt.step(make_closure(opt, model, x, y))
        _assert_same(_state(fm, fast), _state(sm, slow))
    assert taken[1:] == [True] * 3


def test_swapped_module_parameter_is_noticed():
    """A module's parameter replaced after flat steps (``model.fc2.bias = nn.Parameter(...)``): the flat
    buffers no longer back the model, so the general step runs, with the general step's result."""
    (fm, fast, taken), (sm, slow) = _pair(tiny_mlp)
    _run(fm, fast, 3)
    _run(sm, slow, 3)
    for model in (fm, sm):
        model.fc2.bias = nn.Parameter(model.fc2.bias.detach().clone() + 0.1)
    _run(fm, fast, 2, seed0=3)
    _run(sm, slow, 2, seed0=3)
    _assert_same(_state(fm, fast), _state(sm, slow))
    assert taken[-2:] == [False, False]


@pytest.mark.parametrize("noise_variance", [0.25, "learned"])
def test_flat_step_with_a_noise_variance_equals_the_general_step(noise_variance):
    """loss="mse" with a given σ² (the flat step weighs the data by N/σ², as the general one) and a
    learned one (its residuals are collected by the general step, which therefore runs)."""
    (fm, fast, taken), (sm, slow) = _pair(tiny_mlp, loss="mse", noise_variance=noise_variance, kl_clip=None)
    gen = torch.Generator().manual_seed(5)
    for t in range(6):
        x, _ = batch(seed=t)
        y = torch.randn(x.shape[0], 3, generator=gen, dtype=torch.float64)
        fast.step(make_closure(fast, fm, x, y, loss="mse"), targets=y)
        slow.step(make_closure(slow, sm, x, y, loss="mse"), targets=y)
        _assert_same(_state(fm, fast), _state(sm, slow))
    assert fast.noise.variance == slow.noise.variance
    if noise_variance == "learned":
        assert fast.noise.variance != 1.0 and not any(taken)
    else:
        assert taken == [False] + [True] * 5


def test_the_flat_path_keeps_no_copies_of_the_general_paths_reciprocals() -> None:
    """The first step (general path) caches 1/denom and 1/√denom in each block; the flat buffers then
    take over with their own, and the blocks' caches held the old three parameter-sized tensors alive
    for the optimizer's life (a 512-wide MLP's VI state was 14× its parameters, 11× without them)."""
    torch.manual_seed(0)
    model = tiny_mlp()
    opt = VIOptimizer(model, dataset_size=N_DATA, curvature="reparam", seed=3)
    x, y = batch()
    for _ in range(4):
        opt.step(make_closure(opt, model, x, y))
    assert opt._flat._link is not None  # the flat path runs
    for blk in opt.running.blocks.values():
        assert blk._reciprocal_cache._value is None and blk._reciprocal_cache._sources == ()
    # a predict() between steps samples on the general path, which fills the caches again: the next step
    # drops them (they stayed for the rest of the run: 11 parameter-sized buffers instead of 9)
    opt.predict(x, num_samples=2)
    assert any(blk._reciprocal_cache._value is not None for blk in opt.running.blocks.values())
    opt.step(make_closure(opt, model, x, y))
    for blk in opt.running.blocks.values():
        assert blk._reciprocal_cache._value is None
