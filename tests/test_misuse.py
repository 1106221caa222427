"""Silent misuse of the optimizers becomes a clear error or warning (torchsso2/optim/misuse.py)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer


def _mlp(bn: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8)] + ([nn.BatchNorm1d(8)] if bn else []) + [nn.ReLU(), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def _faces(model: nn.Module, **kw):
    return {"sso": SecondOrderOptimizer(model, lr=0.05, approx="kfac", **kw),
            "vi": VIOptimizer(model, dataset_size=50, lr=0.01, approx="diag", **kw)}


X, Y = torch.randn(16, 4), torch.randint(0, 3, (16,))


def _vec(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("face", ["sso", "vi"])
@pytest.mark.parametrize("zero", ["none", "none_after_a_step", "zeros", "no_zero_grad"])
def test_closure_without_backward_raises(face: str, zero: str) -> None:
    model = _mlp()
    opt = _faces(model)[face]

    def good():
        opt.zero_grad()
        out = model(X)
        loss = F.cross_entropy(out, Y)
        loss.backward()
        return loss, out

    def no_backward():
        if zero.startswith("none"):
            opt.zero_grad(set_to_none=True)
        elif zero == "zeros":
            opt.zero_grad(set_to_none=False)
        out = model(X)
        return F.cross_entropy(out, Y), out

    if zero != "none":
        opt.step(good)  # gradients exist from an earlier step: stale ones (or .grad set to None) must not pass
    before = _vec(model)
    with pytest.raises(RuntimeError, match="did not call backward"):
        opt.step(no_backward)
    if zero != "zeros":
        assert torch.equal(_vec(model), before)


def _closure(opt, model, loss_fn, x=None):
    def closure():
        opt.zero_grad()
        out = model(X if x is None else x)
        loss = loss_fn(out)
        loss.backward()
        return loss, out
    return closure


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_mse_loss_with_cross_entropy_optimizer_warns(face: str) -> None:
    model = _mlp()
    opt = _faces(model)[face]
    with pytest.warns(UserWarning, match="not a function of softmax"):
        opt.step(_closure(opt, model, lambda out: F.mse_loss(out, F.one_hot(Y, 3).float())))
    with warnings.catch_warnings():  # once per optimizer
        warnings.simplefilter("error")
        opt.step(_closure(opt, model, lambda out: F.mse_loss(out, F.one_hot(Y, 3).float())))


class _ClassesAtDim1(nn.Module):
    """Logits in F.cross_entropy's own layout ``[N, C, L]`` (classes at dim 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).movedim(-1, 1)


