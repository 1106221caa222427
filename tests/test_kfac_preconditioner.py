"""Single-process tests of torchsso2.kfac.KFACPreconditioner (kfac_pytorch drop-in).

The reference below is a hand-written implementation of the published formulas with
kfac_pytorch's factor scaling (docs/kfac.md), independent of the engine:

* Linear: ``A = ÃᵀÃ / N``, ``G = ∇ₒᵀ∇ₒ / N`` (rows = examples, ∇ₒ = ∂L_mean/∂output);
* Conv2d: rows = (example, patch) pairs, ``A = ÃᵀÃ / (N·T³)``, ``G = ∇ₒᵀ∇ₒ / (N·T³)``;
* EMA from the identity; eigen ``Q_G[(Q_Gᵀ ∇W Q_A) / (λ_G λ_Aᵀ + d)]Q_Aᵀ`` or inverse
  ``(G + dI)⁻¹ ∇W (A + dI)⁻¹``; KL clip ``ν = min(1, sqrt(kl_clip / (lr² Σ pᵀg)))``.
"""
from __future__ import annotations

import copy
import io
import math
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchsso2.kfac import AssignmentStrategy, ComputeMethod, DistributedStrategy, KFACPreconditioner
from torchsso2.distributed import LocalCommunicator

sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))
from kfac_dist_common import ConvNet  # noqa: E402  (the same ConvNet the distributed tests train)

DT = torch.float64


# ---------------------------------------------------------------------------- models & data
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(7, 4, bias=False)
        self.fc3 = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(torch.tanh(self.fc2(self.act(self.fc1(x)))))


def build(kind: str, dtype: torch.dtype = DT, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return (ConvNet() if kind == "conv" else MLP()).to(dtype)


def batch(kind: str, n: int, seed: int, dtype: torch.dtype = DT) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn((n, 2, 5, 5) if kind == "conv" else (n, 5), generator=g, dtype=dtype)
    return x, torch.randint(0, 3, (n,), generator=g)


def loss_fn(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y)


def grads(model: nn.Module) -> Dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------- hand-written reference
def _value(h, step):
    return h(step) if callable(h) else h


def ref_batch_factors(model: nn.Module, x: Tensor, y: Tensor) -> Tuple[Dict[str, Tuple[Tensor, Tensor]], Tensor]:
    """Backward of the mean loss; per layer ``(A, G)`` by the formulas above. Returns the loss too."""
    inputs, outputs = {}, {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            def hook(mod, inp, out, name=name):
                inputs[name] = inp[0].detach()
                # a tensor hook sees ∂L/∂(this output) even if an in-place op follows
                out.register_hook(lambda g, name=name: outputs.__setitem__(name, g))
            handles.append(m.register_forward_hook(hook))
    loss = loss_fn(model, x, y)
    loss.backward()
    for h in handles:
        h.remove()
    facs = {}
    for name, m in model.named_modules():
        if name not in inputs:
            continue
        a, go = inputs[name], outputs[name]
        n = a.shape[0]
        if isinstance(m, nn.Conv2d):
            p = F.unfold(a, m.kernel_size, padding=m.padding, stride=m.stride)  # [N, d, T]
            t = p.shape[2]
            rows = p.transpose(1, 2).reshape(n * t, -1)
            grows = go.reshape(n, go.shape[1], -1).transpose(1, 2).reshape(n * t, -1)
            norm = n * t ** 3
        else:
            rows, grows, norm = a, go, n
        if m.bias is not None:
            rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], 1)
        facs[name] = (rows.t() @ rows / norm, grows.t() @ grows / norm)
    return facs, loss


def grad_matrix(m: nn.Module) -> Tensor:
    gw = m.weight.grad.reshape(m.weight.shape[0], -1)
    return gw if m.bias is None else torch.cat([gw, m.bias.grad[:, None]], 1)


def set_matrix(m: nn.Module, mat: Tensor) -> None:
    k = m.weight[0].numel()
    m.weight.grad = mat[:, :k].reshape(m.weight.shape).clone()
    if m.bias is not None:
        m.bias.grad = mat[:, k].clone()


