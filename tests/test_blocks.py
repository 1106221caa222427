"""Blocks (full / diag / kfac) from real models: solve, sample, mvp, EMA, checkpoints, dtypes.

Every expectation is computed from the block's ``dense()`` matrix (itself checked against the
brute-force reference in ``test_curvature_reference.py``) with plain ``torch.linalg`` in float64.
"""
from __future__ import annotations

import io
import math
from typing import List

import pytest
import torch
from torch import nn

import curvature
from curvature.blocks.base import DerivedCache
from models import MODELS
from reference import Reference

DAMPING = 0.1
SCALE = 3.0

# (model, module, kind, approx): Linear ± bias, Conv2d without bias, Embedding (diagonal factor), norm layers
BLOCK_CASES = [
    ("mlp", "fc2", "fisher", "full"),
    ("mlp", "fc2", "empirical_fisher", "diag"),
    ("mlp", "fc2", "fisher", "kfac"),
    ("cnn", "conv2", "fisher", "kfac"),      # Conv2d, no bias
    ("embedding", "emb", "fisher", "kfac"),  # A is a diagonal [V] factor (with a zero at padding_idx)
    ("norm_cnn", "ln", "fisher", "full"),
    ("norm_mlp", "bn", "fisher", "diag"),
]
IDS = ["-".join(c) for c in BLOCK_CASES]


def make_block(model_name: str, module: str, kind: str, approx: str, seed: int = 0, n: int = 4,
               dtype: torch.dtype = torch.float64):
    build, batch = MODELS[model_name]
    model = build().to(dtype)
    loss = "cross_entropy"
    x, y = batch(n, loss, seed=seed)
    if x.is_floating_point():
        x = x.to(dtype)
    c = curvature.compute(model, x, y, loss=loss, kind=kind, approx=approx)
    return c.blocks[module], model


def rand_like_params(block, gen: torch.Generator) -> List[torch.Tensor]:
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in block.layout.shapes]


def flat(ts: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts]).double()


def damped(block, scale: float = SCALE, damping: float = DAMPING) -> torch.Tensor:
    d = block.dense().double()
    return scale * d + damping * torch.eye(d.shape[0], dtype=torch.float64)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=IDS)
def test_solve_matches_dense_solve(case) -> None:
    block, _ = make_block(*case)
    block.decompose(DAMPING, scale=SCALE)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        v = rand_like_params(block, gen)
        out = block.solve(v)
        assert [o.shape for o in out] == [t.shape for t in v]
        expected = torch.linalg.solve(damped(block), flat(v))
        torch.testing.assert_close(flat(out), expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("case", BLOCK_CASES + [("cnn", "conv1", "hessian", "full"), ("mlp", "fc1", "hessian", "diag")],
                         ids=IDS + ["cnn-conv1-hessian-full", "mlp-fc1-hessian-diag"])
def test_mvp_matches_dense(case) -> None:
    block, _ = make_block(*case)
    gen = torch.Generator().manual_seed(1)
    v = rand_like_params(block, gen)
    torch.testing.assert_close(flat(block.mvp(v)), block.dense().double() @ flat(v), rtol=1e-10, atol=1e-12)


def test_solve_before_decompose_raises() -> None:
    block, _ = make_block("mlp", "fc2", "fisher", "full")
    with pytest.raises(RuntimeError, match="decompose"):
        block.solve([torch.zeros(s, dtype=torch.float64) for s in block.layout.shapes])


def test_hessian_block_is_indefinite_and_decompose_refuses() -> None:
    """A damped indefinite block is rejected (LinalgError), not silently inverted."""
    from curvature.linalg import LinalgError

    block, _ = make_block("mlp", "fc2", "hessian", "full")
    ev = torch.linalg.eigvalsh(block.dense())
    assert ev.min() < -1e-3  # tanh after fc2: this Hessian block is indefinite
    with pytest.raises(LinalgError):
        block.decompose(damping=1e-8, scale=1.0)


DRAWS = 6000


def _whitened_deviation(draws: torch.Tensor, precision: torch.Tensor) -> float:
    """Largest standardized entry of ``P^{1/2} Σ̂ P^{1/2} − I`` for draws claimed to be N(0, P⁻¹).

    Whitened draws are N(0, I) exactly when the sampler is right, so every direction counts
    equally (a plain ‖Σ̂ − Σ‖ would be dominated by the 1/damping directions). For n Gaussian
    draws the entry (i, j) of the whitened covariance has standard deviation √((1 + δ_ij)/n).
    """
    ev, q = torch.linalg.eigh(precision)
    root = q @ torch.diag(ev.sqrt()) @ q.t()
    w = root @ (draws.t() @ draws / draws.shape[0]) @ root
    eye = torch.eye(w.shape[0], dtype=w.dtype)
    std = ((1 + eye) / draws.shape[0]).sqrt()
    return float(((w - eye) / std).abs().max())


@pytest.mark.parametrize("case", BLOCK_CASES, ids=IDS)
def test_sample_covariance_and_reproducibility(case) -> None:
    block, _ = make_block(*case)
    # damping relative to the spectrum, so that scale·C dominates in its top directions
    damping = 0.05 * SCALE * float(torch.linalg.eigvalsh(block.dense().double()).max())
    block.decompose(damping, scale=SCALE)
    gen = torch.Generator().manual_seed(123)
    draws = torch.stack([flat(block.sample(gen)) for _ in range(DRAWS)])
    precision = damped(block, SCALE, damping)
    # Tolerance: 6 standard deviations per entry. With ~P²/2 ≤ 600 entries, a correct sampler
    # exceeds 6σ with probability < 1e-6 (and the generator is seeded, so the run is fixed).
    dev = _whitened_deviation(draws, precision)
    assert dev < 6.0, dev
    # resolving power: a precision 25% off in scale, or the damping alone, would be rejected
    assert _whitened_deviation(draws, damped(block, 1.25 * SCALE, damping)) > 6.0
    assert _whitened_deviation(draws, damping * torch.eye(precision.shape[0], dtype=torch.float64)) > 6.0
    # reproducible with a seeded generator; different seeds differ
    a = block.sample(torch.Generator().manual_seed(5))
    b = block.sample(torch.Generator().manual_seed(5))
    c = block.sample(torch.Generator().manual_seed(6))
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not torch.equal(flat(a), flat(c))
    assert [t.shape for t in a] == list(block.layout.shapes)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=IDS)
