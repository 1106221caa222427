"""Tests of curvature.linalg: every backend against float64 references and each other."""
from __future__ import annotations

import importlib.util
import math
import sys
import types

import numpy
import pytest
import torch

from curvature.linalg import BACKEND_NAMES, Backend, LinalgError, get_backend

ENV = "TORCHSSO2_LINALG"


def _cupy_skip_reason() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device available for cupy"
    return None


CUPY_SKIP = _cupy_skip_reason()
ALL = [
    pytest.param(n, marks=pytest.mark.skipif(n == "cupy" and CUPY_SKIP is not None,
                                             reason=str(CUPY_SKIP)))
    for n in BACKEND_NAMES
]


@pytest.fixture(params=ALL)
def backend(request) -> Backend:
    return get_backend(request.param)


def device_of(b: Backend) -> torch.device:
    return torch.device("cuda" if b.name == "cupy" else "cpu")


# ---------------------------------------------------------------- test matrices
def spd(n: int, cond: float = 10.0, batch: tuple[int, ...] = (), seed: int = 0) -> torch.Tensor:
    """SPD float64 matrices [*batch, n, n] with eigenvalues log-spaced in [1/cond, 1]."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(*batch, n, n, generator=gen, dtype=torch.float64))
    evals = torch.logspace(0, -math.log10(cond), n, dtype=torch.float64)
    return (q * evals) @ q.mT


def rank_deficient(n: int, rank: int, batch: tuple[int, ...] = (), seed: int = 0) -> torch.Tensor:
    """PSD float64 matrices X Xᵀ / rank of rank ``rank`` (like a factor from few samples)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, n, rank, generator=gen, dtype=torch.float64)
    return x @ x.mT / rank


def eye_like(a: torch.Tensor) -> torch.Tensor:
    return torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    return float(torch.linalg.matrix_norm(x - ref).max() / torch.linalg.matrix_norm(ref).max())


EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps


# ------------------------------------------------------------- decompositions
@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
def test_eigh_reconstructs_and_sorts(backend, batch):
    a64 = spd(12, cond=100.0, batch=batch)
    a = a64.float().to(device_of(backend))
    evals, evecs = backend.eigh(a)
    assert evals.shape == (*batch, 12) and evecs.shape == (*batch, 12, 12)
    assert evals.dtype == evecs.dtype == torch.float32
    assert evals.device == a.device
    assert bool((evals[..., 1:] >= evals[..., :-1]).all()), "eigenvalues must be ascending"
    recon = (evecs * evals.unsqueeze(-2)) @ evecs.mT
    assert rel_err(recon, a64) < 100 * EPS32
    assert rel_err(evecs.mT @ evecs, eye_like(a64)) < 100 * EPS32
    ref = torch.linalg.eigvalsh(a64)
    assert torch.allclose(evals.double().cpu(), ref, atol=100 * EPS32, rtol=0)


def test_eigh_symmetrizes_input(backend):
    a64 = spd(8)
    skew = torch.randn(8, 8, dtype=torch.float64)
    skew = skew - skew.mT
    evals, evecs = backend.eigh((a64 + skew).to(device_of(backend)), dtype=torch.float64)
    recon = (evecs * evals.unsqueeze(-2)) @ evecs.mT
    assert rel_err(recon, a64) < 1e3 * EPS64


def test_eigh_ill_conditioned_float64(backend):
    """cond 1e8: in float64 even the smallest eigenvalue is accurate."""
    a64 = spd(32, cond=1e8, batch=(2,), seed=1)
    true = torch.logspace(0, -8, 32, dtype=torch.float64).flip(0)
    evals, evecs = backend.eigh(a64.to(device_of(backend)), dtype=torch.float64)
    assert evals.dtype == torch.float64
    evals = evals.cpu()
    assert torch.allclose(evals, true.expand_as(evals), rtol=1e-6, atol=0)
    recon = (evecs * evals.to(evecs.device).unsqueeze(-2)) @ evecs.mT
    assert rel_err(recon, a64) < 1e3 * EPS64


