"""Errors name the bad value and what was expected; unsupported configurations are refused."""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from torch import nn

import curvature
from models import MODELS
from optim_helpers import masked_mse
from reference import Reference


@pytest.fixture
def mlp():
    build, batch = MODELS["mlp"]
    model = build()
    x, y = batch(4, "cross_entropy")
    return model, x, y


def _compute(model, x, y, **kw):
    return curvature.compute(model, x, y, **kw)


# ---- option vocabularies ---------------------------------------------------------------------------
@pytest.mark.parametrize("arg,value,choices", [
    ("kind", "fischer", ["fisher", "fisher_mc", "empirical_fisher", "hessian"]),
    ("approx", "kron", ["full", "diag", "kfac"]),
    ("loss", "nll", ["cross_entropy", "mse"]),
    ("kind", 3, ["fisher", "hessian"]),
])
def test_unknown_option_names_value_and_choices(mlp, arg, value, choices) -> None:
    model, x, y = mlp
    with pytest.raises(ValueError) as info:
        _compute(model, x, y, **{arg: value})
    msg = str(info.value)
    assert repr(value) in msg and arg in msg, msg
    for c in choices:
        assert repr(c) in msg, (c, msg)


def test_unknown_approx_in_dict(mlp) -> None:
    model, x, y = mlp
    with pytest.raises(ValueError, match=r"'blockdiag'.*'full'"):
        _compute(model, x, y, approx={nn.Linear: "blockdiag"})
    with pytest.raises(TypeError):
        _compute(model, x, y, approx={3: "full"})


@pytest.mark.parametrize("mc,error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError),
                                      ("2", TypeError), (None, TypeError)])
def test_mc_samples_must_be_positive_int(mlp, mc, error) -> None:
    model, x, y = mlp
    with pytest.raises(error, match="mc_samples"):
        _compute(model, x, y, kind="fisher_mc", mc_samples=mc)


def test_generator_type_checked(mlp) -> None:
    model, x, y = mlp
    with pytest.raises(TypeError, match="generator"):
        _compute(model, x, y, kind="fisher_mc", generator=0)


# ---- targets and outputs -----------------------------------------------------------------------------
@pytest.mark.parametrize("bad,pattern", [
    (lambda y: y.double(), "integer"),                        # float class labels
    (lambda y: y.unsqueeze(1), r"shape \[N\]"),                # [N, 1]
    (lambda y: y[:-1], r"shape \[N\]"),                        # wrong N
    (lambda y: torch.full_like(y, 3), r"\[0, 3\)"),            # class == C
    (lambda y: torch.full_like(y, -1), r"\[0, 3\)"),           # negative class
])
@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher", "hessian"])
def test_cross_entropy_target_errors(mlp, bad, pattern, kind) -> None:
    model, x, y = mlp
    with pytest.raises(ValueError, match=pattern):
        _compute(model, x, bad(y), kind=kind)


@pytest.mark.parametrize("kind", ["fisher", "empirical_fisher"])
def test_mse_target_shape(mlp, kind) -> None:
    model, x, _ = mlp
    with pytest.raises(ValueError, match=r"output's shape \(4, 3\)"):
        _compute(model, x, torch.zeros(4, 2, dtype=torch.float64), loss="mse", kind=kind)
    with pytest.raises(ValueError, match="mse"):
        _compute(model, x, torch.zeros(4, dtype=torch.float64), loss="mse", kind=kind)


def test_targets_needed(mlp) -> None:
    model, x, _ = mlp
    for kind in ("empirical_fisher", "hessian"):
        with pytest.raises(ValueError, match=kind):
            _compute(model, x, None, kind=kind)
    # the Fisher kinds do not need labels
    c = _compute(model, x, None, kind="fisher", approx="diag")
    ref = Reference(model, x, torch.zeros(4, dtype=torch.long), "cross_entropy")
    torch.testing.assert_close(c.dense(), ref.shaped("fisher", "diag"), rtol=0, atol=1e-10)


