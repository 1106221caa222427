"""``loss="binary_cross_entropy"``: a Bernoulli likelihood on each logit (binary and multi-label classifiers).

The curvature of every kind × shape × layer family is checked against the brute force in
``test_curvature_reference.py`` (the loss is one of its ``LOSSES``) and in closed form in
``test_curvature_exact.py`` (logistic regression: Fisher = GGN = Hessian = ``X̃ᵀ diag(p(1 − p)) X̃ / N``). Here:
the adaptive step's quadratic model, each optimizer trained on a real binary task (scikit-learn's breast
cancer data), ``VIOptimizer.predict``, the loss-scale check and the errors.
"""
from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvature
from curvature.options import LossType
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.optim.adaptive import InputRecorder, ggn_gram, output_hessian_inner

from optim_helpers import flat, param_vec
from reference import nll

BCE = "binary_cross_entropy"


def test_ggn_gram_is_jt_h_j_with_the_bernoulli_output_hessian():
    """Adaptive mode's Gram of two directions under the Bernoulli likelihood against ``Vᵀ (Jᵀ H J / N) V`` with
    ``H_n`` the autograd Hessian of the reference's written-out NLL in the logits (not the library's square root)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (6, 3), generator=g).double()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    rec = InputRecorder()
    with rec.record(model):
        model(x)
    dirs = [[torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params] for _ in range(2)]
    gram = ggn_gram(model, rec.calls, names, params, dirs, LossType.BINARY_CROSS_ENTROPY, lambda o: o)
    theta = param_vec(model)

    def forward(v: torch.Tensor) -> torch.Tensor:
        i, new = 0, {}
        for name, p in model.named_parameters():
            new[name] = v[i:i + p.numel()].reshape(p.shape)
            i += p.numel()
        return torch.func.functional_call(model, new, (x,))

    jac = torch.autograd.functional.jacobian(forward, theta)  # [N, 3, P]
    out = model(x).detach()
    h = torch.stack([torch.func.hessian(lambda f: nll(BCE, f, y[n]))(out[n]) for n in range(6)])
    ggn = torch.einsum("ncp,ncd,ndq->pq", jac, h, jac) / x.shape[0]
    vs = torch.stack([flat(d) for d in dirs])
    torch.testing.assert_close(gram, vs @ ggn @ vs.t(), rtol=1e-12, atol=1e-12)
    u, w = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    torch.testing.assert_close(output_hessian_inner(LossType.BINARY_CROSS_ENTROPY, out, u, w),
                               torch.einsum("nc,ncd,nd->", u, h, w))


def _breast_cancer():
    sklearn = pytest.importorskip("sklearn.datasets")
    x, y = sklearn.load_breast_cancer(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = torch.tensor(x, dtype=torch.float32)[perm], torch.tensor(y, dtype=torch.float32)[perm]
    return x[:450], y[:450], x[450:], y[450:]


#: each optimizer face's arguments (lr at its default unless the face needs the library's suggested one)
FACES = {
    "sso-kfac": {"loss": BCE},
    "sso-adaptive": {"loss": BCE, "use_adaptive_learning_rate": True, "use_adaptive_momentum": True,
                     "adaptive_damping": True},
    "sso-hessian-diag": {"loss": BCE, "curvature": "hessian", "approx": "diag"},
    "sso-empirical": {"loss": BCE, "curvature": "empirical_fisher"},
    "vi-diag": {"dataset_size": 450, "loss": BCE, "lr": 0.1},
    "vi-kfac": {"dataset_size": 450, "loss": BCE, "lr": 0.1, "approx": "kfac"},
}


@pytest.mark.parametrize("face", list(FACES))
def test_every_face_trains_a_binary_classifier_without_a_warning_or_skipped_step(face):
    """Logits ``[N]`` (the model's ``[N, 1]`` squeezed by ``output_selector`` as the loss squeezes it), the
    closure's loss ``F.binary_cross_entropy_with_logits``: held-out accuracy of a logistic-regression level."""
    x, y, xt, yt = _breast_cancer()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 16), nn.ReLU(), nn.Linear(16, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kwargs = FACES[face]
        cls = VIOptimizer if "dataset_size" in kwargs else SecondOrderOptimizer
        opt = cls(model, **kwargs, output_selector=lambda o: o.squeeze(-1))
        gen = torch.Generator().manual_seed(0)
        for _ in range(6):
            for idx in torch.randperm(450, generator=gen).split(64):
                xb, yb = x[idx], y[idx]

                def closure():
                    opt.zero_grad()
                    out = model(xb).squeeze(-1)
                    loss = F.binary_cross_entropy_with_logits(out, yb)
                    loss.backward()
                    return loss, out

                opt.step(closure, targets=yb)
    assert opt.num_skipped == 0
    with torch.no_grad():
        p = opt.predict(xt, generator=torch.Generator().manual_seed(0)) if isinstance(opt, VIOptimizer) \
            else torch.sigmoid(model(xt).squeeze(-1))
    assert p.shape == yt.shape
    acc = float(((p > 0.5).float() == yt).float().mean())
    assert acc >= 0.95, (face, acc)
    assert float(F.binary_cross_entropy(p.clamp(1e-6, 1 - 1e-6), yt)) < 0.2


def test_predict_is_the_average_of_the_samples_sigmoids():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = VIOptimizer(model, dataset_size=100, loss=BCE)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8, 2)).float()

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.binary_cross_entropy_with_logits(out, y, reduction="sum") / len(x)
        loss.backward()
        return loss, out

    for _ in range(3):
        opt.step(closure, targets=y)
    got = opt.predict(x, num_samples=5, generator=torch.Generator().manual_seed(3), antithetic=False)
    g = torch.Generator().manual_seed(3)
    expected = torch.zeros(8, 2)
    model.eval()
    with torch.no_grad():
        for _ in range(5):
            with opt.sampled_params(generator=g):
                expected += torch.sigmoid(model(x)) / 5
    torch.testing.assert_close(got, expected)
    assert float(got.min()) > 0 and float(got.max()) < 1