def reference_run(model: nn.Module, batches, *, method="eigen", prediv=True, damping=0.001, lr=0.1,
                  kl_clip=0.001, factor_decay=0.95, factor_update_steps=1, inv_update_steps=1,
                  sgd_lr=0.1) -> List[Dict[str, Tensor]]:
    """The published K-FAC step, by hand, for a list of steps; each step a list of micro-batches."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    fac: Dict[str, List[Tensor]] = {}
    dec: Dict[str, dict] = {}
    out = []
    for step, micro in enumerate(batches):
        model.zero_grad()
        factor_step = step % _value(factor_update_steps, step) == 0
        acc: Dict[str, List[Tensor]] = {}
        for x, y in micro:
            f, _ = ref_batch_factors(model, x, y)
            for n, (a, g) in f.items():
                acc.setdefault(n, []).append((a, g))
        for p in model.parameters():
            p.grad /= len(micro)
        decay = _value(factor_decay, step)
        if factor_step:
            for n, lst in acc.items():
                a = sum(t[0] for t in lst) / len(lst)
                g = sum(t[1] for t in lst) / len(lst)
                old = fac.get(n, [torch.eye(a.shape[0], dtype=a.dtype), torch.eye(g.shape[0], dtype=g.dtype)])
                fac[n] = [decay * old[0] + (1 - decay) * a, decay * old[1] + (1 - decay) * g]
        d = _value(damping, step)
        if step % _value(inv_update_steps, step) == 0:
            for n, (a, g) in fac.items():
                if method == "eigen":
                    la, qa = torch.linalg.eigh(a)
                    lg, qg = torch.linalg.eigh(g)
                    la, lg = la.clamp(min=0), lg.clamp(min=0)
                    dec[n] = dict(qa=qa, qg=qg, la=la, lg=lg, D=1 / (torch.outer(lg, la) + d))
                else:
                    dec[n] = dict(ai=torch.linalg.inv(a + d * torch.eye(a.shape[0], dtype=a.dtype)),
                                  gi=torch.linalg.inv(g + d * torch.eye(g.shape[0], dtype=g.dtype)))
        pre = {}
        for n, m in layers.items():
            gm, e = grad_matrix(m), dec[n]
            if method == "eigen":
                denom = e["D"] if prediv else 1 / (torch.outer(e["lg"], e["la"]) + d)
                pre[n] = e["qg"] @ ((e["qg"].t() @ gm @ e["qa"]) * denom) @ e["qa"].t()
            else:
                pre[n] = e["gi"] @ gm @ e["ai"]
        lr_s, kl = _value(lr, step), _value(kl_clip, step)
        vg = sum(float((pre[n] * grad_matrix(m)).sum()) for n, m in layers.items()) * lr_s ** 2
        nu = 1.0 if vg == 0 else min(1.0, math.sqrt(kl / abs(vg)))
        for n, m in layers.items():
            set_matrix(m, nu * pre[n])
        out.append(grads(model))
        with torch.no_grad():
            for p in model.parameters():
                p -= sgd_lr * p.grad
    return out


def our_run(model: nn.Module, batches, sgd_lr=0.1, divide_loss: bool = False, **kw) -> List[Dict[str, Tensor]]:
    """Our preconditioner; each step feeds its micro-batches (accumulation_steps = len(micro))."""
    kw.setdefault("accumulation_steps", len(batches[0]))
    kw.setdefault("inv_dtype", DT)
    pre = KFACPreconditioner(model, **kw)
    out = []
    for micro in batches:
        model.zero_grad()
        for x, y in micro:
            loss_fn(model, x, y).backward()
        for p in model.parameters():
            p.grad /= len(micro)
        pre.step()
        out.append(grads(model))
        with torch.no_grad():
            for p in model.parameters():
                p -= sgd_lr * p.grad
    return out


def assert_runs_close(a, b, rtol=1e-9):
    assert len(a) == len(b)
    for step, (ga, gb) in enumerate(zip(a, b)):
        for name in ga:
            scale = gb[name].abs().max().clamp_min(1e-30)
            err = float((ga[name] - gb[name]).abs().max() / scale)
            assert err < rtol, f"step {step} {name}: rel err {err:.3g}"


def make_batches(kind: str, steps: int, micro: int = 1, n: int = 6):
    return [[batch(kind, n, seed=10 * s + k) for k in range(micro)] for s in range(steps)]


# ---------------------------------------------------------------------------- the formulas
@pytest.mark.parametrize("kind", ["mlp", "conv"])
@pytest.mark.parametrize("method,prediv", [("eigen", True), ("eigen", False), ("inverse", True)])
def test_matches_published_formulas(kind, method, prediv):
    batches = make_batches(kind, 3)
    hyper = dict(damping=0.01, lr=0.3, kl_clip=0.01, factor_decay=0.9)
    ref = reference_run(build(kind), batches, method=method, prediv=prediv, **hyper)
    ours = our_run(build(kind), batches, compute_method=method, compute_eigenvalue_outer_product=prediv, **hyper)
    assert_runs_close(ours, ref)


def test_kl_clip_active_and_inactive():
    """With a huge kl_clip ν = 1 (pure preconditioning); with a tiny one ν < 1 scales all layers."""
    kind, batches = "mlp", make_batches("mlp", 1)
    big = our_run(build(kind), batches, kl_clip=1e6, damping=0.01)
    small = our_run(build(kind), batches, kl_clip=1e-8, damping=0.01)
    ratios = {n: float(small[0][n].norm() / big[0][n].norm()) for n in big[0]}
    nu = next(iter(ratios.values()))
    assert nu < 1
    assert all(abs(r - nu) < 1e-9 for r in ratios.values())
    none = our_run(build(kind), batches, kl_clip=lambda step: None, damping=0.01)
    assert_runs_close(none, big, rtol=1e-12)


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_cadence_and_callables(kind):
    batches = make_batches(kind, 6)
    hyper = dict(damping=lambda s: 0.01 * (1 + s), lr=lambda s: 0.1 / (1 + s), kl_clip=lambda s: 0.01,
                 factor_decay=lambda s: 0.8 if s < 3 else 0.9, factor_update_steps=2, inv_update_steps=4)
    for prediv in (True, False):  # prediv freezes the damping of the inverse step, otherwise current damping
        ref = reference_run(build(kind), batches, prediv=prediv, **hyper)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ours = our_run(build(kind), batches, compute_eigenvalue_outer_product=prediv, **hyper)
        assert_runs_close(ours, ref)


def test_factor_and_inverse_cadence_state():
    model = build("mlp")
    pre = KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=4, inv_dtype=DT)
    layer = pre.layers["fc1"]
    seen = []
    for s in range(8):
        model.zero_grad()
        loss_fn(model, *batch("mlp", 4, s)).backward()
        pre.step()
        seen.append((layer.a_factor.clone(), layer.inv["qa"].clone()))
    for s in range(1, 8):
        assert torch.equal(seen[s][0], seen[s - 1][0]) == (s % 2 != 0), s
        assert torch.equal(seen[s][1], seen[s - 1][1]) == (s % 4 != 0), s
    assert pre.steps == 8


def test_eval_mode_and_no_grad_forwards_are_ignored():
    model = build("mlp")
    pre = KFACPreconditioner(model)
    model.eval()
    loss_fn(model, *batch("mlp", 4, 0)).backward()
    with torch.no_grad():
        model.train()
        model(batch("mlp", 4, 1)[0])
    assert all(layer.batch_count == 0 and layer.a_factor is None for layer in pre.layers.values())


# ---------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("in_hook", [True, False])
@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_accumulation_steps_equals_average_of_micro_batch_factors(kind, in_hook):
    """kfac_pytorch's accumulation: A, G = mean over the N micro-batches of their factors."""
    batches = make_batches(kind, 3, micro=3, n=4)
    ref = reference_run(build(kind), batches, damping=0.01)
    ours = our_run(build(kind), batches, damping=0.01, update_factors_in_hook=in_hook)
    assert_runs_close(ours, ref)