@pytest.mark.parametrize("face", ["sso", "vi-diag", "vi-kfac"])
def test_logits_with_the_classes_at_dim_1_are_named(face: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 5, 2), torch.randint(0, 3, (8, 5))
    make = {"sso": lambda m, **kw: SecondOrderOptimizer(m, lr=0.05, **kw),
            "vi-diag": lambda m, **kw: VIOptimizer(m, dataset_size=8, **kw),
            "vi-kfac": lambda m, **kw: VIOptimizer(m, dataset_size=8, approx="kfac", **kw)}[face]

    def closure_of(opt, model):
        return make_closure(opt, model, x, y)  # F.cross_entropy on [N, C, L] logits
    # without targets: the warning names the layout and the fix (not the MSE / z-loss text)
    model = _ClassesAtDim1()
    opt = make(model)
    with pytest.warns(UserWarning, match=r"over dim 1, not over the last dim.*out\.movedim\(1, -1\)"):
        opt.step(closure_of(opt, model))
    # with targets: a ValueError naming the fix, before anything changed (VIOptimizer's default diagonal
    # never estimates with its closure, so its first plain steps check them)
    model = _ClassesAtDim1()
    opt = make(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"classes at dim 1.*out\.movedim\(1, -1\)"):
        opt.step(closure_of(opt, model), targets=y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.num_steps == 0
    # the fix: no warning, no error
    model = _ClassesAtDim1()
    opt = make(model, output_selector=lambda out: out.movedim(1, -1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            opt.step(closure_of(opt, model), targets=y)


@pytest.mark.parametrize("face", ["sso-plain-steps", "vi-diag"])
def test_plain_steps_check_each_micro_batch_against_its_rows_of_the_targets(face: str) -> None:
    """Gradient accumulation: the closure's forwards take consecutive rows of targets (as estimating steps)."""
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.05, curv_update_interval=3) if face == "sso-plain-steps" else \
        VIOptimizer(model, dataset_size=64)

    def closure():
        opt.zero_grad()
        total = 0.0
        for i in range(2):
            loss = F.cross_entropy(model(X[4 * i:4 * i + 4]), Y[4 * i:4 * i + 4]) / 2
            loss.backward()
            total += float(loss.detach())
        return torch.tensor(total)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            opt.step(closure, targets=Y[:8])
    with pytest.raises(ValueError, match=r"expects targets of shape \[N\]=\(4,\)"):  # rows of another shape
        VIOptimizer(model, dataset_size=64).step(closure, targets=Y[:8, None].expand(8, 2))


@pytest.mark.parametrize("face", ["sso", "vi", "empirical"])
def test_a_scaled_loss_without_the_grad_scaler_is_named(face: str) -> None:
    """scaler.scale(loss).backward() with the scaler not given to the optimizer: the step was 1024× too long
    and the empirical Fisher from the backward 1024²× too large, silently."""
    model = _mlp()
    opt = {"sso": lambda: SecondOrderOptimizer(model, lr=0.05),
           "vi": lambda: VIOptimizer(model, dataset_size=64),
           "empirical": lambda: SecondOrderOptimizer(model, lr=0.05, curvature="empirical_fisher")}[face]()
    with pytest.warns(UserWarning, match=r"gradient of the closure's loss with respect to the output is .*× the most a "
                                         r"mean cross-entropy gives.*grad_scaler=scaler"):
        opt.step(_closure(opt, model, lambda out: 1024.0 * F.cross_entropy(out, Y)))
    # a mean loss, class weights and label smoothing are within the bound
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for loss_fn in (lambda out: F.cross_entropy(out, Y), lambda out: F.cross_entropy(out, Y, label_smoothing=0.1),
                        lambda out: F.cross_entropy(out, Y, weight=torch.tensor([1.0, 20.0, 1.0]))):
            opt.step(_closure(opt, model, loss_fn))


def test_correct_losses_do_not_trip_the_scale_checks() -> None:
    """A GradScaler given to the optimizer (its scale is in the output's gradient), a loss on a few masked rows
    of many (node classification), ignore_index padding and a heavy class weight are all mean losses."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(400, 4, generator=g), torch.randint(0, 3, (400,), generator=g)
    mask = torch.zeros(400, dtype=torch.bool)
    mask[:4] = True
    padded = torch.where(mask, y, torch.full_like(y, -100))
    rare = torch.zeros(400, dtype=torch.long)
    rare[0] = 1
    cases = [(lambda out: F.cross_entropy(out[mask], y[mask]), None),
             (lambda out: F.cross_entropy(out, padded, ignore_index=-100), None),
             (lambda out: F.cross_entropy(out, rare, weight=torch.tensor([1.0, 100.0, 1.0])), None),
             (lambda out: F.cross_entropy(out, y), "scaler")]
    for face in ("sso", "vi"):
        for loss_fn, scaled in cases:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
            opt = SecondOrderOptimizer(model, lr=0.05, curvature="fisher", grad_scaler=scaler) if face == "sso" else \
                VIOptimizer(model, dataset_size=4000, grad_scaler=scaler)

            def closure():
                opt.zero_grad()
                out = model(x)
                loss = loss_fn(out)
                (scaler.scale(loss) if scaler is not None else loss).backward()
                return loss, out
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                # (the rows the masked losses leave out have their own warning: the next test)
                warnings.filterwarnings("ignore", message=".* rows of the output got no gradient")
                for _ in range(2):
                    opt.step(closure, targets=y if scaled else None)
                    if scaler is not None:
                        scaler.update()


def _ignored_rows_warnings(opt, model, x, loss_fn, steps: int = 3) -> list:
    closure = _closure(opt, model, loss_fn, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.step(closure)
    return [str(w.message) for w in caught if "rows of the output got no gradient" in str(w.message)]


def test_rows_the_loss_leaves_out_are_named_where_the_curvature_counts_them() -> None:
    """Padded positions (ignore_index) or masked rows get no gradient from the loss, but the Fisher kinds count
    them as examples (fisher_mc draws their labels) and the empirical Fisher from the backward averages over them:
    a warning, once, with the count, naming the selector that takes the valid rows. VIOptimizer's default
    diagonal reads the loss's own gradient (no warning); unpadded, and with the rows selected, nothing."""
    V, T, N = 11, 6, 8
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(1, V, (N, T), generator=g), torch.randint(0, V, (N, T), generator=g)
    padded = y.clone()
    padded[:, 4:] = -100
    mask = padded != -100

    def lm() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(V, 16), nn.Tanh(), nn.Linear(16, V))

    def loss(targets):
        return lambda out: F.cross_entropy(out.reshape(-1, V), targets.reshape(-1), ignore_index=-100)
    for make, what in ((lambda m: SecondOrderOptimizer(m), "curvature='fisher_mc' counts every row as an example "
                                                            "of the batch and draws labels for them"),
                       (lambda m: SecondOrderOptimizer(m, curvature="fisher"), "curvature='fisher' counts every row"),
                       (lambda m: SecondOrderOptimizer(m, curvature="empirical_fisher"),
                        "the empirical Fisher from your backward averages its per-row terms over every row"),
                       (lambda m: VIOptimizer(m, dataset_size=100, approx="kfac"), "curvature='fisher_mc'")):
        model = lm()
        found = _ignored_rows_warnings(make(model), model, x, loss(padded))
        assert len(found) == 1 and found[0].startswith("16 of 48 rows of the output got no gradient") \
            and what in found[0] and "output_selector=lambda out: out[mask]" in found[0], found
        model = lm()
        assert _ignored_rows_warnings(make(model), model, x, loss(y)) == []  # every position a token
    model = lm()
    assert _ignored_rows_warnings(VIOptimizer(model, dataset_size=100), model, x, loss(padded)) == []
    model = lm()  # the fix it names: the valid rows selected
    opt = SecondOrderOptimizer(model, output_selector=lambda out: out[mask])
    assert _ignored_rows_warnings(opt, model, x, lambda out: F.cross_entropy(out[mask], padded[mask])) == []


def test_rows_every_loss_uses_do_not_warn_when_their_gradient_is_zero_for_other_reasons() -> None:
    """No warning where every row is in the loss: two backward passes over disjoint halves of one output (each
    leaves the other half's rows zero), or rows whose prediction is saturated (logits masked to the target
    class: p − y = 0 exactly; a confident model's float16 gradient underflows the same way)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 5, generator=g), torch.randint(0, 6, (48,), generator=g)
    for kind in ("fisher_mc", "empirical_fisher"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6))
        opt = SecondOrderOptimizer(model, curvature=kind)

        def closure():
            opt.zero_grad()
            out = model(x)
            (0.5 * F.cross_entropy(out[:24], y[:24])).backward(retain_graph=True)
            (0.5 * F.cross_entropy(out[24:], y[24:])).backward()
            return F.cross_entropy(out, y).detach(), out
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step(closure)
        assert not [w for w in caught if "rows of the output got no gradient" in str(w.message)], kind

    only_target = torch.zeros(48, 6, dtype=torch.bool)
    only_target[:16] = True  # rows 0..15: every class but the target masked out

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6))

        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            z = self.net(inp)
            illegal = only_target & (torch.arange(6) != y[:, None])
            return z.masked_fill(illegal, float("-inf"))
    model = Masked()
    assert _ignored_rows_warnings(SecondOrderOptimizer(model), model, x, lambda out: F.cross_entropy(out, y)) == []


@pytest.mark.parametrize("kind", ["fisher", "fisher_mc"])
def test_a_summed_loss_given_targets_is_named_under_the_fisher_kinds(kind: str) -> None:
    """The step preconditions the closure's gradient with the mean likelihood's curvature: a summed loss gave
    an N-fold step without a word (VIOptimizer and the other kinds warned)."""
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.05, curvature=kind)
    with pytest.warns(UserWarning, match=rf"curvature='{kind}', given targets\): the gradient of the closure's loss "
                                         r"with respect to the output is 16× that of the mean negative"):
        opt.step(_closure(opt, model, lambda out: F.cross_entropy(out, Y, reduction="sum")), targets=Y)
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.05, curvature=kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(_closure(opt, model, lambda out: F.cross_entropy(out, Y, label_smoothing=0.1)), targets=Y)


@pytest.mark.parametrize("loss_fn", [
    lambda out: F.cross_entropy(out, Y),
    lambda out: F.cross_entropy(out, Y, label_smoothing=0.1),
    lambda out: F.nll_loss(F.log_softmax(out, -1), Y),
    lambda out: F.cross_entropy(out, Y, weight=torch.tensor([1.0, 2.0, 0.5])),
], ids=["ce", "label_smoothing", "nll_log_softmax", "class_weights"])
def test_categorical_losses_do_not_warn(loss_fn) -> None:
    model = _mlp()
    opt = _faces(model)["sso"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            opt.step(_closure(opt, model, loss_fn))


def test_log_probability_outputs_do_not_warn() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.LogSoftmax(-1))
    opt = SecondOrderOptimizer(model, lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(_closure(opt, model, lambda out: F.nll_loss(out, Y)))


def test_mse_optimizer_with_mse_loss_does_not_warn() -> None:
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.05, loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(_closure(opt, model, lambda out: 0.5 * ((out - 1.0) ** 2).sum(-1).mean()))


def test_predict_in_train_mode_leaves_the_model_as_it_was() -> None:
    model = _mlp(bn=True)
    opt = VIOptimizer(model, dataset_size=50, lr=0.01, approx="diag")
    for _ in range(3):
        opt.step(_closure(opt, model, lambda out: F.cross_entropy(out, Y)))
    model.train()
    bn = model[1]
    stats = {k: v.clone() for k, v in bn.state_dict().items()}
    probs = opt.predict(X[:5], num_samples=4, generator=torch.Generator().manual_seed(3))
    assert model.training and all(m.training for m in model.modules())
    for k, v in bn.state_dict().items():
        assert torch.equal(v, stats[k]), k
    model.eval()
    expected = opt.predict(X[:5], num_samples=4, generator=torch.Generator().manual_seed(3))
    assert not model.training
    assert torch.allclose(probs, expected)  # evaluated with the running statistics, not the batch's


def test_predict_keeps_a_frozen_submodule_in_eval() -> None:
    model = _mlp(bn=True)
    opt = VIOptimizer(model, dataset_size=50, lr=0.01, approx="diag")
    opt.step(_closure(opt, model, lambda out: F.cross_entropy(out, Y)))
    model.train()
    model[1].eval()  # a user's frozen BatchNorm
    opt.predict(X[:5], num_samples=2)
    assert model.training and not model[1].training


def test_predict_before_any_step_raises() -> None:
    """Before the first step predict() samples the isotropic start (the default curvature_init's, or an
    explicit init_precision), as sampled_params() does; with neither there is nothing to sample."""
    model = _mlp()
    opt = VIOptimizer(model, dataset_size=50, lr=0.01, approx="diag", curvature_init=None)
    with pytest.raises(RuntimeError, match="before the first step"):
        opt.predict(X, num_samples=2)
    for kwargs in (dict(init_precision=10.0), {}):
        sampled = VIOptimizer(model, dataset_size=50, lr=0.01, approx="diag", **kwargs)
        probs = sampled.predict(X, num_samples=2)  # an isotropic start is a posterior to sample
        assert probs.shape == (16, 3)


@pytest.mark.parametrize("cls", [SecondOrderOptimizer, VIOptimizer])
def test_parameters_instead_of_model(cls) -> None:
    model = _mlp()
    kw = {"dataset_size": 10} if cls is VIOptimizer else {}
    for bad in (model.parameters(), list(model.parameters()), [{"params": list(model.parameters())}]):
        with pytest.raises(TypeError, match="pass the model itself"):
            cls(bad, **kw)


def test_curvature_name_is_named_with_a_suggestion() -> None:
    with pytest.raises(ValueError, match=r"curvature='fisher-mc' is not supported \(did you mean 'fisher_mc'\?\)"):
        SecondOrderOptimizer(_mlp(), curvature="fisher-mc")
    import curvature
    with pytest.raises(ValueError, match=r"kind='Empirical Fisher'.*did you mean 'empirical_fisher'"):
        curvature.compute(_mlp(), X, Y, kind="Empirical Fisher")


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_closure_after_the_watch_runs_with_grad_and_checks_its_result(face: str) -> None:
    """After the watched calls a step runs the closure without a watch: still with grad enabled (a step
    called under ``torch.no_grad()`` trains), and a closure that returns neither the loss nor
    ``(loss, output)`` is still a TypeError."""
    from torchsso2.optim.misuse import CLOSURE_CHECKS

    model = _mlp()
    opt = _faces(model, curv_update_interval=2)[face]  # odd steps estimate nothing: the plain closure call
    closure = _closure(opt, model, lambda out: F.cross_entropy(out, Y))
    for _ in range(CLOSURE_CHECKS + 1):
        opt.step(closure)
    assert not opt._misuse["closure_checks_left"]
    before = _vec(model)
    with torch.no_grad():
        opt.step(closure)
        opt.step(closure)
    assert not torch.equal(_vec(model), before)
    with pytest.raises(TypeError, match=r"must return the loss, or \(loss, output\).*tuple of 3 items"):
        opt.step(lambda: (*closure(), 0))


def _mse(out):
    return F.mse_loss(out, F.one_hot(Y, 3).float())


def test_plain_steps_between_curvature_estimates_do_not_check_the_output() -> None:
    """The output check runs on curvature-estimating steps: once one has checked, the plain steps
    in between set up no hook (they would cost ~0.16 ms each on the digits CNN); the next estimating
    steps still check."""
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.05, approx="kfac", curv_update_interval=3, inv_update_interval=3)
    opt.step(_closure(opt, model, lambda out: F.cross_entropy(out, Y)))  # estimating: checked
    assert opt._misuse["output_checks_left"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # plain steps: not checked, so not counted
            opt.step(_closure(opt, model, _mse))
    assert opt._misuse["output_checks_left"] == 2
    with pytest.warns(UserWarning, match="not a function of softmax"):  # the next estimating step (4th watched call)
        opt.step(_closure(opt, model, _mse))


def test_an_optimizer_without_estimating_closures_checks_its_plain_steps() -> None:
    """VIOptimizer with curvature='reparam' never estimates curvature with its closure: its plain
    steps check the output, also after a first step with a categorical loss."""
    model = _mlp()
    opt = VIOptimizer(model, dataset_size=50, lr=0.01, approx="diag", curvature="reparam")
    opt.step(_closure(opt, model, lambda out: F.cross_entropy(out, Y)))
    assert opt._misuse["output_checks_left"] == 2
    with pytest.warns(UserWarning, match="not a function of softmax"):
        opt.step(_closure(opt, model, _mse))


def test_the_softmax_warning_says_what_uses_the_likelihood() -> None:
    """The empirical Fisher from the user's own backward is the curvature of whatever the loss is (a
    multi-label BCE, as the guide recommends): no warning. VIOptimizer's default diagonal reads the
    gradients only, but predict() averages softmax(output): the warning names that, not the curvature.
    A Fisher kind names the curvature."""
    multi = (torch.rand(16, 3) > 0.5).float()

    def bce(out):
        return F.binary_cross_entropy_with_logits(out, multi)
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.05, curvature="empirical_fisher")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            opt.step(_closure(opt, model, bce))
    vi = VIOptimizer(model, dataset_size=50, lr=0.01)
    with pytest.warns(UserWarning, match=r"softmax.*predict\(\) averages softmax\(output\)") as rec:
        vi.step(_closure(vi, model, bce))
    assert "The curvature is that of a categorical" not in str(rec[0].message)
    sso = SecondOrderOptimizer(model, lr=0.05, curvature="fisher_mc")
    with pytest.warns(UserWarning, match="The curvature is that of a categorical likelihood"):
        sso.step(_closure(sso, model, bce))


def test_an_optimizer_on_a_backbone_under_a_head_is_told_to_take_the_whole_model() -> None:
    """Built on a submodule whose output the head turns into the logits, the Fisher kinds would take the
    backbone's features as logits: the warning names the head's weight, params=backbone.parameters() (and,
    for a loss that is no likelihood, the empirical Fisher), in place of the softmax warning
    (tests/test_output_consumers.py: the other losses)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(6, 12), nn.Tanh()), nn.Linear(12, 3))
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    opt = SecondOrderOptimizer(net[0], lr=0.05, curvature="fisher")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        return loss
    with pytest.warns(UserWarning, match=r"reaches the closure's loss through weights applied after it "
                                         r"\(parameters of shape \[3, 12\]\)") as rec:
        opt.step(closure)
    assert len(rec) == 1, [str(r.message) for r in rec]
    text = str(rec[0].message)
    assert "params=backbone.parameters()" in text and "curvature='empirical_fisher'" in text, text


