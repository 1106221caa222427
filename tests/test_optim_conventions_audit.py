"""torch.optim conventions the optimizers keep (found by an audit against torch.optim's behaviour).

* ``copy.deepcopy((model, opt))`` after an LR scheduler wrapped ``opt.step``: the copy steps itself
  (the wrapper of the original is not copied, as with torch.optim's own optimizers).
* pickling the optimizer object is a TypeError naming ``state_dict()``.
* a parameter of a curvature block frozen mid-run (a Linear's bias): the block still preconditions
  the others, ``(C + λI)⁻¹ [g | 0]``; VIOptimizer does not sample the frozen parameter.
* VIOptimizer has no weight decay: a non-zero group ``weight_decay`` is a ValueError naming
  ``prior_precision``.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer

X = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 3, (32,), generator=torch.Generator().manual_seed(1))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _closure(model: nn.Module, opt: torch.optim.Optimizer):
    def closure():
        opt.zero_grad()
        out = model(X)
        loss = F.cross_entropy(out, Y)
        loss.backward()
        return loss, out
    return closure


@pytest.mark.parametrize("face", ["second_order", "vi"])
def test_deepcopy_after_a_scheduler_steps_the_copy(face):
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.05, seed=0) if face == "second_order" else \
        VIOptimizer(model, dataset_size=100, approx="kfac", seed=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    for _ in range(3):
        opt.step(_closure(model, opt))
        sched.step()
    model2, opt2 = copy.deepcopy((model, opt))
    before, before2 = model[0].weight.detach().clone(), model2[0].weight.detach().clone()
    opt2.step(_closure(model2, opt2))
    assert torch.equal(model[0].weight, before)  # the original did not move
    assert (model2[0].weight - before2).abs().max() > 0
    assert (opt.num_steps, opt2.num_steps) == (3, 4)


def test_deepcopy_drops_the_hooks_as_torch_optim_does():
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.05)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append(1))
    _, opt2 = copy.deepcopy((model, opt))
    assert len(opt2._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_pre_hooks) == 1


def test_pickling_the_optimizer_names_state_dict():
    model = _mlp()
    opt = SecondOrderOptimizer(model)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)


def _freeze_bias_run(approx: str):
    """Two steps, freeze the last Linear's bias, one more step (curvature and decomposition every step)."""
    model = _mlp()
    opt = SecondOrderOptimizer(model, approx=approx, lr=0.1, momentum=0.0, kl_clip=None, damping=0.1,
                               curv_update_interval=1, inv_update_interval=1)
    for _ in range(2):
        opt.step(_closure(model, opt))
    model[2].bias.requires_grad_(False)
    model[2].bias.grad = None
    weight, bias = model[2].weight.detach().clone(), model[2].bias.detach().clone()
    opt.step(_closure(model, opt))
    return model, opt, weight, bias


