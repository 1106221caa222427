"""What the curvature's rounding hides is not amplified into the step.

* A Fisher-type full block is positive semi-definite: its negative eigenvalues are round-off, taken as 0
  (as K-FAC's factors'), so a float32 empirical Fisher of inputs ~1e4 is not refused at the default
  damping; the Hessian's full block keeps its indefinite spectrum (a real negative eigenvalue is refused).
* A damping below the round-off of a positive semi-definite block's largest eigenvalue is that round-off
  (``curvature.blocks.base.roundoff_damping``): K-FAC at damping 1e-10 trains instead of stepping along
  round-off directions; damping 0 stays an exact, checked solve.
* ``damped_inv`` of a positive semi-definite factor whose rounding makes Cholesky fail takes the
  inverse from ``eigh`` (a truly indefinite matrix is still refused: ``tests/test_linalg.py``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvature.blocks import FullBlock, KFACBlock
from curvature.blocks.layout import Layout
from curvature.modules.linear import LinearFamily
from curvature.linalg import LinalgError, get_backend
from optim_helpers import make_closure
from torchsso2 import SecondOrderOptimizer
from torchsso2.kfac import KFACPreconditioner


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)


def _data(scale: float = 1.0, zero_columns: int = 0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=g) * scale
    x[:, :zero_columns] = 0
    return x, torch.randint(0, 3, (16,), generator=g)


def _train(opt, model, x, y, steps: int = 50):
    closure = make_closure(opt, model, x, y)
    losses = []
    for _ in range(steps):
        loss, _ = opt.step(closure)
        losses.append(float(loss))
    return losses


def _rank_deficient_gram(scale: float, n: int = 40, rank: int = 12) -> torch.Tensor:
    """A float32 Gram matrix of ``rank`` rows ~``scale``: positive semi-definite, eigenvalues ~scale² and 0."""
    g = torch.Generator().manual_seed(1)
    m = torch.randn(rank, n, generator=g) * scale
    return m.t() @ m / rank


def _layout(d_in: int, d_out: int) -> Layout:
    return Layout("fc", nn.Linear(d_in, d_out), LinearFamily(), ("weight", "bias"))


def _full_block(matrix: torch.Tensor) -> FullBlock:
    return FullBlock(_layout(matrix.shape[0] - 1, 1), matrix)


def test_a_psd_full_blocks_round_off_negative_eigenvalues_are_zero_the_hessians_are_not():
    c = _rank_deficient_gram(1e4)
    evals = torch.linalg.eigvalsh(c)
    assert float(evals.min()) < -0.1  # round-off below -damping: the plain decomposition fails
    with pytest.raises(LinalgError, match="not positive definite"):
        _full_block(c).decompose(0.1)
    blk = _full_block(c)
    blk.decompose(0.1, psd=True)
    assert bool((blk.decomposition["denom"] > 0).all())
    assert float(blk.decomposition["denom"].min()) >= 0.1
    # a real negative eigenvalue (an indefinite Hessian) is refused whatever psd says of the Hessian's blocks
    with pytest.raises(LinalgError):
        _full_block(torch.diag(torch.tensor([1.0, -1.0, 2.0]))).decompose(0.5)


def test_full_empirical_fisher_of_large_inputs_takes_every_step():
    """Inputs ~1e4 (float32): every decomposition at the default damping failed on round-off before."""
    x, y = _data(1e4)
    model = _mlp()
    opt = SecondOrderOptimizer(model, approx="full", curvature="empirical_fisher", lr=0.05)
    losses = _train(opt, model, x, y, steps=20)
    assert opt.num_skipped == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < losses[0]


def test_roundoff_damping():
    from curvature.blocks.base import roundoff_damping
    from curvature.linalg.checks import coarsest_eps
    eps = torch.finfo(torch.float32).eps
    assert coarsest_eps(torch.float64, torch.float32) == eps                  # float32 statistics in float64
    assert roundoff_damping(0.1, 10.0, eps) == 0.1                            # above the round-off: as given
    assert roundoff_damping(1e-10, 10.0, eps) == pytest.approx(10.0 * eps)
    assert roundoff_damping(1e-10, 10.0, coarsest_eps(torch.float64)) == 1e-10  # float64's is below it
    assert roundoff_damping(0.0, 10.0, eps) == 0.0                            # undamped stays undamped
    floored = roundoff_damping(1e-10, torch.tensor(10.0), eps)                # on the device, as a 0-dim tensor
    assert isinstance(floored, torch.Tensor) and float(floored) == pytest.approx(10.0 * eps)


@pytest.mark.parametrize("old, new", [(1e-2, 1e-6), (1e-6, 0.1), (1e-10, 1e-9), (0.0, 1e-8), (0.5, 0.25)])
def test_the_lm_rules_redamp_equals_a_decomposition_at_the_new_damping(old, new):
    """The Levenberg-Marquardt rule moves a decomposition's damping in place (torchsso2/optim/redamp.py):
    the floor must hold there too (it added ``new − old`` before, bypassing it when the damping shrank)."""
    from torchsso2.optim.redamp import redamp
    g = torch.Generator().manual_seed(2)
    a, gf = torch.randn(2, 6, generator=g), torch.randn(4, 4, generator=g)  # a rank-2 input factor

    def block() -> KFACBlock:
        return KFACBlock(_layout(5, 4), gf @ gf.t() * 100, a.t() @ a)

    moved, fresh = block(), block()
    if old == 0.0:
        moved.decompose(1e-30)  # (a rank-deficient factor at damping 0 is refused: start just above it)
        old = 1e-30
    else:
        moved.decompose(old)
    assert redamp({"fc": moved}, old, new)
    fresh.decompose(new)
    want = fresh.decomposition["denom"]  # (the old damping subtracted again: float32 rounding of the largest entry)
    torch.testing.assert_close(moved.decomposition["denom"], want, rtol=1e-6, atol=1e-8 * float(want.max()))
    assert float(moved.decomposition["denom"].min()) >= 0.99 * float(want.min())  # the floor, not new alone


def test_kfac_denominators_are_floored_at_the_products_round_off():
    g = torch.Generator().manual_seed(2)
    a, gf = torch.randn(6, 6, generator=g), torch.randn(4, 4, generator=g)
    blk = KFACBlock(_layout(5, 4), gf @ gf.t() * 100, a @ a.t())
    blk.decompose(1e-10)
    top = float(torch.linalg.eigvalsh(blk.left).max() * torch.linalg.eigvalsh(blk.right).max())
    floor = torch.finfo(torch.float32).eps * top
    assert float(blk.decomposition["denom"].min()) >= 0.99 * floor
    blk.decompose(0.5)  # a damping above it is exact: denom - damping is the eigenvalue products
    el, er = torch.linalg.eigvalsh(blk.left).clamp_min(0), torch.linalg.eigvalsh(blk.right).clamp_min(0)
    torch.testing.assert_close(blk.decomposition["denom"], torch.outer(el, er) + 0.5, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("curv", ["fisher_mc", "fisher", "empirical_fisher"])
def test_kfac_at_a_damping_of_1e_10_trains(curv):
    """Damping 1e-10 divided the first step by round-off: a step of norm ~170 and a loss up 60–1e5×."""
    x, y = _data()
    model = _mlp()
    opt = SecondOrderOptimizer(model, approx="kfac", curvature=curv, lr=0.05, damping=1e-10)
    losses = _train(opt, model, x, y)
    assert max(losses) < 20 * losses[0] and losses[-1] < 0.1 * losses[0], losses[::10]
    assert opt.num_skipped == 0


def test_damped_inv_of_a_psd_factor_that_cholesky_refuses_on_round_off():
    c = _rank_deficient_gram(1e6)  # eigenvalues ~1e12 and round-off ~1e5 of either sign, in float32
    with pytest.raises(LinalgError):
        get_backend("torch").cholesky(c + 1e-3 * torch.eye(c.shape[0]))
    inv = get_backend("torch").damped_inv(c, 1e-3)
    assert bool(torch.isfinite(inv).all())
    spectrum = torch.linalg.eigvalsh(inv.double())  # (c⁺ + d·I)⁻¹: eigenvalues in (0, 1/d], d >= 1e-3
    assert float(spectrum.min()) > -1e-6 * float(spectrum.max()) and float(spectrum.max()) <= 1e3
    # where Cholesky succeeds nothing changes: the Cholesky inverse
    well = _rank_deficient_gram(1.0, rank=60)
    torch.testing.assert_close(get_backend("torch").damped_inv(well, 1e-3),
                               torch.cholesky_inverse(torch.linalg.cholesky(well + 1e-3 * torch.eye(40))))


def test_kfac_preconditioner_inverse_method_stays_finite_on_huge_factors():
    """MSE targets ~1e6: factors ~1e12; the inverse method's Cholesky failed and the drop-in loop went NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g) * 1e6
    pre = KFACPreconditioner(model, compute_method="inverse", damping=0.001, factor_update_steps=1,
                             inv_update_steps=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-16, momentum=0.9)
    try:
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            pre.step()
            assert not pre.last_step_skipped
            opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        pre.remove_hooks()