def test_sample_is_colour_of_one_standard_normal(case) -> None:
    """``sample(generator)`` = ``colour(z)`` for ``z = randn(P)`` drawn from that generator in the
    decomposition's dtype (the contract VIOptimizer relies on to slice one draw over all blocks);
    colour is linear in z (a fixed matrix square root), so colour(2z) = 2·colour(z)."""
    block, _ = make_block(*case)
    block.decompose(DAMPING, scale=SCALE)
    ref = next(v for v in block.decomposition.values() if isinstance(v, torch.Tensor))
    z = torch.randn(block.layout.numel, generator=torch.Generator().manual_seed(9), dtype=ref.dtype)
    drawn = block.sample(torch.Generator().manual_seed(9))
    coloured = block.colour(z.clone())
    assert all(torch.equal(a, b) for a, b in zip(drawn, coloured))
    assert torch.allclose(flat(block.colour(2 * z)), 2 * flat(coloured), rtol=1e-12, atol=0)


def test_sample_with_inverse_method_raises() -> None:
    block, _ = make_block("mlp", "fc2", "fisher", "kfac")
    block.decompose(DAMPING, method="inverse")
    with pytest.raises(NotImplementedError):
        block.sample(torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", [("mlp", "fc2"), ("cnn", "conv2"), ("embedding", "emb")], ids=lambda c: "-".join(c))
def test_kfac_inverse_method(case) -> None:
    """decompose(method="inverse") solves with (L + λI)⁻¹ V (R + λI)⁻¹ (factored Tikhonov)."""
    block, _ = make_block(case[0], case[1], "fisher", "kfac")
    lam = 0.05
    block.decompose(lam, method="inverse")
    gen = torch.Generator().manual_seed(2)
    v = rand_like_params(block, gen)
    left = torch.diag(block.left) if block.left.dim() == 1 else block.left
    right = torch.diag(block.right) if block.right.dim() == 1 else block.right
    eye = lambda k: torch.eye(k, dtype=torch.float64)  # noqa: E731
    # V as the parameter matrix (rows: L side); built by hand from the documented layouts
    mod = block.layout.module
    if isinstance(mod, nn.Embedding):
        vm = v[0]
    else:
        vm = v[0].reshape(v[0].shape[0], -1)
        if len(v) == 2:
            vm = torch.cat([vm, v[1].unsqueeze(1)], 1)
    expected = torch.linalg.inv(left + lam * eye(left.shape[0])) @ vm @ torch.linalg.inv(right + lam * eye(right.shape[0]))
    out = block.solve(v)
    if isinstance(mod, nn.Embedding):
        got = out[0]
    else:
        got = out[0].reshape(out[0].shape[0], -1)
        if len(out) == 2:
            got = torch.cat([got, out[1].unsqueeze(1)], 1)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)
    # and it is not the exactly damped inverse (a different, documented approximation)
    exact = torch.linalg.solve(damped(block, 1.0, lam), flat(v))
    assert (flat(out) - exact).abs().max() > 1e-6
    # with a scale, the scale multiplies the Kronecker product once: (s·L + λI)⁻¹ V (R + λI)⁻¹
    block.decompose(lam, scale=SCALE, method="inverse")
    expected = torch.linalg.inv(SCALE * left + lam * eye(left.shape[0])) @ vm @ torch.linalg.inv(right + lam * eye(right.shape[0]))
    out = block.solve(v)
    if isinstance(mod, nn.Embedding):
        got = out[0]
    else:
        got = out[0].reshape(out[0].shape[0], -1)
        if len(out) == 2:
            got = torch.cat([got, out[1].unsqueeze(1)], 1)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)