@pytest.mark.parametrize("reduction,warned", [("mean", True), ("sum_over_n", False)])
def test_a_multi_label_loss_averaged_over_the_labels_is_warned_about(reduction, warned):
    """With D labels per example the NLL sums over them: ``reduction='mean'`` is ``1/D`` of it (a step ``D×``
    short), which the first step given ``targets`` warns about; ``'sum'`` over N is the NLL."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))
    opt = SecondOrderOptimizer(model, loss=BCE)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8, 3)).float()

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.binary_cross_entropy_with_logits(out, y) if reduction == "mean" else \
            F.binary_cross_entropy_with_logits(out, y, reduction="sum") / len(x)
        loss.backward()
        return loss, out

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step(closure, targets=y)
    texts = [str(w.message) for w in caught]
    assert any("binary_cross_entropy_with_logits summed over an example's outputs" in t for t in texts) is warned, texts


def test_bad_targets_and_outputs_are_clear_errors():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    cases = [
        (torch.tensor([[0.0, 1.0], [1.0, 2.0], [0.0, 0.0], [1.0, 1.0]]), "targets in [0, 1]"),
        (torch.tensor([[0.0, 1.0], [1.0, float("nan")], [0.0, 0.0], [1.0, 1.0]]), "non-finite"),
        (-torch.ones(4, 2), "(y + 1) / 2"),
        (torch.zeros(4), "targets of the logits' shape"),
        (torch.randint(0, 2, (4,)), "class indices"),
        (torch.zeros(4, 2, dtype=torch.complex64), "dtype"),
    ]
    for y, text in cases:
        with pytest.raises(ValueError, match=re.escape(text)):
            curvature.compute(model, x, y, loss=BCE, kind="empirical_fisher", approx="diag")
    with pytest.raises(ValueError, match=r"y.unsqueeze\(-1\)"):
        curvature.compute(nn.Linear(3, 1), x, torch.zeros(4), loss=BCE, kind="empirical_fisher", approx="diag")
    # integer and boolean 0/1 labels are taken, as the floats they stand for
    for y in (torch.randint(0, 2, (4, 2)), torch.randint(0, 2, (4, 2)).bool()):
        c = curvature.compute(model, x, y, loss=BCE, kind="empirical_fisher", approx="full").dense()
        torch.testing.assert_close(c, curvature.compute(model, x, y.float(), loss=BCE, kind="empirical_fisher",
                                                        approx="full").dense())
    # one logit under the categorical likelihood points here
    with pytest.raises(ValueError, match="loss='binary_cross_entropy'"):
        curvature.compute(nn.Linear(3, 1), x, torch.zeros(4, dtype=torch.long), kind="fisher", approx="diag")
    with pytest.raises(ValueError, match="expected one of .*'binary_cross_entropy'"):
        curvature.compute(model, x, torch.zeros(4, 2), loss="bce", kind="fisher", approx="diag")


def test_a_saturated_logit_keeps_a_finite_nonnegative_curvature():
    """``p(1 − p)`` as ``σ(f)·σ(−f)``: logits of ±40 (p rounds to 1 in float32) give tiny, not negative or NaN,
    output Hessians; the Monte-Carlo labels of a certain example are certain."""
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(20.0)
        model.bias.zero_()
    x = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [0.1, 0.0]])
    y = torch.tensor([[1.0], [0.0], [1.0]])
    for kind in ("fisher", "fisher_mc", "hessian"):
        c = curvature.compute(model, x, y, loss=BCE, kind=kind, approx="full").dense()
        assert bool(torch.isfinite(c).all()) and float(torch.linalg.eigvalsh(c.double()).min()) > -1e-7, kind


def test_noise_variance_belongs_to_the_gaussian_in_any_spelling():
    """``noise_variance`` is the Gaussian likelihood's: refused with the Bernoulli one, taken with ``loss="MSE"``
    (the loss is parsed in any case, as every choice argument)."""
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="noise_variance is the variance of the Gaussian likelihood"):
        VIOptimizer(model, dataset_size=10, loss=BCE, noise_variance=0.5)
    assert VIOptimizer(model, dataset_size=10, loss="MSE", noise_variance=0.5).noise.variance == 0.5


def test_the_peers_benchmark_runs_with_or_without_its_peers(tmp_path, monkeypatch):
    """``benchmarks/peers_bce.py`` skips a missing peer by name; an installed one agrees to float64 round-off."""
    import json

    from benchmarks import peers_bce

    peers_bce.main(["--json", str(tmp_path / "p.json")])
    report = json.loads((tmp_path / "p.json").read_text())
    for name in ("curvlinops", "backpack"):
        assert (name in report["skipped"]) != any(r["peer"] == name for r in report["rows"])
    assert all(r["agrees"] for r in report["rows"])
    monkeypatch.setenv("BENCH_DISABLE_PEERS", "all")  # the skip path, whatever is installed
    peers_bce.main(["--json", str(tmp_path / "none.json")])
    report = json.loads((tmp_path / "none.json").read_text())
    assert report["rows"] == [] and set(report["skipped"]) == {"curvlinops", "backpack"}


@pytest.mark.parametrize("samples", [1, 3])
def test_a_batch_split_into_micro_batches_draws_the_same_labels(samples):
    """The Monte-Carlo labels are drawn example-major, as the categorical ones: the closure's two micro-batches
    (5 + 7 examples, losses weighted by their share) give the one-batch curvature, for several samples too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(12, 3, dtype=torch.float64), torch.randint(0, 2, (12, 2)).double()

    def run(splits):
        m = copy.deepcopy(model)
        opt = SecondOrderOptimizer(m, loss=BCE, mc_samples=samples, seed=5, approx="full")

        def closure():
            opt.zero_grad()
            outs, start = [], 0
            for n in splits:
                out = m(x[start:start + n])
                (F.binary_cross_entropy_with_logits(out, y[start:start + n], reduction="sum") / 12).backward()
                outs.append(out)
                start += n
            return torch.tensor(0.0), torch.cat(outs)

        opt.step(closure, targets=y)
        return {k: b.dense() for k, b in opt.running.blocks.items()}

    whole, split = run([12]), run([5, 7])
    for k in whole:
        torch.testing.assert_close(split[k], whole[k], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("targets", [False, True])
def test_vi_default_diagonal_refuses_one_logit_under_cross_entropy_at_the_first_step(targets):
    """VIOptimizer's default diagonal estimates nothing from the output, so a one-logit model left at
    ``loss='cross_entropy'`` trained without a word and failed at ``predict()``: now the first step says it
    (the state unchanged), as the other kinds do."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1))
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    opt = VIOptimizer(model, dataset_size=100)
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.binary_cross_entropy_with_logits(out.squeeze(-1), y.float())
        loss.backward()
        return loss, out
    with pytest.raises(ValueError, match="one class.*loss='binary_cross_entropy'"):
        opt.step(closure, targets=y.unsqueeze(-1) if targets else None)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert not opt.state