@pytest.mark.parametrize("method", ["native", "tracenorm"])
def test_inverse_method_in_float64_judges_float32_factors_by_float32_round_off(method):
    """``decomposition_dtype=torch.float64`` (the remedy the warnings name) cast a float32 factor before
    ``damped_inv``, which then took its float32 rounding for float64's: factors ~1e12 at damping 1e-3
    failed Cholesky with no eigh fallback (every step skipped) where the float32 decomposition worked."""
    from torchsso2.compat.pytorch_sso import tracenorm_damped_inverse
    a = _rank_deficient_gram(1e6)  # [40, 40] float32, eigenvalues ~1e12 and float32 round-off of either sign
    # G ~ A in scale: the trace-norm shift on A stays ~√damping (a small G would raise it far above round-off)
    blk = KFACBlock(_layout(39, 4), torch.eye(4) * 1e12, a)
    for dtype in (None, torch.float64):
        if method == "native":
            blk.decompose(1e-3, method="inverse", dtype=dtype)
            inv = blk.decomposition["rinv"]
        else:
            inv = tracenorm_damped_inverse(blk, 1e-3, dtype=dtype)["rinv"]
        assert inv.dtype == (dtype or torch.float32)
        spectrum = torch.linalg.eigvalsh(inv.double())  # (a⁺ + s·I)⁻¹: eigenvalues in (0, 1/s]
        assert bool(torch.isfinite(spectrum).all()) and float(spectrum.min()) > -1e-6 * float(spectrum.max())


