"""The hand-written J·v pass on the activations recorded in the model's own forward
(torchsso2/optim/sequential_record.py): the same products as computing the forward again, and
torch.func.jvp's (float64); recorded values changed in place since (``nn.ReLU(inplace=True)``
after a Tanh), parameters updated in place, or an autocast forward are not used."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

from curvature.options import LossType
from optim_helpers import make_closure
from torchsso2.optim import SecondOrderOptimizer, sequential_jvp, sequential_record
from torchsso2.optim.adaptive import InputRecorder, ggn_gram
from torchsso2.optim.sequential_jvp import sequential_jvps


def _models() -> Dict[str, nn.Sequential]:
    torch.manual_seed(0)
    return {
        "cnn": nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=False), nn.Tanh(), nn.AvgPool2d(2),
                             nn.Identity(), nn.Flatten(), nn.Linear(24, 5), nn.Sigmoid(),
                             nn.Linear(5, 3, bias=False)).double(),
        # in-place ReLUs after a convolution and a Linear: their outputs are the layers' outputs, changed
        "cnn_inplace": nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(inplace=True),
                                     nn.MaxPool2d(2), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(inplace=True),
                                     nn.MaxPool2d(2), nn.Flatten(), nn.Linear(24, 5), nn.ReLU(inplace=True),
                                     nn.Linear(5, 3)).double(),
        "conv1d": nn.Sequential(nn.Unflatten(1, (2, 32)), nn.Conv1d(2, 3, 5, stride=2, padding=2), nn.ReLU(),
                                nn.MaxPool1d(3, stride=2, padding=1), nn.AvgPool1d(2), nn.Flatten(),
                                nn.Linear(12, 3)).double(),
        # a convolution straight into a max pooling and into a reshape, a Linear into a reshape then an
        # in-place ReLU (which changes the Linear's output through the view; nothing reads that output)
        "views": nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 3, 3, padding=1), nn.MaxPool2d(2),
                               nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(8, 6), nn.Unflatten(1, (2, 3)),
                               nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(6, 3)).double(),
        # an in-place ReLU after a Tanh changes the Tanh's output, whose values the tangent needs (the
        # backward would refuse it, but nothing stops a forward alone)
        "tanh_inplace": nn.Sequential(nn.Linear(64, 7), nn.Tanh(), nn.ReLU(inplace=True), nn.Linear(7, 3)).double(),
    }


def _tangents(model: nn.Module, k: int, seed: int) -> Tuple[List[Dict[str, Tensor]], Dict[int, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    dirs = [{n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in params.items()} for _ in range(k)]
    return dirs, {id(p): torch.stack([d[n] for d in dirs]) for n, p in params.items()}


def _assert_torch_func_jvps(model: nn.Module, x: Tensor, dirs: List[Dict[str, Tensor]], jv: Tensor) -> None:
    """``jv[i]`` is ``torch.func.jvp`` of the model at ``x`` along the parameter direction ``dirs[i]``."""
    names = [n for n, _ in model.named_parameters()]
    f = lambda *ps: torch.func.functional_call(model, dict(zip(names, ps)), (x,))  # noqa: E731
    for i, d in enumerate(dirs):
        _, ref = torch.func.jvp(f, tuple(p.detach() for p in model.parameters()), tuple(d[n] for n in names))
        torch.testing.assert_close(jv[i], ref, rtol=1e-10, atol=1e-12)


def _record(model: nn.Sequential, x: Tensor, backward: bool = True) -> Tuple[InputRecorder, Tensor]:
    """The model's forward with grad and a backward, as a closure runs it, under the adaptive recorder."""
    rec = InputRecorder()
    with rec.record(model):
        out = model(x)
        if backward:
            out.square().sum().backward()
    return rec, out