# ---------------------------------------------------------------------------- registration
def test_skip_layers_by_name_and_class():
    assert list(KFACPreconditioner(build("conv")).layers) == ["conv1", "conv2", "fc"]
    assert list(KFACPreconditioner(build("conv"), skip_layers=["conv"]).layers) == ["fc"]
    assert list(KFACPreconditioner(build("conv"), skip_layers=["Linear"]).layers) == ["conv1", "conv2"]
    assert list(KFACPreconditioner(build("conv"), skip_layers=["^fc$", "conv2"]).layers) == ["conv1"]
    model = build("mlp")
    model.fc2.weight.requires_grad_(False)
    assert list(KFACPreconditioner(model).layers) == ["fc1", "fc3"]


def test_a_skip_layers_entry_matching_nothing_is_named():
    with pytest.warns(UserWarning, match=r"skip_layers entry 'fc_2' matches no module of the model"):
        assert list(KFACPreconditioner(build("conv"), skip_layers=["fc_2", "conv2"]).layers) == ["conv1", "fc"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KFACPreconditioner(build("conv"), skip_layers=["Linear"])


def test_skipped_and_unsupported_layers_keep_their_gradient():
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3)).to(DT)
    pre = KFACPreconditioner(model, skip_layers=["^2$"])
    x = torch.randn(6, 4, dtype=DT)
    model(x).pow(2).mean().backward()
    before = grads(model)
    pre.step()
    after = grads(model)
    assert not torch.equal(before["0.weight"], after["0.weight"])
    for name in ("1.weight", "1.bias", "2.weight", "2.bias"):
        assert torch.equal(before[name], after[name])