def test_explicit_dtype_upcasts_float32_input(backend):
    a = spd(6).float().to(device_of(backend))
    evals, evecs = backend.eigh(a, dtype=torch.float64)
    assert evals.dtype == evecs.dtype == torch.float64
    assert backend.inv(a, dtype=torch.float64).dtype == torch.float64
    assert backend.cholesky(a.double()).dtype == torch.float64  # float64 input stays
    assert backend.cholesky(a.double(), dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_computed_in_float32(backend, low):
    a = spd(10, cond=10.0).to(low).to(device_of(backend))
    a32 = a.float()  # the same rounded values, exactly representable in float32
    evals, evecs = backend.eigh(a)
    assert evals.dtype == evecs.dtype == torch.float32
    ref = torch.linalg.eigvalsh(((a32 + a32.mT) / 2).double().cpu())
    assert torch.allclose(evals.double().cpu(), ref, atol=50 * EPS32, rtol=0)
    for out in (backend.cholesky(a), backend.inv(a), backend.damped_inv(a, 0.1),
                backend.solve(a, torch.ones(10, 2, dtype=low, device=a.device))):
        assert out.dtype == torch.float32
    inv_ref = torch.linalg.inv(((a32 + a32.mT) / 2).double().cpu())
    assert rel_err(backend.inv(a), inv_ref) < 1e3 * EPS32


@pytest.mark.parametrize("batch", [(), (4,)])
def test_cholesky_lower_and_reconstructs(backend, batch):
    a64 = spd(16, cond=1e3, batch=batch, seed=2)
    factor = backend.cholesky(a64.float().to(device_of(backend)))
    assert factor.shape == a64.shape and factor.dtype == torch.float32
    assert bool((torch.triu(factor, diagonal=1) == 0).all()), "L must be lower triangular"
    assert bool((torch.diagonal(factor, dim1=-2, dim2=-1) > 0).all())
    assert rel_err(factor @ factor.mT, a64) < 100 * EPS32
    ref = torch.linalg.cholesky(a64)
    assert rel_err(factor, ref) < 1e3 * EPS32


@pytest.mark.parametrize("batch", [(), (3,)])
def test_inv_times_a_is_identity(backend, batch):
    a64 = spd(16, cond=1e3, batch=batch, seed=3)
    inv = backend.inv(a64.to(device_of(backend)))
    assert inv.dtype == torch.float64
    assert torch.allclose(inv.cpu() @ a64, eye_like(a64), atol=1e-10)
    assert torch.equal(inv, inv.mT) or rel_err(inv, inv.mT) < 10 * EPS64
    inv32 = backend.inv(a64.float().to(device_of(backend)))
    assert rel_err(inv32, torch.linalg.inv(a64)) < 1e3 * 1e3 * EPS32  # cond · eps


def test_inv_ill_conditioned_float64(backend):
    a64 = spd(24, cond=1e8, seed=4)
    inv = backend.inv(a64.float().to(device_of(backend)), dtype=torch.float64)
    # a64.float() rounds a; compare against the inverse of the rounded matrix
    a_r = a64.float().double()
    assert rel_err(inv, torch.linalg.inv(a_r)) < 1e8 * 1e3 * EPS64


def test_solve_matrix_vector_and_broadcast(backend):
    dev = device_of(backend)
    a64 = spd(10, cond=100.0, batch=(3,), seed=5)
    rhs = torch.randn(3, 10, 4, dtype=torch.float64)
    x = backend.solve(a64.to(dev), rhs.to(dev))
    assert x.shape == (3, 10, 4) and x.dtype == torch.float64
    assert torch.allclose(x.cpu(), torch.linalg.solve(a64, rhs), atol=1e-10)
    vec = torch.randn(3, 10, dtype=torch.float64)  # batch of vectors
    xv = backend.solve(a64.to(dev), vec.to(dev))
    assert xv.shape == (3, 10)
    assert torch.allclose(xv.cpu(), torch.linalg.solve(a64, vec), atol=1e-10)
    shared = torch.randn(10, 2, dtype=torch.float64)  # one rhs broadcast over the batch
    xs = backend.solve(a64.to(dev), shared.to(dev))
    assert xs.shape == (3, 10, 2)
    assert torch.allclose(xs.cpu(), torch.linalg.solve(a64, shared), atol=1e-10)
    single = backend.solve(a64[0].to(dev), vec[0].to(dev))  # 1-D rhs
    assert single.shape == (10,)
    assert torch.allclose(single.cpu(), torch.linalg.solve(a64[0], vec[0]), atol=1e-10)


@pytest.mark.parametrize("damping", [1e-3, 1.0])
def test_damped_inv_rank_deficient(backend, damping):
    """A factor estimated from 3 samples is singular; damping makes it invertible."""
    a64 = rank_deficient(20, rank=3, batch=(2,), seed=6)
    ref = torch.linalg.inv(a64 + damping * eye_like(a64))
    dev = device_of(backend)
    out64 = backend.damped_inv(a64.to(dev), damping)
    assert rel_err(out64, ref) < 1e4 * EPS64 / damping
    out32 = backend.damped_inv(a64.float().to(dev), damping)
    assert out32.dtype == torch.float32
    cond = float(torch.linalg.matrix_norm(a64, ord=2).max()) / damping + 1
    assert rel_err(out32, ref) < 10 * cond * EPS32
    with pytest.raises(LinalgError):  # exactly singular without damping (float64)
        backend.damped_inv(torch.zeros(4, 4, dtype=torch.float64, device=dev), 0.0)


# ---------------------------------------------------------- kron_eigen_solve
def _dense_kron_solve(g, a, v, damping, scale):
    """(scale·G⊗A + damping·I)⁻¹ vec(v), row-major vec, via a dense float64 solve."""
    n = g.shape[-1] * a.shape[-1]
    dense = scale * torch.kron(g, a) + damping * torch.eye(n, dtype=torch.float64)
    return torch.linalg.solve(dense, v.reshape(-1)).reshape(v.shape)


@pytest.mark.parametrize(
    "kind,damping,scale",
    [("well", 1e-2, 1.0), ("well", 0.5, 3.0), ("rank_deficient", 1e-3, 1.0), ("rank_deficient", 1e-1, 8.0)],
)
def test_kron_eigen_solve_matches_dense_kron(backend, kind, damping, scale):
    if kind == "well":
        g, a = spd(4, cond=10.0, seed=7), spd(5, cond=10.0, seed=8)
    else:
        g, a = rank_deficient(4, 2, seed=7), rank_deficient(5, 1, seed=8)
    v = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    dev = device_of(backend)
    g_evals, g_evecs = backend.eigh(g.to(dev), dtype=torch.float64)
    a_evals, a_evecs = backend.eigh(a.to(dev), dtype=torch.float64)
    # roundoff can make zero eigenvalues slightly negative; the block code clamps them
    g_evals, a_evals = g_evals.clamp(min=0), a_evals.clamp(min=0)
    out = backend.kron_eigen_solve(g_evals, g_evecs, a_evals, a_evecs, v.to(dev), damping, scale)
    assert out.shape == (4, 5) and out.dtype == torch.float64 and out.device == dev
    ref = _dense_kron_solve(g, a, v, damping, scale)
    assert rel_err(out, ref) < 1e4 * EPS64 / damping
    # the defining property: (scale·G⊗A + d·I) vec(out) == vec(v)
    back = scale * g @ out.cpu() @ a.mT + damping * out.cpu()
    assert torch.allclose(back, v, atol=1e-9)


def test_kron_eigen_solve_batched_and_float32(backend):
    dev = device_of(backend)
    gs = torch.stack([spd(3, seed=s) for s in range(2)])
    as_ = torch.stack([spd(6, seed=10 + s) for s in range(2)])
    v = torch.randn(2, 3, 6, dtype=torch.float64)
    g_evals, g_evecs = backend.eigh(gs.float().to(dev))
    a_evals, a_evecs = backend.eigh(as_.float().to(dev))
    out = backend.kron_eigen_solve(g_evals, g_evecs, a_evals, a_evecs, v.float().to(dev), 0.1)
    assert out.shape == (2, 3, 6) and out.dtype == torch.float32
    for i in range(2):
        ref = _dense_kron_solve(gs[i], as_[i], v[i], 0.1, 1.0)
        assert rel_err(out[i], ref) < 1e3 * EPS32


# ------------------------------------------------------------ cross-backend
OTHERS = [p for p in ALL if p.values[0] != "torch"]


@pytest.mark.parametrize("other", OTHERS)
@pytest.mark.parametrize("dtype,cond,tol", [(torch.float32, 1e2, 1e3 * EPS32),
                                            (torch.float64, 1e8, 1e4 * EPS64)])
def test_backends_agree_with_torch(other, dtype, cond, tol):
    ref_b, b = get_backend("torch"), get_backend(other)
    a = spd(20, cond=cond, batch=(3,), seed=11)
    ev_r, q_r = ref_b.eigh(a, dtype=dtype)
    ev, q = b.eigh(a.to(device_of(b)), dtype=dtype)
    scale = float(ev_r.abs().max())
    assert float((ev.cpu() - ev_r).abs().max()) < tol * scale * 20
    # eigenvectors agree up to sign (eigenvalues are distinct): |Q_rᵀ Q| == I
    overlap = (q_r.mT @ q.cpu()).abs()
    gap_ok = cond < 1e3  # in float64 at cond 1e8 the small eigenvalues are still separated
    assert torch.allclose(overlap, eye_like(overlap), atol=1e-3 if gap_ok else 1e-5)
    assert rel_err(b.cholesky(a.to(device_of(b)), dtype=dtype), ref_b.cholesky(a, dtype=dtype)) < tol * 10
    inv_tol = tol * cond
    assert rel_err(b.inv(a.to(device_of(b)), dtype=dtype), ref_b.inv(a, dtype=dtype)) < inv_tol


# --------------------------------------------------------------- robustness
def test_inputs_are_not_modified_and_views_work(backend):
    """DLPack shares memory: the backend must never write into its input."""
    dev = device_of(backend)
    base = spd(8, seed=12).to(dev).requires_grad_(True)
    a = base.mT  # non-contiguous view that requires grad
    before = a.detach().clone()
    backend.eigh(a)
    backend.cholesky(a)
    backend.inv(a)
    backend.damped_inv(a, 0.5)
    rhs = torch.ones(8, 3, device=dev, dtype=torch.float64)
    backend.solve(a, rhs)
    assert torch.equal(a.detach(), before)
    assert torch.equal(rhs, torch.ones_like(rhs))
    expanded = spd(5, seed=13).to(dev).expand(3, 5, 5)  # stride-0 batch
    assert backend.inv(expanded).shape == (3, 5, 5)


# ------------------------------------------------------------------- errors
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_raises(backend, bad):
    dev = device_of(backend)
    a = spd(4).to(dev)
    a[1, 2] = bad
    for call in (lambda: backend.eigh(a), lambda: backend.cholesky(a), lambda: backend.inv(a),
                 lambda: backend.damped_inv(a, 1.0), lambda: backend.solve(a, torch.ones(4, device=dev))):
        with pytest.raises(LinalgError, match="non-finite"):
            call()
    rhs = torch.ones(4, device=dev, dtype=torch.float64)
    rhs[0] = bad
    with pytest.raises(LinalgError, match="rhs"):
        backend.solve(spd(4).to(dev), rhs)


def test_not_positive_definite_raises(backend):
    dev = device_of(backend)
    indefinite = torch.diag(torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)).to(dev)
    with pytest.raises(LinalgError, match="(?i)positive definite|non-finite|cholesky"):
        backend.cholesky(indefinite)
    with pytest.raises(LinalgError):
        backend.inv(indefinite)
    with pytest.raises(LinalgError, match="damping=0.5"):
        backend.damped_inv(indefinite, 0.5)  # still has eigenvalue -0.5
    assert backend.damped_inv(indefinite, 1.5).shape == (3, 3)  # now PD
    with pytest.raises(LinalgError):
        backend.solve(indefinite, torch.ones(3, dtype=torch.float64, device=dev))