@pytest.mark.parametrize("approx", ["kfac", "diag", "full"])
def test_second_order_frozen_bias_keeps_the_weight_preconditioned(approx):
    model, opt, weight, bias = _freeze_bias_run(approx)
    assert torch.equal(model[2].bias, bias)
    blk = opt.running.blocks["2"]
    g = model[2].weight.grad
    expected = blk.solve([g, torch.zeros_like(bias)])[0]  # the step's solve (the block the step decomposed)
    update = (weight - model[2].weight.detach()) / 0.1
    assert (update - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert (update - g).abs().max() > 0.1 * g.abs().max()  # not the plain gradient


def test_hessian_with_a_layer_frozen_in_part_names_the_parameters():
    """The Hessian differentiates the loss with respect to every covered parameter of a module: a bias
    frozen mid-run is a ValueError naming it (docs/validation.md), the parameters unchanged; the whole
    module frozen steps on (it keeps its curvature)."""
    model = _mlp()
    opt = SecondOrderOptimizer(model, curvature="hessian", approx="diag", lr=0.1, damping=1.0)
    opt.step(_closure(model, opt), targets=Y)
    model[2].bias.requires_grad_(False)
    model[2].bias.grad = None
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"curvature='hessian'.*\['2\.bias'\] do not require a gradient: freeze "
                                         r"the whole module"):
        opt.step(_closure(model, opt), targets=Y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model[2].weight.requires_grad_(False)
    model[2].weight.grad = None
    opt.step(_closure(model, opt), targets=Y)
    assert torch.equal(model[2].weight, before[2]) and not torch.equal(model[0].weight, before[0])


@pytest.mark.parametrize("approx", ["kfac", "diag"])
def test_vi_frozen_bias_is_not_sampled(approx):
    model = _mlp()
    opt = VIOptimizer(model, dataset_size=100, approx=approx, seed=0)
    opt.step(_closure(model, opt))
    model[2].bias.requires_grad_(False)
    bias = model[2].bias.detach().clone()
    seen = []

    def closure():
        seen.append(model[2].bias.detach().clone())
        return _closure(model, opt)()
    opt.step(closure)
    assert torch.equal(seen[0], bias)  # the forward saw the frozen bias as it is
    assert torch.equal(model[2].bias, bias)


def test_vi_group_weight_decay_is_refused():
    model = _mlp()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if n.endswith("bias")]
    with pytest.raises(ValueError, match="prior_precision"):
        VIOptimizer(model, dataset_size=100, params=[{"params": decay, "weight_decay": 0.5},
                                                     {"params": rest, "weight_decay": 0.0}])
    opt = VIOptimizer(model, dataset_size=100, params=[{"params": decay, "weight_decay": 0.0}, {"params": rest}])
    opt.param_groups[0]["weight_decay"] = 1e-4  # set by hand later: refused at the next step
    with pytest.raises(ValueError, match="weight_decay"):
        opt.step(_closure(model, opt))


# ---- GradScaler: an overflowing step leaves no trace ---------------------------------------------
def _amp_train(make, order, bad):
    """Train on the batches ``order``; the batch ``bad`` overflows (its scaled loss times inf)."""
    model = _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10 ** 6)
    opt = make(model, scaler)
    for i in order:
        g = torch.Generator().manual_seed(100 + i)
        xb, yb = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)

        def closure():
            opt.zero_grad()
            out = model(xb)
            loss = F.cross_entropy(out, yb)
            scaler.scale(loss * (float("inf") if i == bad else 1.0)).backward()
            return loss, out
        opt.step(closure)
        scaler.update()
        scaler.update(new_scale=1024.0)  # the same scale for both runs
    return torch.cat([p.detach().flatten() for p in model.parameters()]), opt


@pytest.mark.parametrize("make", [
    lambda m, sc: SecondOrderOptimizer(m, lr=0.05, grad_scaler=sc, seed=0),  # fisher_mc: the label stream
    lambda m, sc: SecondOrderOptimizer(m, lr=0.05, curvature="fisher", curv_update_interval=2,
                                       inv_update_interval=2, grad_scaler=sc),  # the schedule
    lambda m, sc: VIOptimizer(m, dataset_size=100, grad_scaler=sc, seed=0, momentum_debias=True),
    lambda m, sc: VIOptimizer(m, dataset_size=100, approx="kfac", grad_scaler=sc, seed=0),
], ids=["so-fisher_mc", "so-intervals", "vi-diag-debias", "vi-kfac"])
def test_amp_overflow_is_as_if_the_batch_was_never_seen(make):
    skipped, opt = _amp_train(make, range(6), 3)
    omitted, _ = _amp_train(make, [0, 1, 2, 4, 5], None)
    assert opt.num_amp_skipped == 1 and opt.num_steps == 5
    assert torch.equal(skipped, omitted)