# ---- running estimates (EMA) and checkpoints --------------------------------------------------------
@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
def test_ema_update(approx: str) -> None:
    b1, _ = make_block("mlp", "fc2", "fisher", approx, seed=1)
    b2, _ = make_block("mlp", "fc2", "fisher", approx, seed=2)
    b3, _ = make_block("mlp", "fc2", "fisher", approx, seed=3)
    t1, t2, t3 = ([t.clone() for t in b.tensors()] for b in (b1, b2, b3))
    assert not torch.allclose(t1[0], t2[0])
    decay = 0.7
    running = curvature.RunningCurvature()
    running.update({"fc2": b1}, decay)  # the first update copies
    for got, want in zip(running.blocks["fc2"].tensors(), t1):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    running.update({"fc2": b2}, decay)
    running.update({"fc2": b3}, decay)
    for got, a, b, c in zip(running.blocks["fc2"].tensors(), t1, t2, t3):
        # for kfac the EMA runs on each factor (A and G separately)
        want = decay * (decay * a + (1 - decay) * b) + (1 - decay) * c
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert running.num_updates == 3
    # the running estimate owns its statistics: the caller's first block is left untouched
    for got, want in zip(b1.tensors(), t1):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # ... and its derived-tensor caches (a shared cache object would tie the two blocks together)
    own = running.blocks["fc2"]
    caches = [k for k, v in vars(b1).items() if isinstance(v, DerivedCache)]
    assert caches or approx == "full"
    for k in caches:
        assert getattr(own, k) is not getattr(b1, k)
    with pytest.raises(ValueError, match="decay"):
        running.update({"fc2": b2}, 1.0)


def test_ema_over_whole_model_dense() -> None:
    """EMA of a full-shape curvature is the EMA of the dense matrices."""
    build, batch = MODELS["norm_mlp"]
    model = build()
    xs = [batch(4, "mse", seed=s) for s in (1, 2)]
    cs = [curvature.compute(model, x, y, loss="mse", kind="fisher", approx="full") for x, y in xs]
    d0, d1 = cs[0].dense().clone(), cs[1].dense().clone()
    running = curvature.RunningCurvature()
    running.update(cs[0].blocks, 0.9)
    running.update(cs[1].blocks, 0.9)
    got = torch.block_diag(*[b.dense() for b in running.blocks.values()])
    torch.testing.assert_close(got, 0.9 * d0 + 0.1 * d1, rtol=1e-12, atol=1e-14)


def test_ema_refuses_a_fresh_statistic_of_another_shape() -> None:
    """A fresh [V] diagonal factor folded into a running [V, V] one: a ValueError naming both shapes (the
    lerp broadcast it over the rows, silently)."""
    model = nn.Embedding(5, 3)
    fresh = curvature.compute(model, torch.randint(0, 5, (4, 2)), None, kind="fisher_mc", approx="kfac", loss="mse")
    block = fresh.blocks[""]
    running = curvature.RunningCurvature()
    running.update({"": type(block)(block.layout, torch.diag(block.A), block.G)}, 0.9)
    with pytest.raises(ValueError, match=r"fresh statistic of shape \(5,\) cannot be folded into the running one of "
                                         r"shape \(5, 5\)"):
        running.update(fresh.blocks, 0.9)


