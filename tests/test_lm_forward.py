"""torchsso2/optim/lm_forward.py: in adaptive mode with ``step(closure, targets=y)``, the Levenberg–
Marquardt rule takes the loss after the update from one forward of the recorded input instead of a
second closure call; the same values as the closure; the closure is called again wherever its loss
is not the model's mean NLL of its own output and the targets."""
from __future__ import annotations

import warnings
from typing import Callable, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curvature.likelihoods import mean_nll
from curvature.options import LossType
from torchsso2.optim import SecondOrderOptimizer
from torchsso2.optim.lm_forward import forward_only_closure


def _problem(seed: int = 0, dropout: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (24,), generator=g)
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 10), nn.Tanh()] + ([nn.Dropout(0.2)] if dropout else []) + [nn.Linear(10, 4)]
    return nn.Sequential(*layers).double(), x, y


def _optimizer(model: nn.Module, **kw) -> SecondOrderOptimizer:
    return SecondOrderOptimizer(model, approx="kfac", damping=0.1, adaptive_damping=True, damping_adaptation_interval=2,
                                curv_update_interval=2, inv_update_interval=4, use_adaptive_learning_rate=True,
                                use_adaptive_momentum=True, seed=0, **kw)


def _dampings(opt: SecondOrderOptimizer, closure, y: Tensor, targets: bool, steps: int = 8) -> List[float]:
    """The damping after each of ``steps`` steps, given ``targets=y`` or not."""
    dampings = []
    for _ in range(steps):
        opt.step(closure, targets=y) if targets else opt.step(closure)
        dampings.append(opt.damping)
    return dampings


def _closure(opt, model, x, y, calls: List[int], loss_of: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
             returned: Callable[[Tensor], Tensor] = lambda out: out) -> Callable[[], Tuple[Tensor, Tensor]]:
    def closure() -> Tuple[Tensor, Tensor]:
        calls.append(1)
        opt.zero_grad()
        out = model(x)
        loss = loss_of(out, y)
        loss.backward()
        return loss, returned(out)
    return closure


def _train(targets: bool, steps: int = 8, **closure_kw):
    model, x, y = _problem()
    opt = _optimizer(model)
    calls: List[int] = []
    closure = _closure(opt, model, x, y, calls, **closure_kw)
    dampings = []
    for _ in range(steps):
        opt.step(closure, targets=y) if targets else opt.step(closure)
        dampings.append(opt.damping)
    return model, opt, len(calls), dampings


def test_with_targets_the_lm_steps_need_no_second_closure_call_and_train_the_same() -> None:
    ref_model, ref_opt, ref_calls, ref_damping = _train(targets=False)
    model, opt, calls, damping = _train(targets=True)
    assert ref_calls == 8 + 4 and calls == 8  # LM every 2 steps: 4 extra closure calls without targets
    assert damping == pytest.approx(ref_damping, rel=1e-12) and len(set(ref_damping)) > 1  # the damping moved
    assert opt.lm.last_rho == pytest.approx(ref_opt.lm.last_rho, rel=1e-9)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_forward_only_loss_is_the_closures_loss_at_the_current_parameters() -> None:
    model, x, y = _problem(seed=3)
    opt = _optimizer(model)
    calls: List[int] = []
    closure = _closure(opt, model, x, y, calls)
    opt.step(closure, targets=y)
    with opt.adaptive.record(model):  # what step() records: the closure's forward
        loss, out = closure()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # "the update"
    fwd = forward_only_closure(opt, y, loss, out)
    assert fwd is not None
    new_loss, new_out = fwd()
    expected = F.cross_entropy(model(x), y)  # brute force: the user's loss at the new parameters
    assert not new_loss.requires_grad and new_out.shape == (24, 4)
    torch.testing.assert_close(new_loss, expected.detach(), rtol=1e-13, atol=0)
    assert abs(float(new_loss) - float(loss.detach())) > 1e-3  # the parameters did move the loss


@pytest.mark.parametrize("kw", [
    dict(loss_of=lambda out, y: F.cross_entropy(out, y) + 1e-3 * out.pow(2).mean()),  # another loss
    dict(loss_of=lambda out, y: F.cross_entropy(out / 2, y), returned=lambda out: out / 2),  # not the model's output
    dict(loss_of=lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1)),
], ids=["extra-term", "transformed-output", "label-smoothing"])
def test_a_closure_whose_loss_is_not_the_mean_nll_of_the_model_output_is_called_again(kw) -> None:
    _, _, calls, _ = _train(targets=True, **kw)
    assert calls == 8 + 4