def test_linear_on_3d_input_scales_g_by_positions():
    """Linear applied at T positions: A = ÃᵀÃ/(N·T), G = ∇ᵀ∇/(N·T) (kfac_pytorch)."""
    lin = nn.Linear(4, 3).to(DT)
    pre = KFACPreconditioner(lin, update_factors_in_hook=False)
    x = torch.randn(2, 5, 4, dtype=DT)
    out = lin(x)
    out.retain_grad()
    out.pow(2).mean().backward()
    rows = torch.cat([x.reshape(10, 4), torch.ones(10, 1, dtype=DT)], 1)
    g = out.grad.reshape(10, 3)
    layer = pre.layers[""]
    assert torch.allclose(layer.a_batch, rows.t() @ rows / 10)
    assert torch.allclose(layer.g_batch, g.t() @ g / 10)


# ---------------------------------------------------------------------------- state dict
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_state_dict_round_trip_resumes_bit_identically(method):
    kind = "conv"
    batches = make_batches(kind, 6)
    kw = dict(compute_method=method, factor_update_steps=2, inv_update_steps=2, damping=0.01)

    def run(model, pre, bs):
        out = []
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for micro in bs:
            opt.zero_grad()
            loss_fn(model, *micro[0]).backward()
            pre.step()
            out.append(grads(model))
            opt.step()
        return out

    model = build(kind)
    pre = KFACPreconditioner(model, **kw)
    run(model, pre, batches[:2])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "kfac": pre.state_dict()}, buf)
    straight = run(model, pre, batches[2:])

    buf.seek(0)
    ckpt = torch.load(buf)
    model2 = build(kind, seed=123)
    model2.load_state_dict(ckpt["model"])
    pre2 = KFACPreconditioner(model2, compute_method=method, damping=0.5)
    pre2.load_state_dict(ckpt["kfac"])
    assert pre2.steps == 2 and pre2.damping == 0.01 and pre2.factor_update_steps == 2
    resumed = run(model2, pre2, batches[2:])
    for a, b in zip(straight, resumed):
        for n in a:
            assert torch.equal(a[n], b[n]), n


def test_state_dict_contents_and_options():
    model = build("mlp")
    pre = KFACPreconditioner(model, damping=lambda s: 0.1)
    loss_fn(model, *batch("mlp", 4, 0)).backward()
    pre.step()
    sd = pre.state_dict()
    assert sd["steps"] == 1 and "damping" not in sd and sd["lr"] == 0.1
    assert set(sd["layers"]) == {"fc1", "fc2", "fc3"} and set(sd["layers"]["fc1"]) == {"A", "G"}
    assert sd["layers"]["fc1"]["A"].shape == (6, 6)
    light = pre.state_dict(include_factors=False)
    assert "layers" not in light
    other = KFACPreconditioner(build("mlp"))
    with pytest.warns(UserWarning, match="not included"):
        other.load_state_dict(light)
    assert other.steps == 1
    with pytest.raises(ValueError, match="missing"):
        KFACPreconditioner(build("mlp"), skip_layers=["fc3"]).load_state_dict(sd)