def test_a_head_the_selected_output_does_not_reach_is_named() -> None:
    """A two-head model whose closure adds both heads' losses, with output_selector picking one: the
    Fisher of the picked output has a zero output factor for the other head, whose step would be
    lr·g/damping (1000× SGD's at damping 1e-3). A warning names it, once; the empirical Fisher from the
    user's backward (the whole loss) and VI's default diagonal (the gradients) do not warn."""
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk = nn.Sequential(nn.Linear(4, 5), nn.Tanh())
            self.ha, self.hb = nn.Linear(5, 3), nn.Linear(5, 2)

        def forward(self, x):
            h = self.trunk(x)
            return self.ha(h), self.hb(h)
    yb = torch.randint(0, 2, (16,))

    def run(make):
        torch.manual_seed(0)
        model = TwoHeads()
        opt = make(model)

        def closure():
            opt.zero_grad()
            a, b = model(X)
            loss = F.cross_entropy(a, Y) + F.cross_entropy(b, yb)
            loss.backward()
            return loss
        return _reach_warnings(opt, closure, steps=3)
    pick = dict(output_selector=lambda out: out[0])
    for make in (lambda m: SecondOrderOptimizer(m, **pick),
                 lambda m: VIOptimizer(m, 50, approx="kfac", curv_update_interval=1, **pick)):
        found = run(make)
        assert len(found) == 1 and "['hb']" in found[0] and "skip_modules=['hb']" in found[0]
    # adaptive mode: skipping the head does not help its quadratic model, which has no curvature for that loss
    found = run(lambda m: SecondOrderOptimizer(m, use_adaptive_learning_rate=True, use_adaptive_momentum=True, **pick))
    assert len(found) == 1 and "overshoots" in found[0] and "skip_modules" not in found[0], found
    assert run(lambda m: SecondOrderOptimizer(m, curvature="empirical_fisher", **pick)) == []
    assert run(lambda m: VIOptimizer(m, 50, **pick)) == []


