"""VIOptimizer's default diagonal (``curvature="reparam"``, IVON's ĥ = g·ε/σ²) needs only the
gradients, so it covers modules no layer family knows (an ``nn.GRU``, a custom module computing with
its own ``nn.Parameter``, a container's ``cls_token``) as IVON does: a diagonal block of their own
parameters (curvature/modules/parameters.py). The capture-based kinds still refuse them, and the
refusal names the way out and what a skip means for VI (no weight noise)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim_helpers import linreg_data, make_closure
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from curvature.modules.parameters import ParameterFamily
from curvature.selection import UncoveredModule


class FLinear(nn.Module):
    """``F.linear`` with its own parameters: no layer family covers it."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.empty(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LastStep(nn.Module):
    def forward(self, out):  # nn.GRU's (output, h_n) -> the last step's output
        return out[0][:, -1]


def _pair(seed: int = 0):
    """An MLP of nn.Linear layers and the same MLP of FLinear layers (the same initial values)."""
    torch.manual_seed(seed)
    plain = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    generic = nn.Sequential(FLinear(4, 6), nn.Tanh(), FLinear(6, 3)).double()
    generic.load_state_dict(plain.state_dict())
    return plain, generic


def _states(model: nn.Module, opt: VIOptimizer):
    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    for name, blk in opt.running.blocks.items():
        out[f"curvature {name}"] = blk.diagonal.clone()
        out[f"denom {name}"] = blk.decomposition["denom"].clone()
    return out


@pytest.mark.parametrize("settings", [dict(), dict(num_mc_samples=2, momentum=0.5), dict(kl_clip=None, lr=0.05)],
                         ids=["defaults", "two-samples", "no-clip"])
def test_a_module_without_a_layer_family_takes_the_steps_of_the_layer(settings):
    """The diagonal block of FLinear's own parameters is the reparam block nn.Linear gets (whose
    estimate is checked against its formula and the Bayesian-linear-regression fixed point in
    test_vi.py): the same parameters, curvature and decomposition after every step, bit for bit,
    on the flat path (one sample) and the general one (two samples)."""
    plain, generic = _pair()
    opts = [VIOptimizer(m, dataset_size=50, seed=1, **settings) for m in (plain, generic)]
    assert [opts[1].engine.layouts[n].family.__class__ for n in ("0", "2")] == [ParameterFamily] * 2
    assert opts[1].engine.generic == ["0", "2"] and opts[0].engine.generic == []
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        x, y = torch.randn(10, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (10,), generator=g)
        losses = [opt.step(make_closure(opt, m, x, y))[0] for m, opt in zip((plain, generic), opts)]
        assert torch.equal(*losses)
    a, b = _states(plain, opts[0]), _states(generic, opts[1])
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert opts[1].num_skipped == 0
    assert not torch.equal(opts[1].running.blocks["0"].diagonal, torch.full_like(a["curvature 0"], a["curvature 0"][0]))


def test_bayesian_linear_regression_through_a_module_without_a_layer_family():
    """The Bayesian-linear-regression run of test_vi.py's reparam fixed-point test, through FLinear:
    the same iterates as through nn.Linear (so the same fixed point, (XᵀX + δI)⁻¹Xᵀy)."""
    x, y = linreg_data(n=200, d=3)
    torch.manual_seed(0)
    plain = nn.Linear(3, 1, bias=False).double()
    generic = FLinear(3, 1).double()
    del generic.bias
    generic.register_parameter("bias", None)
    generic.weight.data.copy_(plain.weight.data)
    opts = [VIOptimizer(m, dataset_size=200, lr=0.5, loss="mse", prior_precision=20.0, momentum=0.0,
                        ema_decay=0.99, kl_clip=None, seed=0) for m in (plain, generic)]
    closures = [make_closure(opt, m, x, y, loss="mse") for m, opt in zip((plain, generic), opts)]
    for _ in range(200):
        for opt, closure in zip(opts, closures):
            opt.step(closure)
    assert torch.equal(plain.weight, generic.weight)
    assert torch.equal(opts[0].posterior_precision(), opts[1].posterior_precision())


def _gru_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.GRU(5, 8, batch_first=True), LastStep(), nn.LayerNorm(8), nn.Linear(8, 3))