# ---------------------------------------------------------------------------- AMP scaler
def test_grad_scaler_unscales_g_and_skips_overflow():
    kind, batches = "conv", make_batches("conv", 2)
    plain = our_run(build(kind), batches, damping=0.01)
    scale = 1024.0
    model = build(kind)
    pre = KFACPreconditioner(model, damping=0.01, grad_scaler=lambda: scale, inv_dtype=DT)
    scaled = []
    for micro in batches:
        model.zero_grad()
        (loss_fn(model, *micro[0]) * scale).backward()
        for p in model.parameters():
            p.grad /= scale
        pre.step()
        scaled.append(grads(model))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    assert_runs_close(scaled, plain, rtol=1e-9)
    # an overflowing backward: factors untouched, gradients left as they are
    a_before = pre.layers["fc"].a_factor.clone()
    model.zero_grad()
    (loss_fn(model, *batches[0][0]) * float("inf")).backward()
    raw = grads(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre.step()
    assert torch.equal(pre.layers["fc"].a_factor, a_before)
    for n, g in grads(model).items():
        assert torch.equal(g.nan_to_num(), raw[n].nan_to_num())


class _Scaler:
    def __init__(self, s: float) -> None:
        self.s = s

    def get_scale(self) -> float:
        return self.s


def test_grad_scaler_object_with_get_scale():
    x, y = batch("mlp", 4, 0)
    model, plain = build("mlp"), build("mlp")
    pre = KFACPreconditioner(model, grad_scaler=_Scaler(4.0), update_factors_in_hook=False)
    ref = KFACPreconditioner(plain, update_factors_in_hook=False)
    (loss_fn(model, x, y) * 4.0).backward()
    loss_fn(plain, x, y).backward()
    for name in ref.layers:
        assert torch.allclose(pre.layers[name].g_batch, ref.layers[name].g_batch, rtol=1e-12)
        assert torch.equal(pre.layers[name].a_batch, ref.layers[name].a_batch)


# ---------------------------------------------------------------------------- dtypes, backends, reports
def test_factor_and_inverse_dtypes():
    model = build("mlp", dtype=torch.float32)
    pre = KFACPreconditioner(model, factor_dtype=torch.float64, inv_dtype=torch.float64,
                             compute_method="inverse")
    loss_fn(model, *batch("mlp", 4, 0, dtype=torch.float32)).backward()
    pre.step()
    layer = pre.layers["fc1"]
    assert layer.a_factor.dtype == torch.float64 and layer.inv["a_inv"].dtype == torch.float64
    assert model.fc1.weight.grad.dtype == torch.float32
    # half-precision storage of the decompositions (computed in float32, kept in bfloat16)
    model = build("mlp", dtype=torch.float32)
    pre = KFACPreconditioner(model, inv_dtype=torch.bfloat16)
    loss_fn(model, *batch("mlp", 4, 0, dtype=torch.float32)).backward()
    pre.step()
    assert pre.layers["fc1"].inv["qa"].dtype == torch.bfloat16
    assert model.fc1.weight.grad.dtype == torch.float32 and torch.isfinite(model.fc1.weight.grad).all()


@pytest.mark.parametrize("backend", ["numpy"])
def test_linalg_backend_gives_same_result(backend):
    batches = make_batches("mlp", 2)
    a = our_run(build("mlp"), batches, damping=0.01)
    b = our_run(build("mlp"), batches, damping=0.01, linalg=backend)
    assert_runs_close(a, b, rtol=1e-8)


def test_memory_usage_assignment_and_repr():
    model = build("conv")
    pre = KFACPreconditioner(model, communicator=LocalCommunicator())
    mem = pre.memory_usage()
    assert mem["total"] == 0
    loss_fn(model, *batch("conv", 4, 0)).backward()
    pre.step()
    mem = pre.memory_usage()
    n = {name: (layer.sizes["A"], layer.sizes["G"]) for name, layer in pre.layers.items()}
    assert mem["a_factors"] == sum(a * a * 8 for a, _ in n.values())
    assert mem["g_factors"] == sum(g * g * 8 for _, g in n.values())
    # eigen + prediv: qa (float32) on the A side, qg + dgda on the G side
    assert mem["a_inverses"] == sum(a * a * 4 for a, _ in n.values())
    assert mem["g_inverses"] == sum((g * g + g * a) * 4 for a, g in n.values())
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    assert pre.assignment.world_size == 1 and pre.assignment.inv_worker("fc", "A") == 0
    assert pre.distributed_strategy is DistributedStrategy.COMM_OPT
    assert "KFACPreconditioner(" in repr(pre) and "steps=1" in repr(pre)


def test_string_enums_and_strategies():
    pre = KFACPreconditioner(build("mlp"), compute_method="inverse", assignment_strategy="memory",
                             grad_worker_fraction=DistributedStrategy.HYBRID_OPT)
    assert pre.compute_method is ComputeMethod.INVERSE
    assert pre.assignment_strategy is AssignmentStrategy.MEMORY
    pre = KFACPreconditioner(build("mlp"), grad_worker_fraction=0.0)
    assert pre.grad_worker_fraction == 1.0


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(damping=0.0), ValueError, "damping must be a float > 0"),
    (dict(damping="x"), TypeError, "damping"),
    (dict(factor_decay=1.5), ValueError, r"factor_decay must be a float in \(0, 1\]"),
    (dict(kl_clip=-1.0), ValueError, "kl_clip"),
    (dict(lr=-0.1), ValueError, "lr must be a float >= 0"),
    (dict(factor_update_steps=0), ValueError, "factor_update_steps"),
    (dict(inv_update_steps=1.5), TypeError, "inv_update_steps"),
    (dict(accumulation_steps=0), ValueError, "accumulation_steps"),
    (dict(allreduce_bucket_cap_mb=-1), ValueError, "allreduce_bucket_cap_mb"),
    (dict(compute_method="svd"), ValueError, "compute_method='svd'.*EIGEN, INVERSE"),
    (dict(assignment_strategy=3), TypeError, "assignment_strategy"),
    (dict(grad_worker_fraction=1.5), ValueError, r"grad_worker_fraction must be in \[0, 1\]"),
    (dict(grad_worker_fraction="half"), TypeError, "grad_worker_fraction"),
    (dict(colocate_factors=False), ValueError, "compute_eigenvalue_outer_product.*colocate_factors"),
    (dict(factor_dtype=torch.int32), TypeError, "factor_dtype"),
    (dict(inv_dtype=None), TypeError, "inv_dtype"),
    (dict(skip_layers="fc"), TypeError, "skip_layers must be a list"),
    (dict(skip_layers=["("]), ValueError, "not a valid regex"),
    (dict(grad_scaler=3.0), TypeError, "grad_scaler"),
    (dict(symmetry_aware="yes"), TypeError, "symmetry_aware must be a bool"),
    (dict(linalg="lapack"), ValueError, "unknown linalg backend"),
    (dict(communicator="carrier-pigeon"), ValueError, "unknown communicator backend"),
])
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        KFACPreconditioner(build("mlp"), **kwargs)