HETERO = {
    "sso_kfac": (lambda m, **kw: SecondOrderOptimizer(m, loss="mse", **kw), "kl_clip"),
    "adaptive": (lambda m, **kw: SecondOrderOptimizer(m, loss="mse", use_adaptive_learning_rate=True,
                                                      use_adaptive_momentum=True, **kw), "overshoots"),
    "vi_kfac": (lambda m, **kw: VIOptimizer(m, 50, loss="mse", approx="kfac", curv_update_interval=1, **kw),
                "precision stays at its start"),
}


@pytest.mark.parametrize("face", sorted(HETERO))
def test_a_selector_leaving_out_part_of_a_layers_output_warns(face: str) -> None:
    """A heteroscedastic head ``[mean, log-variance]`` from one Linear, the curvature of the mean's Gaussian
    (``output_selector=lambda o: o[:, :2]``) and a Gaussian NLL with the learned variance in the closure: the
    log-variance rows of the head have zero curvature and a gradient (the block as a whole is not zero, so
    the whole-module check did not see it). Named with the share of the gradient there; not for the mean alone."""
    make, fix = HETERO[face]
    gen = torch.Generator().manual_seed(0)
    x, t = torch.randn(32, 4, generator=gen), torch.randn(32, 2, generator=gen)

    def run(nll) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        opt = make(model, output_selector=lambda o: o[:, :2])

        def closure():
            opt.zero_grad()
            out = model(x)
            loss = nll(out[:, :2], out[:, 2:])
            loss.backward()
            return loss
        return _reach_warnings(opt, closure, steps=3)
    found = run(lambda mean, logvar: F.gaussian_nll_loss(mean, t, logvar.exp()))
    assert len(found) == 1 and "modules ['2'] has been zero on output units that carry part of the gradient" \
        in found[0], found
    assert "log-variance" in found[0] and fix in found[0] and "skip_modules" not in found[0]
    assert run(lambda mean, logvar: 0.5 * (mean - t).pow(2).sum(1).mean()) == []