def test_a_recurrent_model_trains_with_weight_noise_on_every_parameter(tmp_path):
    model = _gru_model()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 6, 5, generator=g), torch.randint(0, 3, (32,), generator=g)
    opt = VIOptimizer(model, dataset_size=32, lr=0.05, seed=0)  # the 60 steps' noise fixed
    assert opt.engine.generic == ["0"]
    assert sorted(opt.engine.layouts["0"].param_names) == ["bias_hh_l0", "bias_ih_l0", "weight_hh_l0", "weight_ih_l0"]
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: seen.append(m.weight_hh_l0.detach().clone()))
    first = None
    for t in range(60):
        before = model[0].weight_hh_l0.detach().clone()
        loss = opt.step(make_closure(opt, model, x, y))[0]
        first = float(loss) if first is None else first
        assert not torch.equal(seen[-1], before)  # the closure ran at a weight sample of the GRU too
    assert opt.num_skipped == 0
    with torch.no_grad():
        assert float(F.cross_entropy(model(x), y)) < 0.6 * first
    mean = model[0].weight_hh_l0.detach().clone()
    opt.predict(x[:4], num_samples=1)
    assert not torch.equal(seen[-1], mean)  # predictions sample the GRU's weights too
    assert torch.equal(model[0].weight_hh_l0.detach(), mean)  # and give the mean back
    torch.save(opt.state_dict(), tmp_path / "vi.pt")
    again = VIOptimizer(copy.deepcopy(model), dataset_size=32, lr=0.05)
    again.load_state_dict(torch.load(tmp_path / "vi.pt"))
    assert torch.equal(again.running.blocks["0"].diagonal, opt.running.blocks["0"].diagonal)