def test_gradient_accumulation_or_wrong_targets_fall_back_to_the_closure() -> None:
    model, x, y = _problem()
    opt = _optimizer(model)
    calls: List[int] = []

    def accumulate() -> Tuple[Tensor, Tensor]:  # two forwards in one closure
        calls.append(1)
        opt.zero_grad()
        first, second = model(x[:12]), model(x[12:])
        loss = 0.5 * (F.cross_entropy(first, y[:12]) + F.cross_entropy(second, y[12:]))
        loss.backward()
        return loss, torch.cat([first, second])

    for _ in range(4):
        opt.step(accumulate, targets=y)
    assert len(calls) == 4 + 2
    model, x, y = _problem()
    opt = _optimizer(model)
    calls.clear()
    wrong = torch.roll(y, 1)  # targets that are not the closure's labels
    closure = _closure(opt, model, x, y, calls)
    for _ in range(4):
        opt.step(closure, targets=wrong)
    assert len(calls) == 4 + 2


def test_dropout_draws_as_the_closure_would() -> None:
    """The forward-only evaluation consumes the RNG as the closure's forward does (its backward draws
    nothing): with a dropout layer training takes the same path either way."""
    results = []
    for targets in (False, True):
        model, x, y = _problem(dropout=True)
        opt = _optimizer(model)
        calls: List[int] = []
        closure = _closure(opt, model, x, y, calls)
        torch.manual_seed(7)
        for _ in range(6):
            opt.step(closure, targets=y) if targets else opt.step(closure)
        results.append(([p.detach().clone() for p in model.parameters()], opt.damping, torch.rand(1)))
    (pa, da, ra), (pb, db, rb) = results
    assert da == pytest.approx(db, rel=1e-12) and torch.equal(ra, rb)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_mean_nll_is_the_loss_the_check_compares_with() -> None:
    out, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 2, 1, 1, 0])
    torch.testing.assert_close(mean_nll(LossType.CROSS_ENTROPY, out, y), F.cross_entropy(out, y), rtol=1e-15, atol=0)


def test_with_several_ranks_the_way_is_agreed_over_the_ranks() -> None:
    """Every rank takes the forward or the closure alike (a closure on some ranks only could wait for
    a collective of the others): the flag is averaged over the ranks, the forward needs all of them."""
    from types import SimpleNamespace
    model, x, y = _problem()
    opt = _optimizer(model)
    calls: List[int] = []
    closure = _closure(opt, model, x, y, calls)
    opt.step(closure, targets=y)
    with opt.adaptive.record(model):
        loss, out = closure()
    assert forward_only_closure(opt, y, loss, out) is not None
    opt.comm = SimpleNamespace(world_size=2)
    fed: List[float] = []
    opt._mean_over_ranks = lambda v: fed.append(v) or v  # the other rank agrees
    assert forward_only_closure(opt, y, loss, out) is not None and fed == [1.0]
    opt._mean_over_ranks = lambda v: fed.append(v) or 0.5 * (v + 0.0)  # the other rank must call its closure
    assert forward_only_closure(opt, y, loss, out) is None and fed == [1.0, 1.0]
    assert forward_only_closure(opt, torch.roll(y, 1), loss, out) is None and fed[-1] == 0.0  # still joins


def test_a_plain_sequential_cnn_takes_the_fast_forward_with_the_same_loss(monkeypatch) -> None:
    """For a plain nn.Sequential the forward-only loss comes from sequential_forward (channels-last
    max pooling): the same output as the model's own forward, and training equals the closure's."""
    from torchsso2.optim import sequential_jvp

    def cnn_problem():
        g = torch.Generator().manual_seed(2)
        x, y = torch.randn(16, 36, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)
        torch.manual_seed(2)
        model = nn.Sequential(nn.Unflatten(1, (1, 6, 6)), nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(36, 3)).double()
        return model, x, y

    model, x, _ = cnn_problem()
    with torch.no_grad():
        assert torch.equal(sequential_jvp.sequential_forward(model, x), model(x))
    fast = []
    original = sequential_jvp.sequential_forward
    monkeypatch.setattr(sequential_jvp, "sequential_forward", lambda *a: fast.append(1) or original(*a))
    results = []
    for targets in (False, True):
        model, x, y = cnn_problem()
        opt = _optimizer(model)
        calls: List[int] = []
        closure = _closure(opt, model, x, y, calls)
        for _ in range(6):
            opt.step(closure, targets=y) if targets else opt.step(closure)
        results.append(([p.detach().clone() for p in model.parameters()], opt.damping, len(calls)))
    (pa, da, ca), (pb, db, cb) = results
    assert (ca, cb) == (9, 6) and len(fast) == 3 and da == pytest.approx(db, rel=1e-12)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("classes", [2, 10, 15, 16, 40])