def test_an_embedding_under_an_l2_term_or_accumulated_batches_does_not_warn() -> None:
    """Tokens absent from the batch have zero curvature (the input side) and a gradient from an L2 term of the
    loss, or from batches accumulated outside step() (Lightning's accumulate_grad_batches): no warning, only
    output units the likelihood does not reach count. A wholly unreached head still warns beside it."""
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head, self.aux = nn.Embedding(2000, 16), nn.Linear(16, 3), nn.Linear(16, 2)

        def forward(self, ids):
            h = self.emb(ids).mean(1)
            return self.head(h), self.aux(h)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 2000, (16, 8), generator=gen), torch.randint(0, 3, (16,), generator=gen))
               for _ in range(4)]
    for accumulate in (False, True):
        torch.manual_seed(0)
        model = Tagger()
        opt = SecondOrderOptimizer(model, lr=0.05, output_selector=lambda o: o[0])

        def loss_of(ids, y):
            main, aux = model(ids)
            return F.cross_entropy(main, y) + F.cross_entropy(aux, y.clamp(max=1)) + (
                0 if accumulate else 1e-4 * sum(p.pow(2).sum() for p in model.parameters()))
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for i in range(6):
                ids, y = batches[i % 4]
                if accumulate:  # an earlier micro-batch's backward outside step()
                    opt.zero_grad()
                    loss_of(*batches[(i + 1) % 4]).backward()

                def closure():
                    if not accumulate:
                        opt.zero_grad()
                    loss = loss_of(ids, y)
                    loss.backward()
                    return loss
                opt.step(closure)
        found = [str(w.message) for w in rec if "curvature of modules" in str(w.message)]
        assert len(found) == 1 and "modules ['aux'] has been zero although" in found[0], (accumulate, found)


def test_dead_units_under_a_small_l2_term_do_not_warn() -> None:
    """Units no example activates (ReLUs biased below every input) have zero curvature; an L2 term of the
    loss gives their weights a gradient, a small share of the block's: no warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].bias[:3] = -5.0  # three dead units (|w·x| < 5 on the batch)
    assert _unreached_under_l2(model, steps=3) == []


def _reach_warnings(opt, closure, steps: int) -> list:
    """The unreached-curvature warnings of ``steps`` steps of ``opt`` with ``closure``."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.step(closure)
    return [str(w.message) for w in rec if "curvature of modules" in str(w.message)]


def _unreached_under_l2(model: nn.Module, steps: int) -> list:
    """The unreached-curvature warnings of ``steps`` K-FAC steps on ``model`` under a closure adding an L2 term."""
    opt = SecondOrderOptimizer(model, lr=0.05)

    def l2(out):
        return F.cross_entropy(out, Y) + 1e-4 * sum(p.pow(2).sum() for p in model.parameters())
    return _reach_warnings(opt, _closure(opt, model, l2), steps)