def test_parameters_a_container_holds_itself_are_covered():
    """A container's own parameter (a ViT's cls_token, a learned temperature) beside covered layers:
    a block of its own under reparam, where the other kinds ask for params= and add_param_group."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.temperature = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return self.fc(x) / self.temperature

    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    opt = VIOptimizer(model, dataset_size=16)
    assert opt.engine.generic == [""] and opt.engine.layouts[""].param_names == ("temperature",)
    t0 = float(model.temperature)
    for _ in range(3):
        opt.step(make_closure(opt, model, x, y))
    assert float(model.temperature) != t0 and opt.num_skipped == 0
    with pytest.raises(UncoveredModule, match="holds trainable parameters itself"):
        VIOptimizer(model, dataset_size=16, curvature="fisher_mc", approx="diag")


def test_capture_based_kinds_still_refuse_such_modules_and_say_what_a_skip_means():
    with pytest.raises(UncoveredModule, match=r"module '0' of type GRU .* VIOptimizer's default diagonal "
                                              r"\(curvature='reparam' with approx='diag'\) covers any module .* no "
                                              r"weight noise: its mean is a point estimate"):
        VIOptimizer(_gru_model(), dataset_size=32, curvature="fisher_mc", approx="diag")
    with pytest.raises(UncoveredModule, match="module '0' of type GRU") as err:
        SecondOrderOptimizer(_gru_model())
    assert "VIOptimizer" not in str(err.value)  # the VI hint belongs to VI
    with pytest.raises(ValueError, match=r"module '0' of type GRU has no layer curvature: .* not approx='full'"):
        VIOptimizer(_gru_model(), dataset_size=32, curvature="reparam", approx={"0": "full"})


def test_the_engine_refuses_a_capture_with_such_blocks():
    opt = VIOptimizer(_gru_model(), dataset_size=32)
    with pytest.raises(NotImplementedError, match=r"modules \['0'\] have no layer curvature"):
        opt.engine.capture()


class _StandardizedConv(nn.Conv2d):
    """A replaced forward (timm's weight-standardized convolution): not the layer Conv2d's formulas describe."""

    def forward(self, x):
        return F.conv2d(x, self.weight - self.weight.mean(), self.bias, padding=1)


@pytest.mark.parametrize("make, generic", [
    (lambda: nn.Sequential(nn.ConvTranspose2d(4, 4, 3, groups=4), nn.Flatten(), nn.Linear(576, 3)), ["0"]),
    (lambda: nn.Sequential(nn.Conv2d(4, 2, 3, padding=1, padding_mode="reflect"), nn.Flatten(), nn.Linear(200, 3)),
     ["0"]),
    (lambda: nn.Sequential(_StandardizedConv(4, 2, 3), nn.Flatten(), nn.Linear(200, 3)), ["0"]),
    (lambda: nn.Sequential(nn.Conv2d(4, 2, 3), nn.Flatten(),
                           nn.utils.parametrizations.weight_norm(nn.Linear(128, 3))), ["2.parametrizations.weight"]),
], ids=["grouped-transposed", "reflect-padding", "replaced-forward", "weight-norm"])
def test_layers_whose_family_formulas_do_not_apply_are_covered_by_their_gradients(make, generic):
    """The layer types whose options or reparametrizations the layer families refuse (they would give
    wrong Fisher blocks) need nothing of the layer under reparam: diagonal blocks of their own
    parameters, as for an unknown module."""
    torch.manual_seed(0)
    model = make()
    x, y = torch.randn(8, 4, 10, 10), torch.randint(0, 3, (8,))
    opt = VIOptimizer(model, dataset_size=8)
    assert opt.engine.generic == generic
    for _ in range(3):
        opt.step(make_closure(opt, model, x, y))
    assert opt.num_skipped == 0
    with pytest.raises(ValueError):  # the layer kinds refuse them as before
        VIOptimizer(make(), dataset_size=8, curvature="fisher_mc", approx="diag")


def test_a_refusal_a_skip_would_not_help_stands():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=r"Embedding\(sparse=True\) is not supported"):
        VIOptimizer(model, dataset_size=8)


@pytest.mark.parametrize("option", [{"max_norm": 1.0}, {"scale_grad_by_freq": True}], ids=["max_norm", "sgbf"])
def test_embedding_options_the_gradients_cannot_describe_are_refused_and_a_skip_helps(option):
    """``max_norm`` renormalizes the weight in place in forward: under the default diagonal that was the weight
    sample, never the mean (a forward at the mean then rewrote the posterior mean). ``scale_grad_by_freq``'s
    gradient is not the loss's. Both are refused (before: trained silently); skipped, the module takes the
    plain update, where max_norm acts on the parameter itself as under torch.optim."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(6, 3, **option), nn.Flatten(), nn.Linear(6, 3))
    with pytest.raises(ValueError, match=f"{next(iter(option))}.*skip_modules"):
        VIOptimizer(make(), dataset_size=8)
    model = make()
    opt = VIOptimizer(model, dataset_size=8, lr=0.1, skip_modules=["^0$"])
    x, y = torch.randint(0, 6, (8, 2)), torch.randint(0, 3, (8,))
    for _ in range(3):
        opt.step(make_closure(opt, model, x, y))
    if "max_norm" in option:
        assert float(model[0].weight[x.unique()].norm(dim=1).max()) <= 1.0 + 1e-6


def test_the_padding_row_of_a_tied_embedding_is_sampled():
    """A tied output head trains the padding row of ``Embedding(padding_idx=0)``: it has a posterior and
    its weight sample moves (it stayed at the mean); an untied padding row is not sampled."""
    class Tied(nn.Module):
        def __init__(self, tie: str) -> None:
            super().__init__()
            self.emb = nn.Embedding(7, 3, padding_idx=0)
            self.dec = nn.Embedding(7, 3, padding_idx=0)
            self.head = nn.Linear(3, 7, bias=False)
            if tie == "head":
                self.head.weight = self.emb.weight
            if tie == "embedding":  # an encoder and a decoder sharing the table: nothing trains the padding row
                self.dec.weight = self.emb.weight

        def forward(self, tokens):
            return self.head(self.emb(tokens).mean(1) + self.dec(tokens).mean(1))

    for tie, sampled in (("head", True), ("none", False), ("embedding", False)):
        torch.manual_seed(0)
        model = Tied(tie)
        opt = VIOptimizer(model, dataset_size=8)
        x, y = torch.randint(0, 7, (8, 4)), torch.randint(0, 7, (8,))
        opt.step(make_closure(opt, model, x, y))
        mean = model.emb.weight.detach().clone()
        with torch.no_grad(), opt.sampled_params(generator=torch.Generator().manual_seed(1)):
            moved = (model.emb.weight - mean).abs().sum(1)
        assert bool(moved[1:].gt(0).all())
        assert bool(moved[0].gt(0)) == sampled, tie