@pytest.mark.parametrize("name", ["cnn", "cnn_inplace", "conv1d", "views"])
def test_jvps_from_the_recorded_forward_equal_the_recomputed_ones_and_torch_func_jvp(name):
    model = _models()[name]
    x = torch.randn(10, 64, dtype=torch.float64)
    rec, out = _record(model, x)
    assert rec.activations is not None
    acts = rec.activations.usable(model, 0)
    assert acts is not None and sequential_jvp._reads_unchanged(model, acts)  # the recorded values are taken
    pools = [i for i, m in enumerate(model) if isinstance(m, nn.MaxPool2d)]
    assert sorted(acts.indices) == pools  # every 2-d max pooling's argmax came from its autograd node
    dirs, tangents = _tangents(model, 3, 1)
    rec_out, rec_jv = sequential_jvps(model, x, tangents, acts)
    new_out, new_jv = sequential_jvps(model, x, tangents)
    assert rec_out is acts.outputs[-1]
    torch.testing.assert_close(rec_out, new_out, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(rec_jv, new_jv, rtol=1e-12, atol=1e-13)
    _assert_torch_func_jvps(model, x, dirs, rec_jv)


def test_a_recorded_value_changed_in_place_is_not_used():
    """Tanh then ReLU(inplace=True): the Tanh's recorded output holds the ReLU's values now; the pass
    computes the forward itself and its tangent is still torch.func.jvp's."""
    model = _models()["tanh_inplace"]
    x = torch.randn(10, 64, dtype=torch.float64)
    rec, _ = _record(model, x, backward=False)
    acts = rec.activations.usable(model, 0)
    assert acts is not None and not acts.unchanged(1)
    assert not sequential_jvp._reads_unchanged(model, acts)
    dirs, tangents = _tangents(model, 2, 2)
    _, jv = sequential_jvps(model, x, tangents, acts)
    _assert_torch_func_jvps(model, x, dirs, jv)


def test_a_record_is_not_used_after_the_parameters_changed_or_for_another_call():
    model = _models()["cnn"]
    x = torch.randn(10, 64, dtype=torch.float64)
    rec, _ = _record(model, x)
    assert rec.activations.usable(model, 0) is not None
    assert rec.activations.usable(model, 1) is None  # one forward was recorded
    with torch.no_grad():
        model[1].weight.add_(1.0)
    assert rec.activations.usable(model, 0) is None
    _, tangents = _tangents(model, 2, 3)
    acts = rec.activations.records[0]  # passed anyway: the input must be the recorded one
    assert sequential_jvps(model, x.clone(), tangents, acts)[0] is not acts.outputs[-1]


def test_pass_params_are_the_model_parameters_of_every_supported_model():
    for name, model in _models().items():
        assert sequential_jvp.supports_model(model), name
        got, want = sequential_record.pass_params(model), tuple(model.parameters())
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want)), name


def test_a_record_is_not_used_after_a_parameter_was_replaced_even_at_the_same_version():
    """A new ``nn.Parameter`` (other values) whose version counter happens to equal the old one's:
    the versions alone would not see it; the record keeps the parameter tensors themselves."""
    model = _models()["cnn"]
    x = torch.randn(10, 64, dtype=torch.float64)
    rec, _ = _record(model, x)
    assert rec.activations.usable(model, 0) is not None
    old = model[1].weight
    new = nn.Parameter(old.detach() + 1.0)
    with torch.no_grad():
        while new._version < old._version:
            new.mul_(1.0)
    assert new._version == old._version
    model[1].weight = new
    assert rec.activations.usable(model, 0) is None
    model[1].weight = old
    assert rec.activations.usable(model, 0) is not None


def test_autocast_activations_are_not_used():
    """An autocast forward's bfloat16 activations: the pass computes in the parameters' dtype."""
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    rec = InputRecorder()
    with rec.record(model), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(5, 8))
    assert rec.activations.records[0].outputs[0].dtype == torch.bfloat16
    assert rec.activations.usable(model, 0) is None


def test_a_forward_with_grad_records_every_max_pooling_argmax_on_this_torch():
    """The argmax is read from max_pool2d's autograd node (a private attribute): on the torch this
    suite runs, every MaxPool2d of a forward with grad has it, equal to the indices max_pool2d returns.
    A torch that renames the attribute makes the pass pool again (correct, slower): this test says so."""
    model = _models()["cnn_inplace"]
    x = torch.randn(6, 64, dtype=torch.float64)
    rec, _ = _record(model, x)
    acts = rec.activations.usable(model, 0)
    pools = [i for i, m in enumerate(model) if isinstance(m, nn.MaxPool2d)]
    assert acts is not None and sorted(acts.indices) == pools
    h = x
    with torch.no_grad():
        for i, m in enumerate(model):
            if i in pools:
                _, idx = torch.nn.functional.max_pool2d(h, m.kernel_size, m.stride, return_indices=True)
                torch.testing.assert_close(acts.indices[i], idx, rtol=0, atol=0)
            h = m(h)