def test_bad_model_and_callable_values():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        KFACPreconditioner("model")  # type: ignore[arg-type]
    model = build("mlp")
    pre = KFACPreconditioner(model, damping=lambda s: -1.0)
    loss_fn(model, *batch("mlp", 4, 0)).backward()
    with pytest.raises(ValueError, match="damping.*returned by the callable at step 0"):
        pre.step()
    with pytest.warns(UserWarning, match="integer multiple"):
        KFACPreconditioner(build("mlp"), factor_update_steps=3, inv_update_steps=4)
    with pytest.raises(ValueError, match=r"K-FAC is not defined for a Conv2d with groups=2 .*add it to skip_layers"):
        KFACPreconditioner(nn.Conv2d(4, 4, 3, groups=2))


# ---------------------------------------------------------------------------- kfac_pytorch itself
def _kfacpt_run(kfac_mod, model, batches, in_hook, **kw):
    pre = kfac_mod(model, update_factors_in_hook=in_hook, **kw)
    return _train(model, pre, batches)


def _train(model, pre, batches):
    out = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for micro in batches:
        opt.zero_grad()
        for x, y in micro:
            (loss_fn(model, x, y) / len(micro)).backward()
        pre.step()
        out.append(grads(model))
        opt.step()
    return out


class Seq3d(nn.Module):
    """Linear layers on [N, T, d] inputs (G scaled by 1/T) and a Conv2d."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, stride=2)
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x).flatten(2).transpose(1, 2).contiguous()  # [N, T, 3] (kfac_pytorch needs contiguous)
        return self.fc2(torch.relu(self.fc1(h))).mean(1)


@pytest.mark.parametrize("kind", ["mlp", "conv", "seq3d"])
@pytest.mark.parametrize("method,prediv", [("eigen", True), ("eigen", False), ("inverse", True)])
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("in_hook", [True, False])
def test_matches_kfac_pytorch(kind, method, prediv, in_hook, micro, record_property):
    """Our preconditioned gradients equal kfac_pytorch's on the same model, data and arguments."""
    kfac = pytest.importorskip("kfac.preconditioner", reason="kfac_pytorch is not installed: "
                               "pip install kfac-pytorch==0.4.2 (README, 'How we know the math is right')")
    torch.manual_seed(0)
    model = Seq3d() if kind == "seq3d" else build(kind, dtype=torch.float32)
    if kind == "mlp":
        model.act.inplace = False  # kfac_pytorch's full backward hooks reject an in-place op after a layer
    data_kind = "conv" if kind == "seq3d" else kind
    batches = [[batch(data_kind, 6, 10 * s + k, dtype=torch.float32) for k in range(micro)] for s in range(4)]
    kw = dict(damping=0.003, lr=0.2, kl_clip=0.01, factor_decay=0.9, compute_method=method,
              compute_eigenvalue_outer_product=prediv, accumulation_steps=micro, inv_update_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _kfacpt_run(kfac.KFACPreconditioner, copy.deepcopy(model), batches, in_hook, **kw)
    ours = _kfacpt_run(KFACPreconditioner, copy.deepcopy(model), batches, in_hook, **kw)
    worst = 0.0
    for a, b in zip(ours, theirs):
        for n in a:
            worst = max(worst, float((a[n] - b[n]).abs().max() / b[n].abs().max()))
    record_property("max_rel_diff", worst)
    print(f"kfac_pytorch vs torchsso2 [{kind} {method} prediv={prediv} in_hook={in_hook} micro={micro}]: "
          f"max relative difference {worst:.2e}")
    assert worst <= 5e-6  # README: matches kfac_pytorch 0.4.2 to ≤ 5e-6


def test_module_called_twice_per_forward_contributes_both_calls():
    """A shared layer: one (A, G) pair per call, averaged (kfac_pytorch counts each call)."""
    lin = nn.Linear(3, 3).to(DT)
    pre = KFACPreconditioner(lin, update_factors_in_hook=False)
    x = torch.randn(4, 3, dtype=DT)
    h = lin(x)
    h.retain_grad()
    out = lin(torch.tanh(h))
    out.retain_grad()
    out.pow(2).mean().backward()
    layer = pre.layers[""]
    assert layer.batch_count == 2
    rows = [torch.cat([v, torch.ones(4, 1, dtype=DT)], 1) for v in (x, torch.tanh(h).detach())]
    assert torch.allclose(layer.a_batch, sum(r.t() @ r / 4 for r in rows))
    assert torch.allclose(layer.g_batch, (h.grad.t() @ h.grad + out.grad.t() @ out.grad) / 4)
    pre.step()
    assert torch.isfinite(lin.weight.grad).all()


def test_torch_amp_grad_scaler_object():
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    model = build("mlp", dtype=torch.float32)
    pre = KFACPreconditioner(model, grad_scaler=scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch("mlp", 4, 0, dtype=torch.float32)
    scaler.scale(loss_fn(model, x, y)).backward()
    scaler.unscale_(opt)
    pre.step()
    scaler.step(opt)
    scaler.update()
    assert pre.steps == 1 and torch.isfinite(model.fc1.weight).all()


def test_a_grad_scaler_whose_gradients_were_not_unscaled_is_named():
    """kfac_pytorch (and ours) precondition whatever p.grad holds: without scaler.unscale_(optimizer) before
    step() the gradients are still scaled and training stalls, silently."""
    def run(unscale):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        pre = KFACPreconditioner(model, grad_scaler=scaler)
        x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                sgd.zero_grad()
                scaler.scale(F.cross_entropy(model(x), y)).backward()
                if unscale:
                    scaler.unscale_(sgd)
                pre.step()
                scaler.step(sgd)
                scaler.update()
        return [str(w.message) for w in caught if "KFACPreconditioner(grad_scaler" in str(w.message)]
    missed = run(False)
    assert len(missed) == 1 and "call scaler.unscale_(optimizer) before preconditioner.step()" in missed[0]
    assert run(True) == []


def test_step_runs_without_recording_autograd():
    """A helper placed between @torch.no_grad() and step() took the decorator: after a create_graph backward
    the preconditioning was recorded by autograd (and the KL clip warned about a scalar requiring grad)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    pre = KFACPreconditioner(model, kl_clip=0.001)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()), create_graph=True)
    for p, g in zip(model.parameters(), grads):
        p.grad = g  # gradients in a graph (a double-backward user's)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre.step()
