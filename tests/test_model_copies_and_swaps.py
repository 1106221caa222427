"""The optimizers' hooks and a model that is copied, saved or changed while they exist.

* A copy of the model taken inside the closure (a "best model" snapshot) carried the step's hooks for
  good: torch copies a module's hook dictionaries, and the step removes its hooks from the original
  only. The copy's forwards then recorded into the finished step's capture (plain SGD on the copy
  raised "called more than once"), and the copy could not be saved whole. A copy now gets hooks
  that do nothing (``curvature.hook_marks.LocalHook``); the same holds for KFACPreconditioner's
  lasting hooks, so ``torch.save(model)`` works while one is attached.
* A KFACPreconditioner still attached when another preconditioner, or an optimizer whose curvature
  runs backward passes of its own, is built on the same layers is named in a UserWarning.
* A covered module replaced after the optimizer was built is a ValueError at the next estimate; the
  replaced parameters, gradient-less and out of the model, a UserWarning.
"""
from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)


def _roundtrip(module: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _sgd_steps(model: nn.Module, x, y, n: int = 3) -> float:
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        sgd.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        sgd.step()
    return float(loss.detach())


@pytest.mark.parametrize("face", ["second_order", "vi", "kfac"])
def test_a_copy_taken_during_a_step_is_an_ordinary_module(face: str) -> None:
    x, y = _data()
    model = _model()
    snapshot = {}
    if face == "kfac":
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        pre = KFACPreconditioner(model)
        sgd.zero_grad()
        F.cross_entropy(model(x), y).backward()
        snapshot["best"] = copy.deepcopy(model)
        pre.step()
        sgd.step()
    else:
        opt = SecondOrderOptimizer(model, lr=0.05) if face == "second_order" else \
            VIOptimizer(model, dataset_size=100, lr=0.01)

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            snapshot.setdefault("best", copy.deepcopy(model))
            return loss
        opt.step(closure)
    best = snapshot["best"]
    bare = copy.deepcopy(best)
    for m in bare.modules():  # the same weights without any hook: what the copy must behave as
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
    bare_again = copy.deepcopy(bare)
    loaded = _roundtrip(best)  # a hook that is a local function could not be pickled
    assert _sgd_steps(best, x, y) == _sgd_steps(bare, x, y)
    assert _sgd_steps(loaded, x, y) == _sgd_steps(bare_again, x, y)
    # a new optimizer of the same face trains the copy as it trains a fresh model with its weights
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh = SecondOrderOptimizer(best, lr=0.05)

        closure2 = make_closure(fresh, best, x, y)
        fresh.step(closure2)


def test_saving_a_model_with_a_preconditioner_attached_keeps_the_preconditioner_working() -> None:
    x, y = _data()
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model)
    loaded = _roundtrip(model)
    for _ in range(2):
        sgd.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        sgd.step()
    factors = [(layer.a_factor.clone(), layer.g_factor.clone()) for layer in pre.layers.values()]
    F.cross_entropy(loaded(x), y).backward()  # a factor step: a live hook would record and fold it
    assert not any(pre._mini_steps.values())
    for layer, (a, g) in zip(pre.layers.values(), factors):
        assert torch.equal(layer.a_factor, a) and torch.equal(layer.g_factor, g)


def _kfac_step(model: nn.Module, pre: KFACPreconditioner, x, y) -> None:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    pre.step()


def test_a_preconditioner_still_attached_is_named_at_the_first_step() -> None:
    """At the first step, not at construction: ``pre = KFACPreconditioner(model)`` run twice (a notebook
    cell) frees the first one only when the second is bound, and is no such case."""
    x, y = _data()
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = KFACPreconditioner(model)
        pre = KFACPreconditioner(model)
        _kfac_step(model, pre, x, y)
    first = pre
    second = KFACPreconditioner(model)
    with pytest.warns(UserWarning, match=r"KFACPreconditioner: 1 other KFACPreconditioner\(s\) attached to layers "
                                         r"\['0', '2'\]"):
        _kfac_step(model, second, x, y)
    opt = SecondOrderOptimizer(model, lr=0.1)

    closure = make_closure(opt, model, x, y)
    with pytest.warns(UserWarning, match=r"SecondOrderOptimizer: 2 other KFACPreconditioner\(s\) attached"):
        opt.step(closure)
    ef = SecondOrderOptimizer(model, lr=0.1, curvature="empirical_fisher")  # any kind: both would precondition
    ef_closure = make_closure(ef, model, x, y)
    with pytest.warns(UserWarning, match=r"SecondOrderOptimizer: 2 other KFACPreconditioner\(s\) attached"):
        ef.step(ef_closure)
    first.remove_hooks()
    second.remove_hooks()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none attached any more
        third = KFACPreconditioner(model)
        _kfac_step(model, third, x, y)