@pytest.mark.parametrize("make", [
    lambda m, sc: SecondOrderOptimizer(m, lr=0.05, grad_scaler=sc, curv_update_interval=10, inv_update_interval=100),
    lambda m, sc: VIOptimizer(m, dataset_size=100, approx="kfac", grad_scaler=sc, seed=0),
], ids=["so-10/100", "vi-kfac"])
def test_amp_overflow_at_the_first_step(make):
    """The usual fp16 start (the first scale overflows) with intervals > 1: the next step estimates
    the curvature (it had raised 'no curvature estimate yet' at every later step)."""
    first, opt = _amp_train(make, range(4), 0)
    later, _ = _amp_train(make, [1, 2, 3], None)
    assert opt.num_steps == 3 and opt.running.blocks
    assert torch.equal(first, later)


@pytest.mark.parametrize("face", ["second_order", "vi"])
def test_amp_unscale_inside_the_closure_to_clip(face):
    """torch's AMP clipping recipe: scaler.unscale_(opt) and clip_grad_norm_ in the closure; step()
    does not unscale again (it had raised 'unscale_() has already been called')."""
    model = _mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = SecondOrderOptimizer(model, grad_scaler=scaler) if face == "second_order" else \
        VIOptimizer(model, dataset_size=100, grad_scaler=scaler, seed=0)
    norms = []

    def closure():
        opt.zero_grad()
        out = model(X)
        loss = F.cross_entropy(out, Y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)))
        return loss, out
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    for _ in range(2):
        opt.step(closure)
        scaler.update()
    grad_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert grad_norm <= 1e-3 * (1 + 1e-5) < norms[-1]  # the clipped, unscaled gradient reached the step
    assert opt.num_amp_skipped == 0
    assert (torch.cat([p.detach().flatten() for p in model.parameters()]) - before).abs().max() > 0


# ---- state-dict hooks see the whole dict, as torch.optim's ---------------------------------------
def test_state_dict_hooks_see_the_whole_dict():
    model = _mlp()
    two = SecondOrderOptimizer(model, lr=0.05, seed=0, params=[{"params": model[0].parameters()},
                                                               {"params": model[2].parameters()}])
    two.step(_closure(model, two))
    seen = {}
    two.register_state_dict_post_hook(lambda o, sd: seen.update(post=sorted(sd)))  # returns None: sd kept
    checkpoint = two.state_dict()
    assert seen["post"] == ["param_groups", "state", "torchsso2"]

    def merge_groups(opt, sd):  # a migration hook: a 2-group checkpoint into a 1-group optimizer
        seen["pre"] = sorted(sd)
        g0, g1 = sd["param_groups"]
        return {**sd, "param_groups": [{**g0, "params": g0["params"] + g1["params"]}]}
    one = SecondOrderOptimizer(model, lr=0.05, seed=0)
    one.register_load_state_dict_pre_hook(merge_groups)
    loaded = []
    one.register_load_state_dict_post_hook(lambda o: loaded.append(o.num_steps))
    one.load_state_dict(checkpoint)
    assert seen["pre"] == ["param_groups", "state", "torchsso2"] and loaded == [1]
    assert len(one.param_groups) == 1 and one.num_steps == 1
    one.step(_closure(model, one))


# ---- a covered module the forward does not call (multi-task heads) ----------------------------------
class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head_a = nn.Linear(16, 3)
        self.head_b = nn.Linear(16, 3)

    def forward(self, x, task: str):
        return (self.head_a if task == "a" else self.head_b)(torch.relu(self.body(x)))


def _heads_step(opt, model, task, x=X):
    def closure():
        opt.zero_grad()
        out = model(x, task)
        loss = F.cross_entropy(out, Y)
        loss.backward()
        return loss, out
    opt.step(closure)