def _fixed_closure(opt, model, loss_fn):
    """As :func:`_closure` on a batch of its own (seeded here: the module's X, Y depend on the RNG state at
    collection), whose logits are far enough from uniform that label smoothing changes the loss by ~1%."""
    gen = torch.Generator().manual_seed(0)
    x, y = 3 * torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        return loss, out
    return closure, y


@pytest.mark.parametrize("kind", ["hessian", "empirical_fisher"])
def test_a_curvature_of_the_targets_warns_when_the_closure_minimises_another_loss(kind: str) -> None:
    """The Hessian (and the empirical Fisher given targets) is taken of the mean NLL of the output and the
    targets: a closure minimising the label-smoothed or summed loss got that curvature without a word
    (adaptive mode already warned). Once, and not for the mean NLL itself; the Fisher kinds (the model's
    likelihood whatever the loss) only for the loss's scale."""
    def warned(curvature: str, loss_fn) -> list:
        model = _mlp()
        opt = SecondOrderOptimizer(model, lr=0.01, curvature=curvature, approx="diag", damping=10.0)
        closure, y = _fixed_closure(opt, model, loss_fn)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for _ in range(2):
                opt.step(closure, targets=y)
        return [str(w.message) for w in rec if "given targets" in str(w.message)]
    smoothed = warned(kind, lambda out, y: F.cross_entropy(out, y, label_smoothing=0.3))
    assert len(smoothed) == 1 and f"curvature='{kind}'" in smoothed[0]
    assert "16×" in warned(kind, lambda out, y: F.cross_entropy(out, y, reduction="sum"))[0]
    assert warned(kind, lambda out, y: F.cross_entropy(out, y)) == []
    assert "is 16× that" in warned("fisher_mc", lambda out, y: F.cross_entropy(out, y, reduction="sum"))[0]
    assert warned("fisher_mc", lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1)) == []


def test_the_unreached_warning_waits_for_a_second_estimate_and_looks_at_late_heads() -> None:
    """A zero-initialised classifier head zeroes the layers' output factors below it at the first estimate
    only (an L2 term in the closure gives them a gradient): no warning. A second head first called after
    the first estimate is looked at when it appears."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))
    nn.init.zeros_(model[4].weight)
    nn.init.zeros_(model[4].bias)
    assert _unreached_under_l2(model, steps=4) == []

    class LateAux(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk, self.ha, self.hb = nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(5, 2)
            self.aux = False

        def forward(self, x):
            h = torch.tanh(self.trunk(x))
            return self.ha(h), (self.hb(h) if self.aux else None)
    torch.manual_seed(0)
    late = LateAux()
    opt = SecondOrderOptimizer(late, output_selector=lambda out: out[0])
    yb = torch.randint(0, 2, (16,))

    def closure():
        opt.zero_grad()
        a, b = late(X)
        loss = F.cross_entropy(a, Y) + (F.cross_entropy(b, yb) if b is not None else 0.0)
        loss.backward()
        return loss
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for step in range(5):
            late.aux = step >= 2
            opt.step(closure)
    found = [str(w.message) for w in rec if "curvature of modules" in str(w.message)]
    assert len(found) == 1 and "['hb']" in found[0]


def test_the_loss_checks_read_the_whole_batch_and_cover_adaptive_momentum_alone() -> None:
    """Micro-batches of one example (MSE: [1, D] broadcasts against [N, D] targets) made the Hessian's check
    compare one example's output with the whole batch; an adaptive momentum alone (no adaptive lr, whose
    own check is skipped then) had no check; adaptive mode with the empirical Fisher from the backward still
    takes the categorical curvature in its quadratic model, so the softmax check stays on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    x, t = torch.randn(8, 4), torch.randn(8, 2)
    opt = SecondOrderOptimizer(model, lr=0.01, curvature="hessian", loss="mse", approx="diag", damping=1.0)

    def accumulated():
        opt.zero_grad()
        total = 0.0
        for i in range(8):
            part = 0.5 * (model(x[i:i + 1]) - t[i:i + 1]).pow(2).sum(1).mean() / 8
            part.backward()
            total = total + part.detach()
        return total
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(accumulated, targets=t)
    model = _mlp()
    opt = SecondOrderOptimizer(model, lr=0.01, curvature="hessian", approx="diag", damping=10.0,
                               use_adaptive_momentum=True)
    closure, y = _fixed_closure(opt, model, lambda out, y: F.cross_entropy(out, y, label_smoothing=0.3))
    with pytest.warns(UserWarning, match="given targets"):
        opt.step(closure, targets=y)
    model = _mlp()
    opt = SecondOrderOptimizer(model, curvature="empirical_fisher", use_adaptive_learning_rate=True,
                               use_adaptive_momentum=True, adaptive_damping=True, damping=1.0)
    with pytest.warns(UserWarning, match="quadratic model takes the categorical"):
        opt.step(_closure(opt, model, lambda out: F.mse_loss(out, F.one_hot(Y, 3).float())))


class _Alternating(nn.Module):
    """A trunk and two heads; ``task`` picks the head the forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 5), nn.Tanh())
        self.a, self.b = nn.Linear(5, 3), nn.Linear(5, 3)
        self.task = "a"

    def forward(self, x):
        return getattr(self, self.task)(self.trunk(x))


def _alternate(step, model, steps: int = 12, both: bool = False) -> list:
    """``steps`` steps, task a at even and b at odd ones (``both``: the two tasks at every step); the warnings
    that name modules without curvature."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for i in range(steps):
            tasks = ["a", "b"] if both else ["ab"[i % 2]]
            step(model, tasks)
    return [str(w.message) for w in rec if "still have no" in str(w.message)]