def test_cross_entropy_needs_logits_and_targets_of_their_shape() -> None:
    """Logits ``[N, C]`` or sequence logits ``[N, T, C]`` (targets ``[N, T]``; tests/test_sequence_curvature.py)."""
    model = nn.Sequential(nn.Linear(3, 6), nn.Unflatten(1, (2, 3))).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"targets of shape \[N, T\].*\(4, 2\)"):
        _compute(model, x, torch.zeros(4, dtype=torch.long))
    flat = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0)).double()
    with pytest.raises(ValueError, match=r"\[N, C\]"):
        _compute(flat, x, torch.zeros(4, dtype=torch.long))


def test_inputs_type_checked(mlp) -> None:
    model, x, y = mlp
    with pytest.raises(TypeError, match="inputs"):
        _compute(model, [x], y)
    with pytest.raises(TypeError, match="nn.Module|Module"):
        _compute(lambda t: t, x, y)


# ---- unsupported modules, skip_modules -----------------------------------------------------------------
class WithPReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.act = nn.PReLU(5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _prelu_case():
    torch.manual_seed(0)
    model = WithPReLU().double()
    with torch.no_grad():
        model.act.weight.fill_(0.3)
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    return model, x, y


def test_unsupported_module_with_parameters_named() -> None:
    model, x, y = _prelu_case()
    with pytest.raises(ValueError) as info:
        _compute(model, x, y)
    msg = str(info.value)
    assert "'act'" in msg and "PReLU" in msg and "skip_modules" in msg, msg


@pytest.mark.parametrize("skip", [["act"], [r"^ac"], [nn.PReLU]], ids=["name", "regex", "type"])
@pytest.mark.parametrize("approx", ["full", "kfac"])
def test_skip_modules_excludes(skip, approx) -> None:
    model, x, y = _prelu_case()
    c = _compute(model, x, y, kind="fisher", approx=approx, skip_modules=skip)
    assert list(c.blocks) == ["fc1", "fc2"]
    assert all(p is not model.act.weight for p in c.params)
    ref = Reference(model, x, y, "cross_entropy")  # the reference covers supported types only
    torch.testing.assert_close(c.dense(), ref.shaped("fisher", approx), rtol=0, atol=1e-10)


def test_skip_supported_module_by_regex_and_type() -> None:
    build, batch = MODELS["norm_mlp"]
    model = build()
    x, y = batch(4, "cross_entropy")
    c = _compute(model, x, y, approx="full", skip_modules=[r"fc\d", nn.LayerNorm])
    assert list(c.blocks) == ["bn"]
    ref = Reference(model, x, y, "cross_entropy", skip=[r"fc\d", nn.LayerNorm])
    torch.testing.assert_close(c.dense(), ref.shaped("fisher", "full"), rtol=0, atol=1e-10)


def test_frozen_parameters_are_not_covered() -> None:
    build, batch = MODELS["mlp"]
    model = build()
    model.fc2.bias.requires_grad_(False)
    model.fc1.requires_grad_(False)
    x, y = batch(4, "cross_entropy")
    c = _compute(model, x, y, approx="full")
    assert list(c.blocks) == ["fc2", "fc3"]
    assert [p.shape for p in c.params] == [model.fc2.weight.shape, model.fc3.weight.shape, model.fc3.bias.shape]
    ref = Reference(model, x, y, "cross_entropy")
    torch.testing.assert_close(c.dense(), ref.shaped("fisher", "full"), rtol=0, atol=1e-10)
    # K-FAC needs the weight; with a frozen bias it is K-FAC without the ones column
    ck = _compute(model, x, y, approx="kfac")
    assert ck.blocks["fc2"].A.shape == (6, 6)
    torch.testing.assert_close(ck.dense(), ref.shaped("fisher", "kfac"), rtol=0, atol=1e-10)


@pytest.mark.parametrize("model_name,module", [("mlp", "fc2"), ("cnn", "conv1")])
def test_kfac_with_frozen_weight_covers_the_bias(model_name: str, module: str) -> None:
    """Frozen weight, trainable bias: K-FAC is G ⊗ [[1]] over the bias (exact for Linear, T = 1)."""
    build, batch = MODELS[model_name]
    model = build()
    getattr(model, module).weight.requires_grad_(False)
    x, y = batch(4, "cross_entropy")
    c = _compute(model, x, y, approx="kfac")
    blk = c.blocks[module]
    assert blk.layout.param_names == ("bias",)
    torch.testing.assert_close(blk.A, torch.ones(1, 1, dtype=torch.float64))
    ref = Reference(model, x, y, "cross_entropy")
    torch.testing.assert_close(c.dense(), ref.shaped("fisher", "kfac"), rtol=0, atol=1e-10)
    s = next(s for s in ref.slices if s.name == module)
    full = ref.dense("fisher")[s.start:s.stop, s.start:s.stop]
    if isinstance(getattr(model, module), nn.Linear):
        torch.testing.assert_close(blk.dense(), full, rtol=0, atol=1e-10)
    else:  # weight sharing over positions: only the expand approximation
        assert (blk.dense() - full).abs().max() > 1e-6


def test_shared_parameters_kfac_next_to_a_bias_not_implemented() -> None:
    """Tied weights are supported (tests/test_tied_parameters.py); K-FAC of a tied weight whose
    first module also covers a bias is not (the uses' column factors differ in size): asked by name it raises,
    a plain approx='kfac' gives that block the diagonal (as it does to the layers without K-FAC)."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight  # tied weights in two modules
    model = nn.Sequential(a, nn.Tanh(), b).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=r"tied.*more than the tied parameter"):
        _compute(model, x, torch.zeros(4, dtype=torch.long), approx={"^0$": "kfac", "^2$": "kfac"})
    c = _compute(model, x, torch.zeros(4, dtype=torch.long), approx="kfac")
    assert c.approx == {"0": "diag", "2": "kfac"}


def test_module_called_twice_refused() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(torch.tanh(self.fc(x)))

    model = Twice().double()
    with pytest.raises(ValueError, match="more than once"):
        _compute(model, torch.randn(4, 3, dtype=torch.float64), torch.zeros(4, dtype=torch.long))


def test_capture_count_mode_counts_reuse_and_keeps_first_record() -> None:
    from curvature.capture import Capture

    fc = nn.Linear(3, 3)
    x1, x2 = torch.randn(2, 3), torch.randn(2, 3)
    with Capture({"fc": fc}, record_backward=True, on_reuse="count") as cap:
        fc(fc(x1)).sum().backward()
        fc(x2)
    assert cap.calls == {"fc": 3}
    assert torch.equal(cap.records["fc"].inputs[0], x1)
    assert len(cap.records["fc"].backward_grads) == 1
    with pytest.raises(ValueError, match="on_reuse='ignore'"):
        Capture({"fc": fc}, on_reuse="ignore")


def test_covered_module_not_called_refused() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.spare = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(x)

    model = Unused().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="spare"):
        _compute(model, x, torch.zeros(4, dtype=torch.long))
    c = _compute(model, x, torch.zeros(4, dtype=torch.long), skip_modules=["spare"])
    assert list(c.blocks) == ["fc"]


def test_no_supported_layer() -> None:
    with pytest.raises(ValueError, match="no module with curvature support"):
        _compute(nn.Sequential(nn.Tanh()), torch.randn(4, 3), torch.zeros(4, dtype=torch.long))
    model, x, y = _prelu_case()
    with pytest.raises(ValueError, match="no module with curvature support"):
        _compute(model, x, y, skip_modules=[nn.Linear, nn.PReLU])


@pytest.mark.parametrize("key", [nn.BatchNorm1d, "BatchNorm1d", "bn", nn.LayerNorm])
def test_kfac_requested_for_norm_layer_by_dict(key) -> None:
    build, batch = MODELS["norm_mlp"]
    model = build()
    x, y = batch(4, "cross_entropy")
    with pytest.raises(ValueError) as info:
        _compute(model, x, y, approx={key: "kfac"})
    msg = str(info.value)
    assert "kfac" in msg and re.search("BatchNorm1d|LayerNorm", msg), msg


@pytest.mark.parametrize("approx", ["kfac", {nn.Linear: "kfac"}, {"fc3": "kfac", nn.Linear: "diag"}])
def test_hessian_kfac_not_implemented(mlp, approx) -> None:
    model, x, y = mlp
    with pytest.raises(NotImplementedError, match="K-FAC of the Hessian"):
        _compute(model, x, y, kind="hessian", approx=approx)


@pytest.mark.parametrize("conv,pattern", [
    (lambda: nn.Conv2d(2, 4, 2, padding="same"), "padding='same'"),  # asymmetric: a 2×2 kernel
    (lambda: nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect"), "padding_mode='reflect'"),
])
def test_unsupported_conv_configurations(conv, pattern) -> None:
    model = nn.Sequential(conv(), nn.Flatten(), nn.LazyLinear(3)).double()
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    model(x)  # materialize the lazy layer
    with pytest.raises(ValueError, match=re.escape(pattern)):
        _compute(model, x, torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("make,pattern", [
    (lambda: nn.Embedding(5, 3, sparse=True), "sparse"),
    (lambda: nn.Embedding(5, 3, max_norm=1.0), "max_norm"),
    (lambda: nn.Embedding(5, 3, scale_grad_by_freq=True), "scale_grad_by_freq"),
])
def test_unsupported_embedding_configurations(make, pattern) -> None:
    model = nn.Sequential(make(), nn.Flatten(), nn.Linear(6, 3)).double()
    with pytest.raises(ValueError, match=pattern):
        _compute(model, torch.tensor([[1, 2], [3, 4]]), torch.zeros(2, dtype=torch.long))


# ---- skipping a module skips its submodules (nn.MultiheadAttention uses out_proj's weight itself) ----
class AttentionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(3, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.emb(x)
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h.mean(1))


def _attention_case():
    torch.manual_seed(0)
    model = AttentionNet().double()
    x = torch.randn(5, 6, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    return model, x, y


def test_unsupported_parent_named_and_out_proj_hint() -> None:
    """A MultiheadAttention configuration without curvature support (add_zero_attn) is named in the
    error (the supported ones: tests/test_attention.py). With its own parameters frozen, out_proj is
    covered but the parent uses its weight without calling it: a supported configuration is recomputed so
    that out_proj is called (tests/test_attention.py); an unsupported one is an error saying to skip the parent."""
    model, x, y = _attention_case()
    model.attn.add_zero_attn = True
    with pytest.raises(ValueError, match=r"MultiheadAttention.*add_zero_attn.*skip_modules"):
        _compute(model, x, y)
    for p in model.attn.parameters(recurse=False):
        p.requires_grad_(False)
    with pytest.raises(ValueError, match=r"attn\.out_proj.*not called.*skip the parent"):
        _compute(model, x, y)
    model.attn.add_zero_attn = False
    assert "attn.out_proj" in _compute(model, x, y).blocks


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap fallback for attention's backward
@pytest.mark.parametrize("skip", [[nn.MultiheadAttention], ["MultiheadAttention"], [r"^attn$"]],
                         ids=["type", "class-name", "anchored-regex"])
@pytest.mark.parametrize("approx", ["full", "kfac"])
def test_skip_parent_skips_submodules(skip, approx) -> None:
    model, x, y = _attention_case()
    c = _compute(model, x, y, kind="fisher", approx=approx, skip_modules=skip)
    assert list(c.blocks) == ["emb", "head"]
    assert not any(p is q for p in c.params for q in model.attn.parameters())
    ref_skip = [nn.MultiheadAttention] if skip == ["MultiheadAttention"] else skip
    ref = Reference(model, x, y, "cross_entropy", skip=ref_skip)
    torch.testing.assert_close(c.dense(), ref.shaped("fisher", approx), rtol=0, atol=1e-10)


def test_cross_entropy_class_dim_1_layout_names_the_fix() -> None:
    """Logits ``[N, C, H, W]`` with targets ``[N, H, W]`` (F.cross_entropy's layout): the curvature takes
    the classes last, and the error says how to move them there; the fix then runs."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1)).double()
    x = torch.randn(2, 1, 5, 6, dtype=torch.float64)
    y = torch.randint(0, 4, (2, 5, 6))
    with pytest.raises(ValueError, match=re.escape("output_selector=lambda out: out.movedim(1, -1)")):
        curvature.compute(model, x, y)
    c = curvature.compute(model, x, y, output_selector=lambda out: out.movedim(1, -1))
    assert c.dense().abs().max() > 0


def test_cross_entropy_logits_whose_shapes_fit_both_layouts_warn() -> None:
    """``[N, C, H, W]`` logits with ``C = H = W`` and ``[N, H, W]`` targets fit both layouts: compute takes the
    classes last (as documented) and warns with the fix; with an ``output_selector`` or a ``[N, T, C]`` sequence
    output with ``T = C`` it does not."""
    model = nn.Sequential(nn.Conv2d(2, 3, 1)).double()
    x = torch.randn(5, 2, 3, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (5, 3, 3))
    with pytest.warns(UserWarning, match=re.escape("output_selector=lambda out: out.movedim(1, -1)")):
        curvature.compute(model, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        curvature.compute(model, x, y, output_selector=lambda out: out.movedim(1, -1))
        seq = nn.Linear(4, 3).double()
        curvature.compute(seq, torch.randn(5, 3, 4, dtype=torch.float64), torch.randint(0, 3, (5, 3)))


def test_ignore_index_targets_point_to_the_masking_recipe() -> None:
    """-100 (F.cross_entropy's ignore_index) in the targets: the range error says how to leave the positions
    out; the one-logit error names the empirical Fisher from the user's backward too."""
    import pytest
    import torch
    from torch import nn

    import curvature
    model = nn.Linear(4, 3)
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, -100, 1, 0])
    with pytest.raises(ValueError, match=r"range \[-100, 2\].*ignore_index.*output_selector=lambda out: out\[mask\]"):
        curvature.compute(model, x, y, kind="fisher", approx="diag")
    with pytest.raises(ValueError, match=r"one class.*curvature='empirical_fisher' without targets"):
        curvature.compute(nn.Linear(4, 1), x, y.clamp(min=0), kind="fisher", approx="diag")


@pytest.mark.parametrize("how", ["functional", "forward_method", "vmap"])
def test_a_module_used_without_a_call_is_named_with_the_skip_and_the_call(how) -> None:
    """A module whose weights the forward uses without calling it (``F.linear(x, lin.weight)``, ``lin.forward(x)``)
    or calls only inside ``torch.vmap``: the error says the curvature records module calls, gives the exact
    ``skip_modules`` pattern, and the way to cover it."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 5)
            self.b = nn.Linear(5, 3)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            if how == "functional":
                return torch.nn.functional.linear(h, self.b.weight, self.b.bias)
            if how == "forward_method":
                return self.b.forward(h)
            return torch.vmap(self.b)(h)

    model = Net().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    with pytest.raises(ValueError, match=r"covered modules \['b'\] were not called") as err:
        curvature.compute(model, x, y, kind="fisher")
    text = str(err.value)
    assert "skip_modules=['^b$']" in text and "F.linear(x, lin.weight)" in text and "torch.vmap" in text
    c = curvature.compute(model, x, y, kind="fisher", skip_modules=["^b$"])  # the pattern given works
    assert list(c.blocks) == ["a"]


@pytest.mark.parametrize("curvature", ["empirical_fisher", "hessian"])
def test_nonfinite_targets_a_masked_loss_skips_are_named_at_the_first_step(curvature: str) -> None:
    """Missing regression labels as NaN, masked out of the loss: the curvature that takes the targets is
    undefined there. A ValueError naming the targets at the first step, not step after step skipped as if the
    model produced non-finite values; a Fisher kind, which does not read them, trains."""
    from torchsso2 import SecondOrderOptimizer
    torch.manual_seed(0)
    x, z = torch.randn(16, 4), torch.randn(16, 2)
    z[::3, 1] = float("nan")
    for kind in (curvature, "fisher_mc"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = SecondOrderOptimizer(model, loss="mse", curvature=kind, approx="diag", damping=1.0)

        def closure():
            opt.zero_grad()
            loss = masked_mse(model(x), z)
            loss.backward()
            return loss
        before = [p.detach().clone() for p in model.parameters()]
        if kind == curvature:
            with pytest.raises(ValueError, match=r"targets has 6 non-finite \(NaN/inf\) entries of 32") as info:
                opt.step(closure, targets=z)
            assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
            assert opt.num_skipped == 0
            if kind == "empirical_fisher":  # the fix the message names: the masked loss from your backward
                assert "leave targets= out" in str(info.value)
                opt.step(closure)
                assert opt.num_skipped == 0 and not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        else:
            opt.step(closure, targets=z)
            assert opt.num_skipped == 0 and not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_learned_noise_takes_sigma_from_the_observed_labels() -> None:
    """VIOptimizer(noise_variance="learned") with missing labels (NaN) a masked loss skips: σ² from the observed
    entries (before: the residual was NaN and σ² never learned, silently)."""
    from torchsso2 import VIOptimizer
    torch.manual_seed(0)
    x = torch.randn(32, 3)
    z = x @ torch.randn(3, 2) + 0.3 * torch.randn(32, 2)
    z[::4, 0] = float("nan")
    model = nn.Linear(3, 2)
    opt = VIOptimizer(model, dataset_size=320, loss="mse", noise_variance="learned", seed=0)

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = masked_mse(out, z)
        loss.backward()
        return loss, out
    for _ in range(5):
        opt.step(closure, targets=z)
    assert opt.noise.count == 5 and math.isfinite(opt.noise.variance) and opt.noise.variance > 0


def test_nonfinite_targets_on_one_rank_raise_on_every_rank(tmp_path) -> None:
    """``mpiexec -n 2``, NaN targets on rank 0 only: both ranks raise the ValueError (one all-reduce on the
    failure path), none skips and waits for the other in the next step's collectives."""
    from pathlib import Path
    from dist_utils import mpi_rank_results
    ranks = mpi_rank_results(Path(__file__).parent / "dist_scripts" / "nan_targets_worker.py", tmp_path)
    assert [r["raised"] for r in ranks] == [True, True], ranks
    assert "entries of 16" in ranks[0]["message"] and "on another rank" in ranks[1]["message"], ranks
    assert [r["skipped"] for r in ranks] == [0, 0]


@pytest.mark.parametrize("kind,approx", [(k, a) for k in ("fisher", "fisher_mc", "empirical_fisher", "hessian")
                                          for a in ("kfac", "diag", "full") if (k, a) != ("hessian", "kfac")])
def test_an_inf_input_that_the_model_maps_to_a_finite_output_is_refused(kind, approx) -> None:
    """ReLU zeroes the -inf pre-activation of an inf input: the output was finite, the first layer's
    statistics were not, and compute returned them without a word."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with torch.no_grad():
        model[0].weight.copy_(-model[0].weight.abs())
    x, y = torch.randn(6, 4).abs(), torch.randint(0, 2, (6,))
    x[0, 0] = math.inf
    assert bool(torch.isfinite(model(x)).all())
    with pytest.raises(ValueError, match=r"curvature of '0' is not finite"):
        curvature.compute(model, x, y, kind=kind, approx=approx)
    x[0, 0] = 1.0  # the same batch with a finite input: accepted
    assert curvature.compute(model, x, y, kind=kind, approx=approx).blocks["0"].is_finite()