def test_a_forward_without_grad_is_not_recorded():
    """A no-grad call inside the closure (a metric on other inputs) is not the batch's loss: neither its
    inputs nor its activations enter the quadratic model."""
    model = _models()["cnn"]
    x = torch.randn(6, 64, dtype=torch.float64)
    rec = InputRecorder()
    with rec.record(model):
        with torch.no_grad():
            model(torch.randn(3, 64, dtype=torch.float64))
        model(x)
    assert len(rec.calls) == 1 and rec.calls[0][0][0] is x and len(rec.outputs) == 1
    acts = rec.activations.usable(model, 0)
    assert acts is not None and acts.indices  # the training forward's, with its max-pool argmax
    _, tangents = _tangents(model, 2, 4)
    torch.testing.assert_close(sequential_jvps(model, x, tangents, acts)[1], sequential_jvps(model, x, tangents)[1],
                               rtol=1e-12, atol=1e-13)


def test_models_the_pass_does_not_support_record_nothing():
    rec = InputRecorder()
    model = nn.Sequential(nn.Linear(6, 3), nn.Dropout(0.5))
    with rec.record(model):
        model(torch.randn(2, 6))
    assert rec.activations is None and not model[0]._forward_hooks  # and the hooks are gone


@pytest.mark.parametrize("name", ["cnn_inplace", "input_changed"])
def test_adaptive_training_on_recorded_activations_equals_computing_the_forward_again(name, monkeypatch):
    """12 adaptive K-FAC steps (LM damping every 2 steps, curvature every 3, float64) with the J·v
    pass on the closure's activations give the parameters, coefficients and damping of the pass that
    computes the forward itself: with in-place ReLUs (the recorded values are taken), and with a
    closure that changes its input in place after the backward (not taken: the pass runs the forward
    on the changed input, as it always did)."""
    taken: List[bool] = []
    original = sequential_jvp._reads_unchanged
    monkeypatch.setattr(sequential_jvp, "_reads_unchanged", lambda m, r: taken.append(original(m, r)) or taken[-1])

    def run(record: bool):
        if not record:
            monkeypatch.setattr(sequential_record.ActivationRecorder, "usable", lambda *a: None)
        model = _models()["cnn_inplace"]
        opt = SecondOrderOptimizer(model, approx="kfac", damping=0.01, adaptive_damping=True, seed=0,
                                   use_adaptive_learning_rate=True, use_adaptive_momentum=True,
                                   curv_update_interval=3, inv_update_interval=5, damping_adaptation_interval=2)
        g = torch.Generator().manual_seed(4)
        coefs: List[Optional[float]] = []
        for _ in range(12):
            x = torch.randn(16, 64, generator=g, dtype=torch.float64)
            y = torch.randint(0, 3, (16,), generator=g)
            closure = make_closure(opt, model, x, y, after_backward=(lambda x=x: x.mul_(1.5))
                                   if name == "input_changed" else None)
            opt.step(closure, targets=y)
            coefs += [opt.adaptive.last["learning_rate"], opt.adaptive.last["momentum"], opt.damping]
        monkeypatch.setattr(sequential_record.ActivationRecorder, "usable", original_usable)
        return [p.detach().clone() for p in model.parameters()], coefs

    original_usable = sequential_record.ActivationRecorder.usable
    rec_params, rec_coefs = run(True)
    assert taken == [name == "cnn_inplace"] * 12
    new_params, new_coefs = run(False)
    for a, b in zip(rec_params, new_params):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert rec_coefs == pytest.approx(new_coefs, rel=1e-9)
    assert len(set(rec_coefs[2::3])) > 1  # the LM rule moved the damping