@pytest.mark.parametrize("face", ["sso", "vi_kfac"])
def test_a_head_called_only_between_curvature_steps_is_named(face: str) -> None:
    """Tasks alternating between batches with curvature at every second step: head b never gets a block
    (plain update; for VI no weight noise), which was silent."""
    def run(interval: int, both: bool = False) -> list:
        torch.manual_seed(0)
        model = _Alternating()
        opt = (SecondOrderOptimizer(model, lr=0.05, curv_update_interval=interval) if face == "sso" else
               VIOptimizer(model, dataset_size=50, approx="kfac", curv_update_interval=interval,
                           inv_update_interval=interval))

        def step(m, tasks):
            def closure():
                opt.zero_grad()
                loss = 0.0
                for t in tasks:
                    m.task = t
                    loss = loss + F.cross_entropy(m(X), Y)
                loss.backward()
                return loss
            opt.step(closure)
        found = _alternate(step, model, both=both)
        if found:
            assert "b" not in opt.running.blocks
        return found
    found = run(2)
    assert len(found) == 1 and "modules ['b'] have had a gradient but still have no curvature" in found[0], found
    assert ("no weight noise" if face == "vi_kfac" else "plain update") in found[0]
    assert "curv_update_interval=1" in found[0]
    assert run(1) == []
    assert run(2, both=True) == []


def test_a_layer_recorded_only_between_factor_steps_is_named() -> None:
    """KFACPreconditioner with factor_update_steps=2 and tasks alternating: head b never gets factors and its
    gradient stays as it is (kfac_pytorch raises); named once."""
    from torchsso2.kfac import KFACPreconditioner

    def run(factor_steps: int) -> list:
        torch.manual_seed(0)
        model = _Alternating()
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        pre = KFACPreconditioner(model, factor_update_steps=factor_steps, inv_update_steps=factor_steps)

        def step(m, tasks):
            sgd.zero_grad()
            m.task = tasks[0]
            F.cross_entropy(m(X), Y).backward()
            pre.step()
            sgd.step()
        found = _alternate(step, model)
        assert pre.layers["b"].has_factors() == (factor_steps == 1)
        return found
    found = run(2)
    assert len(found) == 1 and "layer(s) ['b'] have had gradients but still have no factors" in found[0], found
    assert "factor_update_steps=1" in found[0]
    assert run(1) == []


@pytest.mark.parametrize("factor_steps", [1, 2])
def test_a_layer_used_functionally_gets_one_warning_of_what_it_is(factor_steps: int) -> None:
    """A layer whose weight the forward uses without calling it is named by the no-forward-recorded warning, not
    also as a layer called between factor steps."""
    from torchsso2.kfac import KFACPreconditioner

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

        def forward(self, x):
            return F.linear(torch.tanh(self.a(x)), self.b.weight, self.b.bias)
    torch.manual_seed(0)
    model = Functional()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model, factor_update_steps=factor_steps, inv_update_steps=factor_steps)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(8):
            sgd.zero_grad()
            F.cross_entropy(model(X), Y).backward()
            pre.step()
            sgd.step()
    said = [str(w.message) for w in rec if "KFACPreconditioner" in str(w.message)]
    assert len(said) == 1 and "no forward of them was recorded" in said[0], said


@pytest.mark.parametrize("estimating", [True, False])
def test_the_output_checks_see_through_a_selector_that_reshapes_the_output(estimating: bool) -> None:
    """``output_selector=lambda o: o.reshape(-1, C)`` (docs/guide.md's sequence recipe) builds a tensor the
    closure's loss does not go through (it reshapes the output itself): the softmax and the loss-scale checks
    got no gradient and said nothing. Now they read the selector applied to the output's gradient (a view of
    the output only: a selector computing a new tensor stays unchecked)."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 5, 4, generator=gen), torch.randint(0, 3, (8, 5), generator=gen)

    def warned(loss_fn, selector=lambda o: o.reshape(-1, 3)) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        opt = SecondOrderOptimizer(model, lr=0.01, output_selector=selector,
                                   curv_update_interval=1 if estimating else 100)

        def closure():
            opt.zero_grad()
            out = model(x)
            loss = loss_fn(out)
            loss.backward()
            return loss
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for _ in range(3):
                opt.step(closure)
        return [str(w.message) for w in rec if "loss='cross_entropy' but" in str(w.message)]
    assert warned(lambda o: F.cross_entropy(o.reshape(-1, 3), y.reshape(-1))) == []
    mse = warned(lambda o: F.mse_loss(o, F.one_hot(y, 3).float()))
    assert len(mse) == 1 and "not a function of softmax(output)" in mse[0], mse
    scaled = warned(lambda o: 1000 * F.cross_entropy(o.reshape(-1, 3), y.reshape(-1)))  # (an unscaled AMP loss)
    assert len(scaled) == 1 and "is the loss scaled?" in scaled[0], scaled
    # a view of a view (positions first, the first dropped): read too
    mse = warned(lambda o: F.mse_loss(o, F.one_hot(y, 3).float()), selector=lambda o: o.transpose(0, 1)[1:])
    assert len(mse) == 1 and "not a function of softmax(output)" in mse[0], mse
    # not a view of the output: no gradient to read, no check (as before)
    assert warned(lambda o: F.mse_loss(o, F.one_hot(y, 3).float()), selector=lambda o: o.reshape(-1, 3) * 1.0) == []


@pytest.mark.parametrize("face", ["sso_between_estimates", "vi_diag"])
def test_a_metric_forward_under_no_grad_in_the_closure_is_not_checked(face: str) -> None:
    """The output check between curvature steps (and VIOptimizer's default diagonal at every step) reads the
    forwards that take a gradient, as the estimating steps do: an unbatched forward under no_grad (a metric on
    one example, output [C]) is not the loss's batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = (SecondOrderOptimizer(model, lr=0.01, curv_update_interval=3) if face == "sso_between_estimates"
           else VIOptimizer(model, dataset_size=100))

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(X), Y)
        loss.backward()
        with torch.no_grad():
            model(X[0])
        return loss
    for _ in range(4):
        opt.step(closure)
    assert opt.num_steps == 4