def test_torch_backend_names_failing_batch_member():
    a = torch.stack([torch.eye(3), -torch.eye(3)])
    with pytest.raises(LinalgError, match="matrix 1 of the batch"):
        get_backend("torch").cholesky(a)


def test_kron_eigen_solve_not_pd_raises(backend):
    dev = device_of(backend)
    q = torch.eye(2, dtype=torch.float64, device=dev)
    ev_g = torch.tensor([-1.0, 1.0], dtype=torch.float64, device=dev)
    ev_a = torch.tensor([1.0, 2.0], dtype=torch.float64, device=dev)
    v = torch.ones(2, 2, dtype=torch.float64, device=dev)
    with pytest.raises(LinalgError, match="not positive"):
        backend.kron_eigen_solve(ev_g, q, ev_a, q, v, damping=0.5)
    out = backend.kron_eigen_solve(ev_g, q, ev_a, q, v, damping=3.0)  # min entry 1.0 > 0
    assert torch.allclose(out.cpu(), torch.tensor([[1 / 2.0, 1 / 1.0], [1 / 4.0, 1 / 5.0]], dtype=torch.float64))
    with pytest.raises(LinalgError, match="non-finite"):
        backend.kron_eigen_solve(ev_g, q, ev_a, q, v * float("nan"), damping=3.0)