def test_second_order_inverse_method_with_float64_decompositions_takes_every_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 4))
    with torch.no_grad():
        model[0].weight.mul_(1e-6)  # logits O(1) on inputs ~1e6
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 48, generator=g) * 1e6, torch.randint(0, 4, (4,), generator=g)
    opt = SecondOrderOptimizer(model, lr=1e-3, curvature="fisher", kfac_method="inverse", damping=1e-3,
                               decomposition_dtype=torch.float64, max_consecutive_skips=None)
    _train(opt, model, x, y, steps=5)
    assert opt.num_skipped == 0


def test_batched_damped_inv_floors_the_damping_per_matrix():
    """The round-off floor ``eps·max a_ii`` was the batch's largest diagonal entry for every member."""
    for name in ("torch", "numpy"):
        b = get_backend(name)
        batch = torch.stack([torch.diag(torch.tensor([1e10, 1.0])), torch.diag(torch.tensor([1.0, 1e-6]))])
        out = b.damped_inv(batch, 1e-6)
        for i in range(2):
            torch.testing.assert_close(out[i], b.damped_inv(batch[i], 1e-6))
        torch.testing.assert_close(out[1].diagonal(), torch.tensor([1 / (1 + 1e-6), 1 / 2e-6]))


def test_kfac_preconditioner_reads_the_linalg_environment_variable(monkeypatch):
    monkeypatch.setenv("TORCHSSO2_LINALG", "numpy")
    pre = KFACPreconditioner(_mlp())
    try:
        assert pre.backend.name == "numpy"
    finally:
        pre.remove_hooks()
    pre = KFACPreconditioner(_mlp(), linalg="torch")  # an explicit name wins
    try:
        assert pre.backend.name == "torch"
    finally:
        pre.remove_hooks()


def test_inverse_method_scale_is_folded_into_the_damping():
    """``scale·F`` of a float32 factor ~1e30 at scale 1e10 overflowed float32 before the float64 cast."""
    blk = KFACBlock(_layout(1, 2), torch.eye(2) * 1e30, torch.eye(2))
    blk.decompose(1e-3, scale=1e10, method="inverse", dtype=torch.float64)
    linv, rinv = blk.decomposition["linv"], blk.decomposition["rinv"]
    eye = torch.eye(2, dtype=torch.float64)  # each factor damped: (s·L + λI)⁻¹ and (R + λI)⁻¹
    torch.testing.assert_close(linv, eye / (1e40 + 1e-3), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(rinv, eye / (1 + 1e-3), rtol=1e-6, atol=0.0)
    # the same numbers as scaling first where that fits
    small = KFACBlock(_layout(1, 2), torch.eye(2) * 3.0, torch.eye(2) * 2.0)
    small.decompose(1e-2, scale=4.0, method="inverse")
    torch.testing.assert_close(small.decomposition["linv"], torch.linalg.inv(12.0 * torch.eye(2) + 1e-2 * torch.eye(2)))
    # a tiny scale is not folded (λ/s would overflow float32): (s·L + λI)⁻¹ as before
    tiny = KFACBlock(_layout(1, 2), torch.eye(2) * 3.0, torch.eye(2) * 2.0)
    tiny.decompose(1e3, scale=1e-38, method="inverse")
    torch.testing.assert_close(tiny.decomposition["linv"], torch.eye(2) / 1e3)