class _SplitHead(nn.Module):
    """One Linear whose output is returned as two views, ``(logits, aux)``; optionally a zero-initialised
    classifier on part of a trunk whose other units feed the auxiliary term only."""

    def __init__(self, zero_head: bool = False) -> None:
        super().__init__()
        self.trunk, self.head = nn.Linear(4, 8), nn.Linear(4, 3)
        if zero_head:
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def forward(self, x):
        h = self.trunk(x)
        return self.head(torch.tanh(h[:, :4])), h[:, 4:]


@pytest.mark.parametrize("zero_head", [False, True])
@pytest.mark.parametrize("face", ["sso", "vi_kfac"])
def test_views_of_one_output_and_a_zero_initialised_head(face: str, zero_head: bool) -> None:
    """Output entries that are views of one tensor (the selector picking one) ran the selector-view path on
    the other view and fed a placeholder to the checks (a RuntimeError at the first step); the trunk units
    that feed only the auxiliary term are named, also below a zero-initialised head (whose first estimate
    zeroes the trunk's block wholly: that estimate is not counted)."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    model = _SplitHead(zero_head)
    opt = (SecondOrderOptimizer(model, lr=0.05, output_selector=lambda o: o[0]) if face == "sso" else
           VIOptimizer(model, dataset_size=100, approx="kfac", curv_update_interval=1, output_selector=lambda o: o[0]))

    def closure():
        opt.zero_grad()
        logits, aux = model(x)
        loss = F.cross_entropy(logits, y) + aux.pow(2).mean()
        loss.backward()
        return loss
    found = _reach_warnings(opt, closure, steps=6)
    assert len(found) == 1 and "modules ['trunk'] has been zero on output units" in found[0], found


def test_a_wholly_and_a_partly_unreached_module_are_each_named() -> None:
    """The two warnings have their own once-flags: one does not hide the other."""
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk, self.head, self.aux = nn.Linear(4, 8), nn.Linear(4, 3), nn.Linear(8, 2)

        def forward(self, x):
            h = self.trunk(x)
            return self.head(torch.tanh(h[:, :4])), h[:, 4:], self.aux(torch.tanh(h))
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    model = Both()
    opt = SecondOrderOptimizer(model, lr=0.05, output_selector=lambda o: o[0])

    def closure():
        opt.zero_grad()
        logits, extra, aux = model(x)
        loss = F.cross_entropy(logits, y) + extra.pow(2).mean() + F.cross_entropy(aux, y.clamp(max=1))
        loss.backward()
        return loss
    found = sorted(_reach_warnings(opt, closure, steps=4))
    assert len(found) == 2, found
    assert found[0].startswith("the curvature of modules ['aux'] has been zero although the loss"), found
    assert found[1].startswith("the curvature of modules ['trunk'] has been zero on output units"), found


def test_a_parameter_returned_in_the_output_gets_no_hooks_from_the_checks() -> None:
    """The selector-view path hooks the model's computed output tensors only: hooks on a returned Parameter (a
    leaf) would stay, one more per watched step, each holding that step's gradients."""
    class Tempered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.log_t = nn.Linear(4, 3), nn.Parameter(torch.zeros(()))

        def forward(self, x):
            return {"logits": self.fc(x), "log_t": self.log_t}
    torch.manual_seed(0)
    x, y = torch.randn(8, 5, 4), torch.randint(0, 3, (8, 5))
    model = Tempered()
    opt = SecondOrderOptimizer(model, lr=0.01, params=[model.fc.weight, model.fc.bias],
                               output_selector=lambda o: o["logits"].reshape(-1, 3))
    opt.add_param_group({"params": [model.log_t]})

    def closure():
        opt.zero_grad()
        o = model(x)
        loss = F.cross_entropy(o["logits"].reshape(-1, 3) / o["log_t"].exp(), y.reshape(-1))
        loss.backward()
        return loss
    for _ in range(6):
        opt.step(closure)
        assert not model.log_t._backward_hooks


@pytest.mark.parametrize("failure", ["closure_raises", "hessian_without_targets", "empty_batch_at_a_plain_step"])
def test_steps_that_do_not_finish_do_not_use_up_the_first_calls_checks(failure):
    """A step that does not finish leaves the optimizer as it was: ten failed steps had used up the checks of the
    first five calls, and a closure that forgot backward() then stepped silently."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    opt = (SecondOrderOptimizer(model, curvature="hessian", approx="diag") if failure == "hessian_without_targets"
           else SecondOrderOptimizer(model, curv_update_interval=3) if failure == "empty_batch_at_a_plain_step"
           else SecondOrderOptimizer(model))
    if failure == "empty_batch_at_a_plain_step":
        opt.step(make_closure(opt, model, x, y))  # the estimating step; the next ones are plain

    def failing():
        opt.zero_grad()
        rows = x[:0] if failure == "empty_batch_at_a_plain_step" else x
        out = model(rows)
        loss = F.cross_entropy(out, y[:out.shape[0]]) if out.shape[0] else out.sum()
        loss.backward()
        if failure == "closure_raises":
            raise KeyError("bad batch")
        return loss, out

    for _ in range(10):
        with pytest.raises((KeyError, ValueError)):
            opt.step(failing)

    def no_backward():
        opt.zero_grad()
        out = model(x)
        return F.cross_entropy(out, y), out

    with pytest.raises(RuntimeError, match="did not call backward"):
        opt.step(no_backward, **({"targets": y} if failure == "hessian_without_targets" else {}))