@pytest.mark.parametrize("loss", [LossType.CROSS_ENTROPY, LossType.MSE])
def test_gram_of_two_recorded_forwards_equals_the_dual_number_path(loss, monkeypatch):
    """A closure running two micro-batches: each forward's own record gives its J·v, and the Gram
    over both equals the dual-number path's (float64)."""
    model = _models()["cnn_inplace"]
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    rec = InputRecorder()
    with rec.record(model):
        for n in (9, 5):
            model(torch.randn(n, 64, dtype=torch.float64)).square().sum().backward()
    taken: List[bool] = []
    original = sequential_jvp._reads_unchanged
    monkeypatch.setattr(sequential_jvp, "_reads_unchanged", lambda m, r: taken.append(original(m, r)) or taken[-1])
    g = torch.Generator().manual_seed(2)
    dirs = [[torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params] for _ in range(2)]
    fast = ggn_gram(model, rec.calls, names, params, dirs, loss, lambda o: o, identity_select=True,
                    activations=rec.activations)
    assert taken == [True, True]
    dual = ggn_gram(model, rec.calls, names, params, dirs, loss, lambda o: o)
    torch.testing.assert_close(fast, dual, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("setting", ["ggn", "hessian", "output_selector"])
def test_activations_are_recorded_only_where_the_pass_uses_them(setting, monkeypatch):
    """The Hessian's products and a model output behind an ``output_selector`` take other paths:
    no child hooks in their forwards (each costs a few µs a forward)."""
    attached: List[int] = []
    original = sequential_record.ActivationRecorder.attach
    monkeypatch.setattr(sequential_record.ActivationRecorder, "attach",
                        lambda self, m: attached.append(1) or original(self, m))
    model = _models()["cnn_inplace"]
    kwargs = {"hessian": dict(curvature="hessian", approx="diag"),
              "output_selector": dict(output_selector=lambda out: out)}.get(setting, {})
    opt = SecondOrderOptimizer(model, damping=0.01, use_adaptive_learning_rate=True, **kwargs)
    x = torch.randn(8, 64, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    for _ in range(2):
        opt.step(make_closure(opt, model, x, y), targets=y)
    assert len(attached) == (2 if setting == "ggn" else 0)


@pytest.mark.parametrize("interval", [1, 3])
def test_the_recorded_activations_are_dropped_after_every_adaptive_step(interval):
    """Solved or reused coefficients (``adaptive_coefficients_interval``): a step leaves no activations behind."""
    model = _models()["cnn_inplace"]
    x, y = torch.randn(16, 64, dtype=torch.float64), torch.randint(0, 3, (16,))
    opt = SecondOrderOptimizer(model, approx="kfac", damping=0.1, use_adaptive_learning_rate=True,
                               use_adaptive_momentum=True, adaptive_coefficients_interval=interval)
    closure = make_closure(opt, model, x, y)
    for _ in range(6):
        opt.step(closure, targets=y)
        assert opt.adaptive.recorder.activations is None


def test_an_adaptive_optimizer_deep_copies_after_a_step_and_the_copy_steps_alike():
    """``copy.deepcopy((model, opt))`` after a step (the recorder held the closure's output, a non-leaf
    tensor): the copy's recorder starts empty, and the copy and the original take the same next step."""
    import copy

    model = _models()["cnn_inplace"]
    x, y = torch.randn(16, 64, dtype=torch.float64), torch.randint(0, 3, (16,))
    opt = SecondOrderOptimizer(model, approx="kfac", damping=0.1, use_adaptive_learning_rate=True,
                               use_adaptive_momentum=True, adaptive_damping=True, damping_adaptation_interval=1)
    opt.step(make_closure(opt, model, x, y), targets=y)
    model2, opt2 = copy.deepcopy((model, opt))
    assert opt2.adaptive.recorder.calls == [] and opt2.adaptive.recorder.keep_activations
    for m, o in ((model, opt), (model2, opt2)):
        o.step(make_closure(o, m, x, y), targets=y)
    for a, b in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert opt2.adaptive.last == opt.adaptive.last and opt2.damping == opt.damping