def test_eigh_not_converging_is_wrapped_torch(monkeypatch):
    def fail(a):
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", fail)
    with pytest.raises(LinalgError, match="eigh .*converge"):
        get_backend("torch").eigh(torch.eye(3))


def test_eigh_not_converging_is_wrapped_xp(monkeypatch):
    def fail(a):
        raise numpy.linalg.LinAlgError("Eigenvalues did not converge")

    monkeypatch.setattr(numpy.linalg, "eigh", fail)
    with pytest.raises(LinalgError, match="eigh \\(numpy backend\\).*converge"):
        get_backend("numpy").eigh(torch.eye(3))


def test_silent_nan_output_is_caught_xp(monkeypatch):
    """cuSOLVER can return NaN instead of raising; the xp path must detect it."""
    real = numpy.linalg.eigh

    def nan_eigh(a):
        w, v = real(a)
        return w * numpy.nan, v

    monkeypatch.setattr(numpy.linalg, "eigh", nan_eigh)
    with pytest.raises(LinalgError, match="non-finite"):
        get_backend("numpy").eigh(torch.eye(3))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda b: b.eigh(torch.ones(3, 4)), "square"),
        (lambda b: b.eigh(torch.ones(3)), "square"),
        (lambda b: b.eigh(torch.eye(3, dtype=torch.int64)), "floating"),
        (lambda b: b.eigh(torch.eye(3), dtype=torch.float16), "dtype"),
        (lambda b: b.damped_inv(torch.eye(3), -1.0), "damping"),
        (lambda b: b.damped_inv(torch.eye(3), float("nan")), "damping"),
        (lambda b: b.solve(torch.eye(3), torch.ones(4, 2)), "rhs"),
        (lambda b: b.kron_eigen_solve(torch.ones(2), torch.eye(2), torch.ones(3), torch.eye(3),
                                      torch.ones(3, 2), 0.1), "v must be"),
        (lambda b: b.kron_eigen_solve(torch.ones(3), torch.eye(2), torch.ones(3), torch.eye(3),
                                      torch.ones(2, 3), 0.1), "g_evals"),
        (lambda b: b.kron_eigen_solve(torch.ones(2), torch.eye(2), torch.ones(3), torch.eye(3),
                                      torch.ones(2, 3), 0.1, scale=-1.0), "scale"),
    ],
)
@pytest.mark.parametrize("name", ["torch", "numpy"])
def test_bad_arguments_raise_value_error(name, call, match):
    with pytest.raises(ValueError, match=match):
        call(get_backend(name))