@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
def test_state_dict_round_trip(approx: str) -> None:
    build, batch = MODELS["cnn"]
    model = build()
    x, y = batch(4, "cross_entropy", seed=1)
    running = curvature.RunningCurvature()
    running.update(curvature.compute(model, x, y, kind="fisher", approx=approx).blocks, 0.9)
    x2, y2 = batch(4, "cross_entropy", seed=2)
    running.update(curvature.compute(model, x2, y2, kind="fisher", approx=approx).blocks, 0.9)
    running.decompose(DAMPING, scale=SCALE)
    buf = io.BytesIO()
    torch.save(running.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    x3, y3 = batch(4, "cross_entropy", seed=3)
    fresh = curvature.compute(model, x3, y3, kind="fisher", approx=approx).blocks
    before = {n: b.dense().clone() for n, b in fresh.items()}
    restored = curvature.RunningCurvature()
    restored.load_state_dict(state, fresh)
    assert restored.num_updates == 2
    gen = torch.Generator().manual_seed(0)
    for name, blk in running.blocks.items():
        assert not torch.allclose(before[name], blk.dense())  # loading really overwrites
        torch.testing.assert_close(restored.blocks[name].dense(), blk.dense(), rtol=0, atol=0)
        v = rand_like_params(blk, gen)
        torch.testing.assert_close(flat(restored.blocks[name].solve(v)), flat(blk.solve(v)), rtol=0, atol=0)
    # a checkpoint of another shape or another set of modules is refused
    other = curvature.compute(model, x3, y3, kind="fisher", approx="diag" if approx != "diag" else "full").blocks
    with pytest.raises(ValueError):
        curvature.RunningCurvature().load_state_dict(state, other)
    with pytest.raises(ValueError, match="covers modules"):
        curvature.RunningCurvature().load_state_dict(state, {k: v for k, v in fresh.items() if k != "fc"})


# ---- dtypes --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("approx", ["full", "diag", "kfac"])
def test_float32_model_gives_float32_statistics(approx: str) -> None:
    build, batch = MODELS["cnn"]
    model64 = build()
    x, y = batch(4, "cross_entropy", seed=4)
    ref = Reference(model64, x, y, "cross_entropy").shaped("fisher", approx)
    model = build().float()
    c = curvature.compute(model, x.float(), y, kind="fisher", approx=approx)
    for blk in c.blocks.values():
        assert all(t.dtype == torch.float32 for t in blk.tensors())
    assert c.dense().dtype == torch.float32
    torch.testing.assert_close(c.dense().double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    blk = c.blocks["fc"]
    blk.decompose(DAMPING)
    assert all(t.dtype == torch.float32 for t in blk.sample(torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,approx", [("fisher", "kfac"), ("empirical_fisher", "full"), ("hessian", "diag")])
def test_low_precision_model_statistics_in_float32(dtype: torch.dtype, kind: str, approx: str) -> None:
    build, batch = MODELS["mlp"]
    model = build().to(dtype)
    x, y = batch(8, "cross_entropy", seed=4)
    c = curvature.compute(model, x.to(dtype), y, kind=kind, approx=approx)
    for blk in c.blocks.values():
        assert all(t.dtype == torch.float32 for t in blk.tensors()), [t.dtype for t in blk.tensors()]
    # same rounded weights and inputs in float64: agreement to the low precision's resolution
    model64 = model.double()
    ref = Reference(model64, x.to(dtype).double(), y, "cross_entropy").shaped(kind, approx)
    err = (c.dense().double() - ref).abs().max() / ref.abs().max()
    assert err < 5e-2, float(err)
    blk = c.blocks["fc1"]
    blk.decompose(DAMPING)
    v = [torch.randn(s, dtype=dtype) for s in blk.layout.shapes]
    out = blk.solve(v)
    assert all(o.dtype == dtype for o in out)


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_all_finite_fast_path_and_exact_fallback(path: str) -> None:
    """The fused check (one sum per tensor) must agree with the element-wise definition; the
    accelerator path (sums stacked on one device, one host sync) runs here on CPU tensors."""
    from curvature.blocks.base import all_finite
    from curvature.linalg.checks import _all_finite_on_device

    if path == "accelerator":
        all_finite = _all_finite_on_device  # noqa: F811 (the same contract, the other path)

    ok = [torch.ones(3, 4), torch.zeros(5)]
    assert all_finite(ok) and all_finite([]) and all_finite([torch.empty(0)])
    big = torch.full((4,), 3e38)  # finite elements whose float32 sum overflows: still finite
    assert float(big.sum()) == math.inf and all_finite([big])
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.ones(6)
        t[3] = bad
        assert not all_finite(ok + [t])
    cancel = torch.tensor([math.inf, -math.inf])  # sums to NaN
    assert not all_finite([cancel])
    # one-element tensors (a loss) are read without a sum: scalar and [1], alone and beside others
    assert all_finite([torch.tensor(2.5)]) and all_finite(ok + [torch.tensor([2.5], requires_grad=True)])
    for bad in (math.nan, math.inf, -math.inf):
        assert not all_finite([torch.tensor(bad)]) and not all_finite(ok + [torch.tensor([bad])])


@pytest.mark.parametrize("requires_grad", [False, True])
def test_owned_all_finite_detects_and_leaves_values_bit_identical(requires_grad: bool) -> None:
    """The fused AMP check agrees with the element-wise definition on mixed dtypes and strided
    views, and leaves every value bit for bit as it was (it multiplies by 1 in place); a tensor
    that requires grad sends the whole list to :func:`all_finite` (no in-place op on it)."""
    from curvature.linalg.checks import owned_all_finite

    gen = torch.Generator().manual_seed(0)
    ok = [torch.randn(5, 4, generator=gen), torch.randn(7, generator=gen, dtype=torch.float64),
          torch.randn(6, 6, generator=gen)[:, ::2], torch.tensor(2.5), torch.randn(3, generator=gen).half()]
    if requires_grad:
        ok.append(torch.randn(3, generator=gen, requires_grad=True))
    before = [t.detach().clone() for t in ok]
    assert owned_all_finite(ok) and owned_all_finite([]) and owned_all_finite([torch.empty(0)])
    assert all(torch.equal(a.detach(), b) for a, b in zip(ok, before))
    assert owned_all_finite([torch.full((4,), 3e38)])  # finite, though its float32 sum overflows
    for i in range(len(ok)):
        for bad in (math.nan, math.inf, -math.inf):
            ts = [t.detach().clone() for t in ok]
            ts[i].view(-1)[-1] = bad
            if requires_grad:
                ts[-1].requires_grad_(True)
            assert not owned_all_finite(ts), (i, bad)


def test_diag_reciprocals_follow_the_decomposition() -> None:
    """solve/sample cache 1/denom; a new decomposition or an in-place change of denom must refresh it."""
    blk, _ = make_block("mlp", "fc2", "empirical_fisher", "diag")
    v = [torch.ones(s, dtype=torch.float64) for s in blk.layout.shapes]
    blk.decompose(DAMPING)
    first = blk.layout.flatten(blk.solve(v))
    blk.decompose(10 * DAMPING)
    second = blk.layout.flatten(blk.solve(v))
    torch.testing.assert_close(second, 1.0 / (blk.diagonal + 10 * DAMPING))
    assert not torch.allclose(first, second)
    blk.decomposition["denom"].mul_(2.0)
    torch.testing.assert_close(blk.layout.flatten(blk.solve(v)), 0.5 / (blk.diagonal + 10 * DAMPING))


@pytest.mark.parametrize("case", ["both sides", "rows only", "diagonal left factor"])
def test_kfac_eigen_solve_padding_is_exact(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Factor sizes >= PAD_MIN are zero-padded to a multiple of PAD_MULTIPLE inside the eigen solve
    (faster BLAS); the result must equal the unpadded solve, and follow a changed decomposition.
    Cases: both factors padded; only the output side (Linear 10 -> 260); an Embedding, whose
    left factor is diagonal (no eigenbasis) and whose right one is padded."""
    from curvature.blocks import kfac as kfac_module

    torch.manual_seed(0)
    if case == "diagonal left factor":
        model = nn.Sequential(nn.Embedding(20, 260), nn.Flatten(), nn.Linear(2 * 260, 3)).double()
        x, y = torch.randint(0, 20, (8, 2)), torch.randint(0, 3, (8,))
        want_shape = (20, 264)
    else:
        d_in = 299 if case == "both sides" else 10
        model = nn.Sequential(nn.Linear(d_in, 260), nn.Tanh(), nn.Linear(260, 3)).double()
        x, y = torch.randn(8, d_in, dtype=torch.float64), torch.randint(0, 3, (8,))
        want_shape = (264, 304) if case == "both sides" else (264, 11)
    blk = curvature.compute(model, x, y, kind="fisher", approx="kfac").blocks["0"]
    blk.decompose(DAMPING)
    v = [torch.randn(s, dtype=torch.float64) for s in blk.layout.shapes]
    padded = blk.solve(v)
    again = blk.solve([2.0 * t for t in v])  # a second solve must not write into the first's result
    pad = blk._solve_plan(blk.decomposition)
    assert pad["denom"].shape == want_shape and pad["buffer"] is not None
    monkeypatch.setattr(kfac_module, "PAD_MIN", 10 ** 9)
    blk.decompose(DAMPING)  # a new decomposition: a new plan, now unpadded
    plan = blk._solve_plan(blk.decomposition)
    assert plan["buffer"] is None and plan["denom"] is blk.decomposition["denom"]
    plain = blk.solve(v)
    for a, b, c in zip(padded, plain, again):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(c, 2.0 * b, rtol=1e-12, atol=1e-14)
    monkeypatch.setattr(kfac_module, "PAD_MIN", 256)
    blk.decomposition["denom"].mul_(2.0)
    for a, b in zip(blk.solve(v), plain):
        torch.testing.assert_close(a, 0.5 * b, rtol=1e-12, atol=1e-14)


def _split_solve_case(case: str):
    """A K-FAC block whose parameter matrix is split into per-parameter column ranges."""
    torch.manual_seed(0)
    if case.startswith("conv"):
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 16, 4))
        x = torch.randn(5, 2, 4, 4)
    else:
        model = nn.Sequential(nn.Linear(6, 5, bias=case != "linear no bias"), nn.Tanh(), nn.Linear(5, 4))
        x = torch.randn(5, 6)
        if case == "bias only":
            model[0].weight.requires_grad_(False)
    model = model.double()
    c = curvature.compute(model, x.double(), torch.randint(0, 4, (5,)), kind="fisher", approx="kfac")
    return c.blocks["0"]


@pytest.mark.parametrize("case", ["linear", "linear no bias", "bias only", "conv with bias"])
def test_kfac_solve_by_parameter_columns(case: str) -> None:
    """The eigen solve writes each parameter from its own last matmul, ``(Q_L X) Q_R[cols]ᵀ``,
    instead of slicing one ``[rows, cols]`` result: it must equal the dense solve and the
    sliced path, give contiguous parameter-shaped tensors, and cast back to the input dtype.
    Three paths: the direct one (unpadded dense factors: one ``cat``, row-major bases, ``mv``
    for a one-column bias), the per-parameter columns of the general one, and the sliced one."""
    blk = _split_solve_case(case)
    blk.decompose(DAMPING, scale=SCALE)
    plan = blk._solve_plan(blk.decomposition)
    assert plan["qr_parts"] is not None and len(plan["qr_parts"]) == len(blk.layout.shapes)
    assert plan["direct"] is not None
    v = rand_like_params(blk, torch.Generator().manual_seed(0))
    out = blk.solve(v)
    assert [o.shape for o in out] == [t.shape for t in v] and all(o.is_contiguous() for o in out)
    torch.testing.assert_close(flat(out), torch.linalg.solve(damped(blk), flat(v)), rtol=1e-9, atol=1e-10)
    direct, plan["direct"] = plan["direct"], None  # the general path, one product per parameter
    by_columns = blk.solve(v)
    parts, plan["qr_parts"] = plan["qr_parts"], None  # the sliced path (families without a column split take it)
    sliced = blk.solve(v)
    for a, b, c in zip(out, by_columns, sliced):
        assert b.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-13)
    plan["qr_parts"], plan["direct"] = parts, direct
    half = blk.solve([t.to(torch.bfloat16) for t in v])  # the solve runs in the block's dtype
    assert all(h.dtype == torch.bfloat16 for h in half)
    want = blk.solve([t.to(torch.bfloat16).double() for t in v])
    for h, w in zip(half, want):
        torch.testing.assert_close(h, w.to(torch.bfloat16))


def test_layout_params_follow_a_swapped_parameter() -> None:
    """``Layout.params`` is looked up on every use (from the module's parameter dict), so a
    Parameter replaced after the optimizer was built is the one preconditioned and updated."""
    blk = _split_solve_case("linear")
    module = blk.layout.module
    assert blk.layout.params[0] is module.weight and blk.layout.params[1] is module.bias
    module.weight = nn.Parameter(module.weight.detach().clone())
    assert blk.layout.params[0] is module.weight
