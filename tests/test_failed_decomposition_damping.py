"""A failed decomposition under ``adaptive_damping``: the rule raises the damping (past what an indefinite
Hessian's diagonal or full block fell short by), and a damping change whose re-decomposition fails keeps the
earlier decomposition instead of leaving the step without one."""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from torch import nn

from curvature.blocks import DiagBlock, FullBlock
from curvature.linalg import LinalgError
from optim_helpers import make_closure
from torchsso2 import NonFiniteError, SecondOrderOptimizer


def _layout(model: nn.Module):
    opt = SecondOrderOptimizer(model, approx="diag")
    return next(iter(opt.engine.layouts.values()))


@pytest.mark.parametrize("shape", ["diag", "full"])
def test_the_error_names_the_damping_shortfall(shape):
    """``scale·λ + damping`` with its smallest value −0.4: the damping falls short by 0.4."""
    lay = _layout(nn.Linear(2, 1, bias=False).double())
    values = torch.tensor([-0.5, 1.0], dtype=torch.float64)
    blk = DiagBlock(lay, values) if shape == "diag" else FullBlock(lay, torch.diag(values))
    with pytest.raises(LinalgError, match="not positive definite") as err:
        blk.decompose(0.1)
    assert err.value.damping_shortfall == pytest.approx(0.4, rel=1e-12)
    blk.decompose(0.1 + 2 * err.value.damping_shortfall)  # past it: decomposes


def test_other_failures_carry_no_shortfall():
    lay = _layout(nn.Linear(2, 1, bias=False).double())
    blk = DiagBlock(lay, torch.tensor([float("nan"), 1.0], dtype=torch.float64))
    with pytest.raises(LinalgError) as err:
        blk.decompose(0.1)
    assert err.value.damping_shortfall is None