def test_second_order_head_not_called_keeps_its_curvature():
    import curvature
    torch.manual_seed(0)
    model = _TwoHeads().double()
    x64 = X.double()
    opt = SecondOrderOptimizer(model, curvature="fisher", lr=0.05, curv_update_interval=1, inv_update_interval=10)

    def step(task):
        _heads_step(opt, model, task, x64)
    b_before = [p.detach().clone() for p in model.head_b.parameters()]
    step("a")
    assert set(opt.running.blocks) == {"body", "head_a"}
    assert all(torch.equal(p, q) for p, q in zip(model.head_b.parameters(), b_before))  # no gradient: unchanged
    a_block = [t.clone() for t in opt.running.blocks["head_a"].tensors()]
    # head b's block will be this step's estimate (its first): the curvature of the model calling head b
    expected = curvature.compute(nn.Sequential(model.body, nn.ReLU(), model.head_b), x64, Y, kind="fisher",
                                 approx="kfac").blocks["2"]
    step("b")  # head_b's first estimate, decomposed at once although the interval is 10
    assert set(opt.running.blocks) == {"body", "head_a", "head_b"}
    assert all(torch.equal(t, u) for t, u in zip(opt.running.blocks["head_a"].tensors(), a_block))  # not decayed
    assert opt.running.blocks["head_b"].decomposition is not None
    assert not all(torch.equal(p, q) for p, q in zip(model.head_b.parameters(), b_before))
    got = opt.running.blocks["head_b"]
    torch.testing.assert_close(got.A, expected.A, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.G, expected.G, rtol=1e-12, atol=1e-14)


def test_uncalled_head_with_gradient_accumulation_and_vi():
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = SecondOrderOptimizer(model, lr=0.05)

    def closure():  # two micro-batches, one per head
        opt.zero_grad()
        total = 0.0
        for task, (xs, ys) in zip("ab", zip(X.chunk(2), Y.chunk(2))):
            out = model(xs, task)
            loss = F.cross_entropy(out, ys) / 2
            loss.backward()
            total = total + loss.detach()
        return total, out
    opt.step(closure)
    assert set(opt.running.blocks) == {"body", "head_a", "head_b"}
    vi = VIOptimizer(_TwoHeads(), dataset_size=100, approx="kfac", seed=0, curv_update_interval=1, inv_update_interval=10)
    for task in "aab":
        _heads_step(vi, vi.model, task)
    assert set(vi.running.blocks) == {"body", "head_a", "head_b"}
    assert all(b.decomposition is not None for b in vi.running.blocks.values())


def test_uncalled_module_used_functionally_is_still_an_error():
    """A module not called whose parameters the output still depends on (a functional use) stays a
    ValueError: its curvature would be missed, not zero."""
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(8, 16)
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            return F.linear(torch.relu(self.body(x)), self.head.weight, self.head.bias)
    model = Functional()
    opt = SecondOrderOptimizer(model, lr=0.05)
    with pytest.raises(ValueError, match="head"):
        opt.step(_closure(model, opt))


def test_layers_called_with_their_input_as_a_keyword():
    """``self.fc(input=x)`` is legal PyTorch: the curvature capture and KFACPreconditioner's hooks take
    the keyword input (an IndexError before), with the same result as the positional call."""
    from optim_helpers import kfac_sgd_train, make_closure

    class Net(nn.Module):
        def __init__(self, keyword: bool) -> None:
            super().__init__()
            self.fc1, self.fc2, self.keyword = nn.Linear(8, 6), nn.Linear(6, 3), keyword

        def forward(self, x):
            h = torch.tanh(self.fc1(input=x) if self.keyword else self.fc1(x))
            return self.fc2(input=h) if self.keyword else self.fc2(h)

    result = {}
    for keyword in (False, True):
        torch.manual_seed(0)
        model = Net(keyword)
        opt = SecondOrderOptimizer(model, lr=0.05, curvature="fisher")
        for _ in range(2):
            opt.step(make_closure(opt, model, X, Y))
        torch.manual_seed(0)
        result[keyword] = (torch.cat([p.detach().flatten() for p in model.parameters()]),
                           kfac_sgd_train(Net(keyword), X, Y, factor_update_steps=1, inv_update_steps=1))
    assert torch.equal(result[False][0], result[True][0]) and torch.equal(result[False][1], result[True][1])