def test_a_free_parameter_outside_the_model_is_not_taken_for_a_removed_layer() -> None:
    """A learned temperature given in params= but held outside the model, unused on some steps."""
    x, y = _data()
    model = _model()
    tau = nn.Parameter(torch.ones(()))
    opt = SecondOrderOptimizer(model, lr=0.05, params=list(model.parameters()) + [tau])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            def closure():
                opt.zero_grad(set_to_none=True)
                out = model(x) * (tau if i % 2 == 0 else 1.0)
                loss = F.cross_entropy(out, y)
                loss.backward()
                return loss
            opt.step(closure)


def test_a_replaced_head_is_an_error_for_an_estimating_step_and_a_warning_for_vi_diag() -> None:
    x, y = _data()
    model = _model()
    opt = SecondOrderOptimizer(model, lr=0.05)

    closure = make_closure(opt, model, x, y)
    opt.step(closure)
    model[2] = nn.Linear(16, 4)
    with pytest.raises(ValueError, match=r"covered modules \['2'\] are no longer the model's own"):
        opt.step(closure)

    model = _model()
    vi = VIOptimizer(model, dataset_size=100, lr=0.01)

    vi_closure = make_closure(vi, model, x, y)
    vi.step(vi_closure)
    model[2] = nn.Linear(16, 4)
    with pytest.warns(UserWarning, match=r"2 of its parameters \(shapes \[\(4, 16\), \(4,\)\]\) have no gradient and "
                                         "are no longer in the model"):
        vi.step(vi_closure)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per situation
        vi.step(vi_closure)


def test_a_layer_added_with_add_param_group_then_replaced_is_named() -> None:
    x, y = _data()
    model = _model()
    opt = SecondOrderOptimizer(model, lr=0.05)
    closure = make_closure(opt, model, x, y)
    opt.step(closure)
    model.append(nn.Tanh())
    model.append(nn.Linear(4, 4))  # a layer added later, with its parameters in a new group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (add_param_group's own warning: the layer takes the plain update)
        opt.add_param_group({"params": list(model[4].parameters())})
        opt.step(closure)
    model[4] = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="no longer in the model"):
        opt.step(closure)


class _Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 6)
        self.heads = nn.ModuleDict({"a": nn.Linear(6, 3), "b": nn.Linear(6, 3)})

    def forward(self, x: torch.Tensor, head: str = "a") -> torch.Tensor:
        return self.heads[head](torch.relu(self.trunk(x)))


def _heads_step(model: nn.Module, pre: KFACPreconditioner, head: str = "a") -> None:
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    model.zero_grad()
    nn.functional.cross_entropy(model(x, head), y).backward()
    pre.step()


def test_kfac_a_replaced_layer_is_an_error_at_the_next_factor_step() -> None:
    """``model.heads["b"] = nn.Linear(...)``: the old layer is gone and the new one is not registered (it would
    never be preconditioned). Before, nothing said so."""
    model = _Heads()
    pre = KFACPreconditioner(model)
    _heads_step(model, pre, "b")
    model.heads["b"] = nn.Linear(6, 3)
    steps = pre.steps
    with pytest.raises(ValueError, match=r"registered layers \['heads.b'\] are no longer in the model and it holds "
                                         r"layers \['heads.b'\] that are not registered"):
        _heads_step(model, pre, "a")
    assert pre.steps == steps  # the step did not count
    pre.remove_hooks()


def test_kfac_a_removed_or_wrapped_layer_is_left_alone() -> None:
    """A head dropped without a replacement, or wrapped in place (``Sequential(head, ...)``, as adapters do), is
    no error: the wrapped one is still preconditioned through the wrapper."""
    model = _Heads()
    pre = KFACPreconditioner(model)
    _heads_step(model, pre, "b")
    model.heads["b"] = nn.Sequential(model.heads["b"], nn.Identity())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _heads_step(model, pre, "a")
        _heads_step(model, pre, "b")
        del model.heads["b"]
        _heads_step(model, pre, "a")
    assert pre.steps == 4