def test_linalg_error_is_value_error():
    assert issubclass(LinalgError, ValueError)


# ------------------------------------------------------------- selection
def test_default_and_env_selection(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert get_backend().name == "torch"
    monkeypatch.setenv(ENV, "")
    assert get_backend().name == "torch"
    monkeypatch.setenv(ENV, "numpy")
    assert get_backend().name == "numpy"
    assert get_backend(None).name == "numpy"
    monkeypatch.setenv(ENV, "  NumPy ")
    assert get_backend().name == "numpy"
    assert get_backend("torch").name == "torch"  # explicit name wins over the env var
    b = get_backend("numpy")
    assert get_backend(b) is b
    assert isinstance(get_backend("torch"), Backend)
    assert get_backend("torch") is not get_backend("torch")  # no shared mutable instances


def test_bad_names_raise(monkeypatch):
    with pytest.raises(ValueError, match="'jax'.*torch.*cupy.*numpy"):
        get_backend("jax")
    monkeypatch.setenv(ENV, "tensorflow")
    with pytest.raises(ValueError, match=f"'tensorflow'.*{ENV}"):
        get_backend()
    with pytest.raises(TypeError, match="linalg must be a backend name.*int 3"):
        get_backend(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'lapack' \\(from the linalg argument\\)"):
        get_backend("lapack")


def test_cupy_missing_says_so_and_suggests_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(ImportError, match="(?s)not installed.*'torch'"):
        get_backend("cupy")


def test_cupy_without_cuda_says_so_and_suggests_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setitem(sys.modules, "cupyx", types.ModuleType("cupyx"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="(?s)CUDA.*'torch'"):
        get_backend("cupy")


def test_cupy_requested_on_this_machine():
    if CUPY_SKIP is None:
        assert get_backend("cupy").name == "cupy"
    else:
        with pytest.raises((ImportError, RuntimeError), match="torch"):
            get_backend("cupy")


# ------------------------------------------------------------ GPU-only checks
@pytest.mark.skipif(CUPY_SKIP is not None, reason=str(CUPY_SKIP))
def test_cupy_is_zero_copy_on_current_stream():
    import cupy

    b = get_backend("cupy")
    a = spd(64, seed=14).float().cuda()
    x = cupy.from_dlpack(a)
    assert x.data.ptr == a.data_ptr()  # the exchange the backend relies on shares memory
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        a2 = a * 2  # enqueued on the side stream
        evals, evecs = b.eigh(a2)
        inv = b.inv(a2)
    stream.synchronize()
    assert evals.device == a.device
    assert rel_err(inv @ a2, eye_like(a2)) < 1e-3
    with pytest.raises(ValueError, match="cuda"):
        b.eigh(a.cpu())