def test_the_lm_loss_of_few_classes_is_the_cross_entropy(classes) -> None:
    """_mean_nll: below 16 classes the log-softmax over the transposed view (faster on CPU), at or
    above torch's cross-entropy; both the mean NLL of the float64 logits to rounding, row- or class-major."""
    from torchsso2.optim.lm_forward import _mean_nll
    g = torch.Generator().manual_seed(classes)
    out = torch.randn(33, classes, generator=g, dtype=torch.float64) * 4
    y = torch.randint(0, classes, (33,), generator=g)
    expected = -torch.log_softmax(out, 1)[torch.arange(33), y].mean()
    for logits in (out, out.t().contiguous().t()):
        torch.testing.assert_close(_mean_nll(LossType.CROSS_ENTROPY, logits, y), expected, rtol=1e-14, atol=0)
    torch.testing.assert_close(_mean_nll(LossType.CROSS_ENTROPY, out.float(), y), expected.float(), rtol=1e-6, atol=0)


class _DictOut(nn.Module):
    """The problem's model returning ``{"logits": ...}`` (an output object), for an ``output_selector``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> dict:
        return {"logits": self.inner(x)}


def _assert_called_again(train: Callable[[bool], Tuple[int, List[float]]]) -> None:
    """``train(targets)`` gives (closure calls, dampings) over 8 steps: given targets, the closure is called again
    at every LM step (as without them) and the damping follows a run without targets."""
    calls, dampings = train(True)
    ref_calls, ref_dampings = train(False)
    assert calls == ref_calls == 8 + 4
    assert dampings == pytest.approx(ref_dampings, rel=1e-12)


def _dict_problem():
    """The problem's model as :class:`_DictOut`, its optimizer with ``output_selector=lambda o: o["logits"]``, the
    data and a list to count closure calls in."""
    inner, x, y = _problem()
    model = _DictOut(inner)
    calls: List[int] = []
    return model, _optimizer(model, output_selector=lambda o: o["logits"]), x, y, calls


@pytest.mark.parametrize("returned", ["pick", "pick_view"])
def test_a_closure_returning_the_selectors_pick_takes_one_forward_too(returned: str) -> None:
    """``return loss, out["logits"]`` (the selector's pick, or the same view taken again) is the model's output as
    the LM rule's one forward and the adaptive loss check need it: no second closure call and the same steps as a
    closure returning the output object; with another loss it is called again and the check warns."""
    def train(returned: str, extra: float = 0.0):
        model, opt, x, y, calls = _dict_problem()

        def closure():
            calls.append(1)
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out["logits"], y) + extra * out["logits"].pow(2).mean()
            loss.backward()
            return loss, {"output": out, "pick": out["logits"], "pick_view": out["logits"].reshape(-1, 4)}[returned]
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for _ in range(8):
                opt.step(closure, targets=y)
        return model, len(calls), [str(w.message) for w in rec]
    ref, ref_calls, said = train("output")
    model, calls, said_pick = train(returned)
    assert calls == ref_calls == 8 and said == said_pick == []
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _, calls, said = train(returned, extra=1e-2)
    assert calls == 8 + 4
    assert sum("adaptive learning rate: the closure's loss" in s for s in said) == 1, said


@pytest.mark.parametrize("returned", ["output", "pick"])
def test_an_output_changed_in_place_in_the_closure_is_called_again(returned: str) -> None:
    """A closure dividing the logits by a temperature in place (``div_``) returns memory that equals the mean NLL
    of its loss, but a forward of the recorded input does not repeat the division: the one-forward evaluation
    would give the LM rule a rho of another function (measured: 8.5 against 2.2). The output's version counters
    tell: the closure is called again, and the damping follows a run without targets."""
    def train(targets: bool):
        model, opt, x, y, calls = _dict_problem()

        def closure():
            calls.append(1)
            opt.zero_grad()
            out = model(x)
            logits = out["logits"].div_(3.0)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            return loss, (out if returned == "output" else logits)
        dampings = _dampings(opt, closure, y, targets)
        return len(calls), dampings
    _assert_called_again(train)


def test_a_forward_under_autocast_whose_logits_are_upcast_is_called_again() -> None:
    """A model ending in ``.float()`` (logits upcast, as Hugging Face models do) run under autocast in the closure
    passes the output's dtype test, but a forward of the recorded input runs outside autocast: the closure is
    called again, and the damping follows a run without targets."""
    class Upcast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))

        def forward(self, x: Tensor) -> Tensor:
            return self.inner(x).float()

    def train(targets: bool):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(24, 6, generator=g), torch.randint(0, 4, (24,), generator=g)
        torch.manual_seed(0)
        model = Upcast()
        opt = _optimizer(model)
        calls: List[int] = []

        def closure():
            calls.append(1)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            return loss, out
        dampings = _dampings(opt, closure, y, targets)
        return len(calls), dampings
    _assert_called_again(train)