def test_kfac_parameters_assigned_after_construction_are_a_warning_while_an_old_one_is_held() -> None:
    """``load_state_dict(..., assign=True)`` re-creates the parameters: the preconditioner follows them, but an
    optimizer built before holds the old ones and no longer moves the model (silently, as under torch.optim):
    a warning, once. Built after the load, the optimizer holds the new ones: no warning."""
    model = _Heads()
    pre = KFACPreconditioner(model)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    _heads_step(model, pre)
    model.load_state_dict({k: v.clone() for k, v in _Heads().state_dict().items()}, assign=True)
    with pytest.warns(UserWarning, match=r"the parameters of registered layers \['trunk', 'heads.a', 'heads.b'\] "
                                         r"were replaced since it was built"):
        _heads_step(model, pre)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _heads_step(model, pre)
    copy_model, copy_pre = copy.deepcopy((model, pre))  # a copy's parameters are its own from the start
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _heads_step(copy_model, copy_pre)
    del stale

    model = _Heads()
    pre = KFACPreconditioner(model)
    _heads_step(model, pre)
    model.load_state_dict({k: v.clone() for k, v in _Heads().state_dict().items()}, assign=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built after the load, as the warning advises
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _heads_step(model, pre)
        opt.step()
        model.load_state_dict({k: v.clone() for k, v in _Heads().state_dict().items()}, assign=True)
    with pytest.warns(UserWarning, match="were replaced since it was built"):  # now opt holds the old ones
        _heads_step(model, pre)


def test_kfac_a_layer_unfrozen_after_construction_is_not_a_replacing_one() -> None:
    """A layer frozen at construction (not registered) and unfrozen later, with a registered head dropped: not
    a replaced layer (it was in the model at construction)."""
    model = _Heads()
    model.trunk.requires_grad_(False)
    pre = KFACPreconditioner(model)
    _heads_step(model, pre, "b")
    model.trunk.requires_grad_(True)
    del model.heads["b"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _heads_step(model, pre, "a")


def test_kfac_a_preconditioner_pickles_with_its_factors() -> None:
    """The weak references to the construction-time parameters (the replaced-parameters warning) are left
    out of the pickle and made anew from the unpickled model: pickling keeps working as it did."""
    import pickle

    model = _Heads()
    pre = KFACPreconditioner(model)
    _heads_step(model, pre)
    loaded = pickle.loads(pickle.dumps(pre))
    assert loaded.steps == pre.steps
    for name, layer in pre.layers.items():
        if layer.has_factors():  # (heads.b was not called)
            assert torch.equal(loaded.layers[name].a_factor, layer.a_factor)
        else:
            assert not loaded.layers[name].has_factors()
        assert loaded._born[name][0]() is loaded.layers[name].module.weight


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "deepcopy_of_a_copy"])
def test_a_preconditioner_held_by_its_model_survives_a_copy_and_a_pickle(how: str) -> None:
    """``model.precond = pre``, then ``copy.deepcopy(model)`` (also of such a copy: a "best model" restored)
    or a pickle round trip: the copy's preconditioner is made while its model is not built yet; it attaches
    then, or at its first ``step()`` (a warning: that step preconditions with the copied factors without
    updating them), and records from there on."""
    import copy
    import io
    x, y = _data()
    model = _model()
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
    model.precond = pre
    _kfac_step(model, pre, x, y)
    if how == "pickle":
        buf = io.BytesIO()
        torch.save(model, buf)
        twin = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    else:
        twin = copy.deepcopy(model)
        if how == "deepcopy_of_a_copy":
            twin = copy.deepcopy(twin)
    assert twin.precond is not pre and twin.precond._model is twin
    twin.zero_grad()
    F.cross_entropy(twin(x), y).backward()
    if twin.precond._handles:  # attached at once: this batch was recorded
        twin.precond.step()
    else:
        raw = [p.grad.clone() for p in twin.parameters()]
        with pytest.warns(UserWarning, match="attached at this first step.*preconditions with the copied factors"):
            twin.precond.step()
        assert not all(torch.equal(g, p.grad) for g, p in zip(raw, twin.parameters()))  # preconditioned
        assert all(torch.isfinite(p.grad).all() for p in twin.parameters())
    twin.zero_grad()
    F.cross_entropy(twin(x), y).backward()
    assert all(dict(layer.fold_counts) == {"A": 1, "G": 1} for layer in twin.precond.layers.values())
    twin.precond.step()  # records and preconditions
    assert all(dict(layer.fold_counts) == {"A": 0, "G": 0} for layer in pre.layers.values())  # (the original: none)


def test_a_shallow_copy_adds_no_second_set_of_hooks() -> None:
    import copy
    x, y = _data()
    model = _model()
    pre = KFACPreconditioner(model)
    hooks = {i: len(m._forward_hooks) for i, m in enumerate(model)}
    copy.copy(pre)
    assert {i: len(m._forward_hooks) for i, m in enumerate(model)} == hooks
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert all(c == {"A": 1, "G": 1} for c in (dict(layer.fold_counts) for layer in pre.layers.values()))