def _digits_tanh(**kw):
    """A tanh MLP on 64 features whose Hessian diagonal is indefinite at the start (its first decomposition
    at damping 1e-3 fails: the smallest damped entry is about −0.05)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 10, generator=g)
    batches = []
    for _ in range(40):
        x = torch.randn(64, 64, generator=g)
        batches.append((x, (x @ w).argmax(1)))
    opt = SecondOrderOptimizer(model, approx="diag", curvature="hessian", damping=1e-3,
                               use_adaptive_learning_rate=True, use_adaptive_momentum=True, **kw)
    return model, opt, batches


def _loss(model, batches):
    with torch.no_grad():
        return sum(float(nn.functional.cross_entropy(model(x), y)) for x, y in batches) / len(batches)


def test_adaptive_damping_raises_the_damping_after_a_failed_decomposition(caplog):
    model, opt, batches = _digits_tanh(adaptive_damping=True)
    start = _loss(model, batches)
    x, y = batches[0]
    with caplog.at_level("WARNING", logger="torchsso2"):
        opt.step(make_closure(opt, model, x, y), targets=y)
    assert opt.num_skipped == 1 and opt.num_steps == 0  # no decomposition yet: the parameters stay
    assert "adaptive_damping raised the damping from 0.001 to" in caplog.text
    low = float(re.search(r"smallest eigenvalue (\S+)\)", caplog.text).group(1))
    assert low < -0.02  # past twice the shortfall of the first block, not one LM factor (1.29x)
    assert opt.damping == pytest.approx(1e-3 - 2 * low, rel=2e-3)
    for x, y in batches[1:]:  # the default max_consecutive_skips (20) does not stall it
        opt.step(make_closure(opt, model, x, y), targets=y)
    assert opt.num_skipped <= 5, opt.num_skipped
    assert _loss(model, batches) < 0.7 * start


def test_without_adaptive_damping_the_damping_stays_and_the_message_says_to_raise_it(caplog):
    model, opt, batches = _digits_tanh(max_consecutive_skips=3)
    with caplog.at_level("WARNING", logger="torchsso2"), \
            pytest.raises(NonFiniteError, match="consecutive steps were skipped"):
        for x, y in batches:
            opt.step(make_closure(opt, model, x, y), targets=y)
    assert opt.damping == 1e-3
    assert "increase damping above its most negative eigenvalue" in caplog.text


def test_raise_mode_raises_and_keeps_the_damping():
    model, opt, batches = _digits_tanh(adaptive_damping=True, on_nonfinite="raise")
    x, y = batches[0]
    with pytest.raises(NonFiniteError, match="decomposition failed"):
        opt.step(make_closure(opt, model, x, y), targets=y)
    assert opt.damping == 1e-3


def _lm_diag(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    args = dict(approx="diag", curvature="hessian", damping=1.0, lr=0.1, curv_update_interval=1000,
                inv_update_interval=1000)
    opt = SecondOrderOptimizer(model, **{**args, **kw})
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    opt.step(make_closure(opt, model, x, y), targets=y)
    return model, opt, x, y


def test_a_failed_re_decomposition_after_a_damping_change_keeps_the_earlier_one(caplog):
    """The damping changes (the LM rule's ``_set_damping``); the diagonal blocks cannot be re-damped in place,
    so the next step decomposes again. Where that fails, the step preconditions with the earlier
    decomposition (an update, as any later failed decomposition), not with none."""
    model, opt, x, y = _lm_diag()
    assert opt._decomposed and opt.num_steps == 1
    opt._set_damping(1e-3)
    assert opt._redamp_pending and opt._decomposed
    for blk in opt.running.blocks.values():  # a curvature the new damping cannot make positive
        blk.diagonal.fill_(-1.0)
    before = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level("WARNING", logger="torchsso2"):
        opt.step(make_closure(opt, model, x, y), targets=y)
    assert "keeps its previous decomposition" in caplog.text
    assert opt.num_steps == 2  # the step was taken, with the earlier decomposition
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert opt._redamp_pending  # tried again at the next step
    for blk in opt.running.blocks.values():
        blk.diagonal.fill_(1.0)
    opt.step(make_closure(opt, model, x, y), targets=y)
    assert not opt._redamp_pending
    for blk in opt.running.blocks.values():
        torch.testing.assert_close(blk.decomposition["denom"], torch.full_like(blk.diagonal, 1.0 + 1e-3))


def test_a_pending_re_decomposition_survives_a_checkpoint():
    model, opt, x, y = _lm_diag()
    opt._set_damping(0.5)
    sd = opt.state_dict()
    assert sd["torchsso2"]["extra"]["redamp_pending"] is True
    model2, opt2, _, _ = _lm_diag()
    opt2.load_state_dict(sd)
    assert opt2._redamp_pending and opt2.damping == 0.5
    opt2.step(make_closure(opt2, model2, x, y), targets=y)
    assert not opt2._redamp_pending
    blk = next(iter(opt2.running.blocks.values()))
    assert math.isclose(float(blk.decomposition["denom"][0] - blk.diagonal[0]), 0.5, rel_tol=1e-12)


def test_two_ranks_raise_the_damping_as_one_process(tmp_path):
    """The ranks decompose their blocks apart (``grad_worker_fraction`` 1 and 0.5): the largest shortfall is shared,
    so the damping follows one process's (it only rose by 1/ω per failure there and every step was skipped)."""
    import sys
    from pathlib import Path

    from dist_utils import mpi_rank_results

    scripts = Path(__file__).parent / "dist_scripts"
    sys.path.insert(0, str(scripts))
    import shortfall_worker

    single = shortfall_worker.train(None)
    assert single["skipped"] <= 3 and single["steps"] >= 9
    assert single["damping"][0] > 0.05  # past the first block's shortfall at once
    assert shortfall_worker.two_short_blocks(None) == pytest.approx(9.0)
    lm_single = {(m, n): shortfall_worker.kfac_lm(None, method=m, layers=n) for m in ("eigen", "inverse") for n in (1, 2)}
    assert lm_single["eigen", 2]["decomposed_at"] == [0, 7]  # re-damped in place: decomposed on schedule only
    assert len(lm_single["inverse", 2]["decomposed_at"]) > 7  # redone after each change
    for rank, results in enumerate(mpi_rank_results(scripts / "shortfall_worker.py", tmp_path)):
        # a rank whose first failing block is not the one falling shortest checks its later ones too
        assert results.pop("two_short_blocks") == {1.0: pytest.approx(9.0), 0.5: pytest.approx(9.0)}, rank
        # the LM rule's damping changes re-damp K-FAC eigen decompositions in place on the ranks too: the ranks
        # decompose when one process does (they decomposed again after every change) and follow its damping
        for (fraction, method, layers), got in results.pop("kfac_lm").items():
            ref = lm_single[method, layers]
            assert got["decomposed_at"] == ref["decomposed_at"], (rank, fraction, method, layers)
            torch.testing.assert_close(got["damping"], ref["damping"], rtol=1e-9, atol=0)
            torch.testing.assert_close(got["params"], ref["params"], rtol=1e-9, atol=1e-12)
        for fraction, got in results.items():
            assert (got["skipped"], got["steps"]) == (single["skipped"], single["steps"]), (rank, fraction)
            torch.testing.assert_close(got["damping"], single["damping"], rtol=1e-9, atol=0,
                                       msg=f"rank {rank}, grad_worker_fraction {fraction}")


def test_one_raise_covers_every_diagonal_block_short_of_damping():
    """Two diagonal blocks short by 0.1 and 4.0: the raise takes the larger (it took the first failing block's,
    and a second failure followed)."""
    model, opt, x, y = _lm_diag(adaptive_damping=True)
    first, second = opt.running.blocks.values()
    first.diagonal.fill_(-1.1)
    second.diagonal.fill_(-5.0)
    assert not opt._decompose(opt.damping)
    assert opt.damping == pytest.approx(1.0 + 2 * 4.0)
    assert opt._decompose(opt.damping)


@pytest.mark.parametrize("method", ["inverse", "eigen"])
def test_the_lm_rule_judges_a_raise_by_the_decomposition_the_step_used(monkeypatch, method):
    """A K-FAC decomposition failing at steps 3-5 (an eigh / Cholesky failure, simulated) with the LM rule at every
    step; the step takes the earlier decompositions. ``inverse``: they keep the old damping (re-decomposed at
    the next step), so this step's ρ, measured on an update at the old damping, does not judge the raise: the
    damping rises at each failed step (it stayed flat, raised and lowered in one step). ``eigen``: the raise
    re-damps them in place, the step's update is at the raised damping, and its ρ adjusts it as at any step."""
    from curvature.blocks import KFACBlock

    original = KFACBlock.decompose
    at = {"step": 0}

    def failing(self, *args, **kwargs):
        if 3 <= at["step"] <= 5:
            raise LinalgError(f"K-FAC block {self.layout.name!r}: decomposition failed (simulated)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(KFACBlock, "decompose", failing)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = SecondOrderOptimizer(model, approx="kfac", damping=0.1, adaptive_damping=True, damping_adaptation_interval=1,
                               kl_clip=None, lr=0.05, inv_update_interval=1, kfac_method=method)
    g = torch.Generator().manual_seed(0)
    trace = []
    for i in range(8):
        at["step"] = i
        x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
        before = opt.damping
        opt.step(make_closure(opt, model, x, y), targets=y)
        trace.append((before, opt.damping, opt.lm.last_rho))
    omega = opt.lm.decay
    for i in (3, 4, 5):
        before, after, rho = trace[i]
        if method == "inverse":
            assert after == pytest.approx(before / omega), (i, trace)
        else:  # raised by 1/ω, then the step's own ρ: ×ω (ρ > 0.75), ×1/ω (ρ < 0.25) or as raised
            factor = omega if rho > 0.75 else 1 / omega if rho < 0.25 else 1.0
            assert after == pytest.approx(before / omega * factor), (i, trace)
    assert opt.num_steps == 8  # every step updated (the failed ones with the earlier decompositions)


def test_a_step_rolled_back_keeps_the_damping_and_counts_it_had():
    """The decomposition fails (the damping is raised, a skip counted), then the LM rule's closure call raises: the
    step is given back as if never called, the damping, the rule's state and the skip counts included."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    opt = SecondOrderOptimizer(model, approx="diag", curvature="hessian", damping=1.0, lr=0.1, kl_clip=None,
                               adaptive_damping=True, damping_adaptation_interval=1, ema_decay=0.9,
                               curv_update_interval=1000, inv_update_interval=1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    calls = {"n": 0, "raise_at": None}

    def closure():
        calls["n"] += 1
        if calls["n"] == calls["raise_at"]:
            raise KeyboardInterrupt
        return make_closure(opt, model, x, y)()

    opt.step(closure, targets=y)
    for blk in opt.running.blocks.values():
        blk.diagonal.fill_(-3.0)  # the next decomposition fails (no estimate before step 1000)
    state = (opt.damping, vars(opt.lm).copy(), opt._redamp_pending, opt.num_skipped, opt._streak.count, opt.num_steps)
    calls["raise_at"] = calls["n"] + 2  # the LM rule's call
    with pytest.raises(KeyboardInterrupt):
        opt.step(closure, targets=y)
    assert (opt.damping, vars(opt.lm), opt._redamp_pending, opt.num_skipped, opt._streak.count, opt.num_steps) == state


def test_a_checkpoint_without_the_rule_gives_the_rule_its_damping():
    """Saved without adaptive_damping (damping 0.01), loaded into an optimizer with the rule (built with 0.1): the
    rule continues from 0.01 (it kept its own 0.1 and overwrote the loaded damping at its next adjustment)."""
    _, saved, x, y = _lm_diag(curvature="fisher")  # damping 1.0, no rule
    saved.damping = 0.01
    model, opt, _, _ = _lm_diag(adaptive_damping=True, damping_adaptation_interval=1, curvature="fisher")
    opt.load_state_dict(saved.state_dict())
    assert opt.damping == 0.01 and opt.lm.damping == 0.01
    opt.step(make_closure(opt, model, x, y), targets=y)
    assert opt.damping in (pytest.approx(0.01 * opt.lm.decay), pytest.approx(0.01 / opt.lm.decay))


def test_a_damping_clamped_at_load_redoes_the_decompositions():
    """The checkpoint's rule was at 1e-6, below this optimizer's min_damping 1e-4: it continues from 1e-4 (a
    warning), and the loaded decompositions (of 1e-6) are redone at the next step."""
    _, saved, x, y = _lm_diag(adaptive_damping=True, min_damping=1e-8, curvature="fisher")
    saved.damping = 1e-6
    saved.step(make_closure(saved, saved.model, x, y), targets=y)  # decomposed at 1e-6 (or raised by ω at most)
    model, opt, _, _ = _lm_diag(adaptive_damping=True, min_damping=1e-4, damping_adaptation_interval=1000,
                                curvature="fisher")
    with pytest.warns(UserWarning, match="outside this optimizer's adaptive damping range"):
        opt.load_state_dict(saved.state_dict())
    assert opt.damping == 1e-4 and opt._redamp_pending
    opt.step(make_closure(opt, model, x, y), targets=y)
    for blk in opt.running.blocks.values():
        torch.testing.assert_close(blk.decomposition["denom"] - blk.diagonal, torch.full_like(blk.diagonal, 1e-4))


def test_a_parameter_set_to_none_after_construction_is_named():
    model, opt, x, y = _lm_diag()
    model[2].bias = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the optimizer's warning about a parameter no longer in the model)
        with pytest.raises(ValueError, match=r"module '2' \(Linear\) no longer holds its parameter 'bias' as a "
                                             r"parameter \(it is None now\)"):
            opt.step(make_closure(opt, model, x, y), targets=y)


def test_a_stall_inside_the_decomposition_keeps_its_counts_and_says_what_it_kept():
    """``max_consecutive_skips`` reached by a failed decomposition (no earlier one): the step's curvature is put
    back, but the counts the error reports stay (the rollback had reset them: 2 skips after "3 consecutive");
    the message names an indefinite Hessian and what the state kept."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    opt = SecondOrderOptimizer(model, approx="diag", curvature="hessian", damping=0.0, max_consecutive_skips=3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NonFiniteError, match=r"3 consecutive steps were skipped.*indefinite \(curvature='hessian'"
                                                 r".*The parameters are as before the first skipped step; the running "
                                                 r"curvature has taken"):
            for _ in range(3):
                opt.step(make_closure(opt, model, x, y), targets=y)
    assert opt.num_skipped == 3 and opt._streak.count == 3


def test_the_shortfall_is_probed_only_where_the_damping_rule_reads_it(monkeypatch):
    """After a failed block the later diagonal and full blocks are decomposed to find their shortfall only with
    adaptive_damping in skip mode and an indefinite kind: a full block's probe is an eigendecomposition."""
    calls = []
    original = FullBlock.decompose

    def counted(self, *args, **kwargs):
        calls.append(self.layout.name)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(FullBlock, "decompose", counted)
    for kw, probed in ((dict(adaptive_damping=True), True), (dict(), False),
                       (dict(adaptive_damping=True, on_nonfinite="raise"), False),
                       (dict(adaptive_damping=True, curvature="fisher"), False)):
        model, opt, x, y = _lm_diag(approx={"0": "diag", "2": "full"}, **kw)
        opt.running.blocks["0"].diagonal.fill_(float("nan") if kw.get("curvature") else -5.0)
        calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                opt._decompose(opt.damping)
            except NonFiniteError:
                pass
        assert (calls == ["2"]) is probed, (kw, calls)


def test_a_probe_interrupted_gives_every_block_its_decomposition_back(monkeypatch):
    from curvature.running import decompose_all_or_nothing

    model, opt, x, y = _lm_diag(approx={"0": "diag", "2": "full"})
    before = {n: b.decomposition for n, b in opt.running.blocks.items()}
    opt.running.blocks["0"].diagonal.fill_(-5.0)

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(FullBlock, "decompose", interrupted)
    with pytest.raises(KeyboardInterrupt):
        decompose_all_or_nothing(opt.running.blocks, lambda b: b.decompose(1.0), probe=(DiagBlock, FullBlock))
    assert all(b.decomposition is before[n] for n, b in opt.running.blocks.items())