# ---- lifecycle: reparametrized layers, torch.func on a hooked model, predict's stream -----------------
@pytest.mark.parametrize("old_api", [True, False])
def test_weight_norm_layers_are_named_with_the_skip(old_api):
    """A covered Linear under weight_norm (old hook-based or new parametrize API) is a ValueError naming
    the skip (the old API's diagonal had silently dropped weight_g / weight_v: 16 of 160 entries)."""
    import curvature
    torch.manual_seed(0)
    first = nn.utils.weight_norm(nn.Linear(8, 6)) if old_api else nn.utils.parametrizations.weight_norm(nn.Linear(8, 6))
    model = nn.Sequential(first, nn.ReLU(), nn.Linear(6, 3))
    with pytest.raises(ValueError, match=r"skip_modules=\['\^0\$'\]"):
        curvature.compute(model, X, Y, approx="diag")
    with pytest.raises(ValueError, match="weight"):
        SecondOrderOptimizer(model)
    opt = SecondOrderOptimizer(model, skip_modules=["^0$"])  # the named skip works
    opt.step(_closure(model, opt))
    assert list(opt.engine.layouts) == ["2"]


def test_kfac_preconditioner_survives_torch_func_on_the_model():
    """Per-sample gradients with vmap(grad(functional_call(model))) on a hooked model: the hooks skip
    the transform's tensors (they had stored them and broke every later step); the run is unchanged."""
    from torch.func import functional_call, grad, vmap

    from optim_helpers import kfac_sgd_train

    def poke(model):
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, x, y):
            return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])
        vmap(grad(loss), in_dims=(None, 0, 0))(params, X, Y)

    plain = kfac_sgd_train(_mlp(), X, Y, factor_update_steps=1, inv_update_steps=1)
    model = _mlp()
    from torchsso2 import KFACPreconditioner
    opt, pre = torch.optim.SGD(model.parameters(), lr=0.1), KFACPreconditioner(model, factor_update_steps=1,
                                                                               inv_update_steps=1)
    for _ in range(3):
        poke(model)
        opt.zero_grad()
        F.cross_entropy(model(X), Y).backward()
        pre.step()
        opt.step()
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), plain)


@pytest.mark.parametrize("approx", ["kfac", "diag"])
def test_vi_predict_between_steps_leaves_training_unchanged(approx):
    """predict() draws from its own stream (seed and step count), not the label / noise streams, so an
    evaluation between steps changes nothing (it had moved a fisher_mc K-FAC run by 1e-6)."""
    runs = []
    for evaluate in (False, True):
        model = _mlp()
        opt = VIOptimizer(model, dataset_size=100, approx=approx, seed=0, curv_update_interval=1,
                          inv_update_interval=1)
        for step in range(6):
            opt.step(_closure(model, opt))
            if evaluate and step % 2 == 0:
                first = opt.predict(X, num_samples=4)
                assert torch.equal(first, opt.predict(X, num_samples=4))  # reproducible at a step
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1])
    fresh = VIOptimizer(_mlp(), dataset_size=100, seed=0)  # before the first step: the isotropic start
    assert fresh.predict(X, num_samples=4).shape == (32, 3)


def test_vi_per_group_prior_and_dict_output_fail_early():
    """A per-group prior_precision was accepted and ignored; a dict-returning model without
    output_selector trained silently and failed only at predict()."""
    model = _mlp()
    with pytest.raises(ValueError, match="per-group prior"):
        VIOptimizer(model, dataset_size=100, params=[{"params": list(model.parameters()), "prior_precision": 0.0}])

    class DictNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _mlp()

        def forward(self, x):
            return {"logits": self.inner(x)}
    net = DictNet()

    def closure_of(opt):
        def closure():
            opt.zero_grad()
            out = net(X)
            loss = F.cross_entropy(out["logits"], Y)
            loss.backward()
            return loss, out
        return closure
    opt = VIOptimizer(net, dataset_size=100)
    with pytest.raises(TypeError, match="output_selector"):
        opt.step(closure_of(opt))
    fixed = VIOptimizer(net, dataset_size=100, output_selector=lambda out: out["logits"])
    fixed.step(closure_of(fixed))
    assert fixed.predict(X, num_samples=2).shape == (32, 3)
