"""A failing rank ends a 2-rank job with a non-zero code and a message, within a bound.

Real launches (``mpiexec -n 2`` and ``torchrun --nproc_per_node=2``) of
tests/dist_scripts/fault_worker.py, where rank 1 raises, exits, hangs, exits before MPI is
initialized, or builds its optimizer with a different schedule. Fast in-process checks of the
settings comparison and of the timeout / opt-out configuration come first.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from dist_utils import assert_replicas_equal_one_process, launch, mpiexec_command, torchrun_command
from torchsso2.distributed import faults
from torchsso2.distributed.communicator import BucketedCommunicator
from torchsso2.distributed.consistency import check_same_settings, describe

SCRIPTS = Path(__file__).parent / "dist_scripts"
WORKER = str(SCRIPTS / "fault_worker.py")


# ---------------------------------------------------------------------------------------
# in-process: the settings check over a 2-rank communicator made of two threads
# ---------------------------------------------------------------------------------------
class ThreadPair:
    """What two threads share to play ranks 0 and 1 of a world of 2."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=10)
        self.slots: List[Optional[torch.Tensor]] = [None, None]


class ThreadComm(BucketedCommunicator):
    """Rank ``rank`` of a :class:`ThreadPair`: a real sum over the two threads' buffers."""

    def __init__(self, pair: ThreadPair, rank: int) -> None:
        super().__init__(rank=rank, world_size=2)
        self.pair = pair

    def barrier(self) -> None:
        self.pair.barrier.wait()

    def _allreduce_sum_(self, buffer: torch.Tensor) -> int:
        self.pair.slots[self.rank] = buffer.clone()
        self.pair.barrier.wait()
        total = self.pair.slots[0] + self.pair.slots[1]
        self.pair.barrier.wait()
        buffer.copy_(total)
        return buffer.numel() * buffer.element_size()

    def _broadcast_(self, buffer: torch.Tensor, src: int, members: Tuple[int, ...], handle: Any) -> int:
        raise NotImplementedError("not needed by the settings check")

    def _make_group_handle(self, ranks: Tuple[int, ...]) -> Any:
        raise NotImplementedError("not needed by the settings check")


def _on_two_threads(body: Callable[[int], None], timeout: float = 30.0) -> List[Optional[BaseException]]:
    """``body(rank)`` on 2 threads playing ranks 0 and 1; the exception each raised (None if none)."""
    errors: List[Optional[BaseException]] = [None, None]

    def run(rank: int) -> None:
        try:
            body(rank)
        except BaseException as exc:  # noqa: BLE001 - collected for the test
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "the two ranks hung"
    return errors


def _check_on_two_ranks(settings: Sequence[Dict[str, Any]]) -> List[Optional[BaseException]]:
    pair = ThreadPair()
    comms = [ThreadComm(pair, r) for r in range(2)]
    errors = _on_two_threads(lambda rank: check_same_settings(comms[rank], settings[rank], "TestOptimizer"), 20)
    # the check is not the optimizer's traffic: the counters the cost models predict stay at 0
    assert [(c.bytes_sent, c.num_collectives) for c in comms] == [(0, 0), (0, 0)]
    return errors


def test_settings_check_passes_when_equal_and_names_every_difference() -> None:
    same = {"factor_update_steps": 1, "damping": 1e-3, "layers": {"fc": {"A": 5, "G": 3}}}
    assert _check_on_two_ranks([same, dict(same)]) == [None, None]
    other = dict(same, factor_update_steps=2, damping=lambda step: 1e-3)
    errors = _check_on_two_ranks([same, other])
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert str(errors[0]) == str(errors[1])  # the same message on every rank
    message = str(errors[0])
    assert "TestOptimizer" in message
    assert "factor_update_steps (rank 0: 1, rank 1: 2)" in message
    assert "damping (rank 0: 0.001, rank 1: callable" in message
    assert "layers" not in message  # equal settings are not named


def test_settings_check_compares_layer_shapes() -> None:
    errors = _check_on_two_ranks([{"layers": {"fc": {"A": 5, "G": 3}}}, {"layers": {"fc": {"A": 6, "G": 3}}}])
    assert "layers (rank 0: {fc: {A: 5, G: 3}}, rank 1: {fc: {A: 6, G: 3}})" in str(errors[0])


def _construct_on_two_ranks(face: str, kwargs: List[Dict[str, Any]],
                            dtypes: Sequence[torch.dtype] = (torch.float32, torch.float32),
                            buffers: Sequence[Dict[str, torch.Tensor]] = ({}, {}),
                            frozen_rows: Optional[Sequence[int]] = None) -> List[Optional[BaseException]]:
    """Build the face on 2 ranks played by 2 threads (rank r: ``kwargs[r]``, a model in ``dtypes[r]`` with the
    buffers ``buffers[r]`` registered on its first layer; with ``frozen_rows``, a frozen ``Embedding`` of
    ``frozen_rows[r]`` rows first, outside the param groups); the exception each rank's constructor raised."""
    from torchsso2 import SecondOrderOptimizer, VIOptimizer

    pair = ThreadPair()

    def build(rank: int) -> None:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)).to(dtypes[rank])
        for name, value in buffers[rank].items():
            model[0].register_buffer(name, value.clone())
        if frozen_rows is not None:
            model = torch.nn.Sequential(torch.nn.Embedding(frozen_rows[rank], 4).requires_grad_(False), *model)
        if face == "sso":
            SecondOrderOptimizer(model, communicator=ThreadComm(pair, rank), **kwargs[rank])
        else:  # reparam=True/False: curvature="reparam" (the estimator) or the exact Fisher, same kind
            kw = dict(kwargs[rank])
            if "reparam" in kw:
                kw = {"curvature": "reparam" if kw.pop("reparam") else "fisher"}
            VIOptimizer(model, **{"dataset_size": 100, **kw}, communicator=ThreadComm(pair, rank))
    return _on_two_threads(build)


@pytest.mark.parametrize("face,kwargs", [
    ("sso", [dict(damping=1e-3), dict(damping=1e-2)]),
    ("sso", [dict(adaptive_damping=False), dict(adaptive_damping=True)]),
    ("vi", [dict(num_mc_samples=1), dict(num_mc_samples=2)]),
    ("vi", [dict(dataset_size=100), dict(dataset_size=50)]),
    ("vi", [dict(noise_variance="learned", loss="mse"), dict(noise_variance=0.5, loss="mse")]),
    ("sso", [dict(kfac_approx="expand"), dict(kfac_approx="reduce")]),
    ("sso", [dict(curv_warmup_steps=0), dict(curv_warmup_steps=10)]),
    ("sso", [dict(use_adaptive_learning_rate=False, damping=0.1), dict(use_adaptive_learning_rate=True, damping=0.1)]),
    ("sso", [dict(use_adaptive_momentum=True, damping=0.1), dict(use_adaptive_momentum=False, damping=0.1)]),
    ("sso", [dict(adaptive_coefficients_interval=1, use_adaptive_learning_rate=True),
             dict(adaptive_coefficients_interval=3, use_adaptive_learning_rate=True)]),
    # found unchecked by an audit (an MPI abort at the first broadcast, or replicas drifting apart)
    ("sso", [dict(kfac_method="eigen"), dict(kfac_method="inverse")]),
    ("sso", [dict(damping_adaptation_decay=0.95, adaptive_damping=True),
             dict(damping_adaptation_decay=0.5, adaptive_damping=True)]),
    ("sso", [dict(min_damping=1e-4, adaptive_damping=True), dict(min_damping=1e-6, adaptive_damping=True)]),
    ("vi", [dict(reparam=True), dict(reparam=False)]),  # the default reparam estimator vs the exact Fisher
    ("vi", [dict(momentum_debias=True), dict(momentum_debias=False)]),
    ("vi", [dict(curvature_init=1.0), dict(curvature_init=2.0)]),
    ("vi", [dict(mc_parallel=1), dict(mc_parallel=2)]),
])
def test_native_optimizer_settings_compared_across_ranks(face: str, kwargs: List[Dict[str, Any]]) -> None:
    """The construction-time check of the native faces, on 2 ranks played by 2 threads."""
    errors = _construct_on_two_ranks(face, kwargs)
    assert all(isinstance(e, ValueError) for e in errors), errors
    name = next(iter(kwargs[0]))
    values = [describe(k[name]) for k in kwargs]
    assert f"{name} (rank 0: {values[0]}, rank 1: {values[1]})" in str(errors[0]), errors[0]
    assert str(errors[0]) == str(errors[1])


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_model_dtypes_compared_across_ranks(face: str) -> None:
    """A model in float32 on one rank and float64 on another: a ValueError naming the dtypes at
    construction (the start's broadcast had corrupted the weights or aborted the job)."""
    errors = _construct_on_two_ranks(face, [{}, {}], (torch.float32, torch.float64))
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert "param_dtypes (rank 0: ['torch.float32'], rank 1: ['torch.float64'])" in str(errors[0]), errors[0]


@pytest.mark.parametrize("face", ["sso", "vi"])
@pytest.mark.parametrize("ranks,named", [
    (({"stat": torch.zeros(4)}, {"stat": torch.zeros(7)}), "buffers (rank 0: ['0.stat: [4] torch.float32'], "
                                                           "rank 1: ['0.stat: [7] torch.float32'])"),
    (({"stat": torch.zeros(4)}, {"stat": torch.zeros(4, dtype=torch.float64)}), "0.stat: [4] torch.float64"),
    (({"stat": torch.zeros(4)}, {}), "buffers.count (rank 0: 1, rank 1: 0)"),
])
def test_model_buffers_compared_across_ranks(face: str, ranks: Any, named: str) -> None:
    """The start broadcasts rank 0's buffers into the others' by position: a buffer of another size filled
    rank 1's with uninitialised memory under gloo, another dtype or number aborted the job (MPI: a bare
    'Other MPI error'). A ValueError naming the buffers at construction on every rank."""
    errors = _construct_on_two_ranks(face, [{}, {}], buffers=ranks)
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert named in str(errors[0]), errors[0]
    assert str(errors[0]) == str(errors[1])


def test_a_long_differing_setting_is_shown_where_the_ranks_differ() -> None:
    """A setting whose text is longer than the message's share (a model's buffer list) is shown from a little
    before the first character where the ranks differ, not as the prefix they share."""
    same = [f"layer{i}.running_mean: [64] torch.float32" for i in range(40)]
    other = same[:-1] + ["layer39.running_mean: [65] torch.float32"]
    errors = _check_on_two_ranks([{"buffers": same}, {"buffers": other}])
    message = str(errors[0])
    assert "layer39.running_mean: [64]" in message and "layer39.running_mean: [65]" in message, message
    assert "rank 0: …" in message and "layer0." not in message, message


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_model_parameters_outside_the_groups_compared_across_ranks(face: str) -> None:
    """The start broadcasts every model parameter, a frozen one outside the param groups too: another size of it
    on one rank shifted the broadcast of the trainable ones after it (the review: silent under gloo)."""
    errors = _construct_on_two_ranks(face, [{}, {}], frozen_rows=(10, 12))
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert "model.parameters" in str(errors[0]) and "0.weight: [10, 4]" in str(errors[0]), errors[0]


def test_describe_is_stable_text() -> None:
    assert describe(torch.float32) == "torch.float32"
    assert describe([1, 2.5, None]) == "[1, 2.5, None]"
    assert describe(print) == "callable print"
    # one number, one text: lr=1 on one rank and 1.0 (or np.float64(1.0)) on another is one setting
    import numpy as np
    assert describe(1) == describe(1.0) == describe(np.float64(1.0)) == describe(np.int64(1)) == "1"
    assert describe(0.1) == describe(np.float64(0.1)) == "0.1" and describe(True) != describe(1)
    assert describe(torch.tensor(1.0)) == describe(1.0)  # a tensor lr is its number's setting


@pytest.mark.parametrize("face,kwargs", [
    ("sso", [dict(lr=1), dict(lr=1.0)]),
    ("sso", [dict(momentum=0), dict(momentum=0.0)]),
    ("sso", [dict(grad_worker_fraction="comm_opt"), dict(grad_worker_fraction=1.0)]),
    ("sso", [dict(kfac_method="Eigen"), dict(kfac_method="eigen")]),
    ("vi", [dict(noise_variance=__import__("numpy").float64(0.5), loss="mse"), dict(noise_variance=0.5, loss="mse")]),
])
def test_equal_settings_in_other_spellings_agree_across_ranks(face: str, kwargs: List[Dict[str, Any]]) -> None:
    """They were refused as different settings. (The two threads' communicator serves the settings check alone:
    a construction past it stops at the next collective, NotImplementedError.)"""
    errors = _construct_on_two_ranks(face, kwargs)
    assert all(isinstance(e, NotImplementedError) and "not needed by the settings check" in str(e)
               for e in errors), errors


def test_timeout_and_opt_out_configuration() -> None:
    assert faults.resolve_timeout(None, {}) == faults.DEFAULT_TIMEOUT_S == 60.0
    assert faults.resolve_timeout(None, {faults.TIMEOUT_ENV: "7.5"}) == 7.5
    assert faults.resolve_timeout(3, {faults.TIMEOUT_ENV: "7.5"}) == 3.0  # the argument wins
    for bad in ("abc", "0", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match=faults.TIMEOUT_ENV):
            faults.resolve_timeout(None, {faults.TIMEOUT_ENV: bad})
    for bad_arg in (0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="timeout"):
            faults.resolve_timeout(bad_arg)
    assert faults.resolve_abort_on_exception(None, {}) is True
    assert faults.resolve_abort_on_exception(None, {faults.ABORT_ENV: "0"}) is False
    assert faults.resolve_abort_on_exception(None, {faults.ABORT_ENV: "off"}) is False
    assert faults.resolve_abort_on_exception(False, {}) is False
    with pytest.raises(TypeError, match="abort_on_exception"):
        faults.resolve_abort_on_exception("no")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# real launches
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("face", ["sso", "vi", "kfac"])
def test_mpi_rank_that_raises_aborts_the_job(face: str) -> None:
    """Issue 28 item 2: no install_abort_on_exception in the script; the library installs it."""
    code, out, elapsed = launch(mpiexec_command(WORKER, face, "raise"), 30.0)
    assert code != 0, out
    assert "rank 1 fails on purpose" in out, out
    assert "[rank 1] uncaught RuntimeError" in out, out
    assert elapsed < 30.0, (elapsed, out)


def test_mpi_rank_that_exits_ends_the_job() -> None:
    """Issue 33 item 1: sys.exit(3) on rank 1 after step 1; rank 0 names it instead of waiting."""
    code, out, elapsed = launch(mpiexec_command(WORKER, "sso", "exit"), 60.0)
    assert code != 0, out
    assert "rank 1 exited" in out and "rank 0:" in out, out
    assert elapsed < 60.0, (elapsed, out)


@pytest.mark.parametrize("python_m_mpi4py", [False, True], ids=["python", "python-m-mpi4py"])
def test_mpi_rank_that_exits_before_init_ends_the_job(python_m_mpi4py: bool) -> None:
    """Issue 33 item 1: rank 1 exits before MPI is initialized; rank 0's MPI_Init is bounded."""
    code, out, elapsed = launch(mpiexec_command(WORKER, "sso", "preinit", python_m_mpi4py=python_m_mpi4py), 60.0,
                                 TORCHSSO2_DIST_TIMEOUT="3")
    assert code != 0, out
    assert "[rank 0] MPI_Init did not complete within 3 s" in out, out
    assert elapsed < 60.0, (elapsed, out)


def test_mpi_rank_that_hangs_times_out_and_is_named() -> None:
    """3 ranks, rank 1 hangs: ranks 0 and 2 give up after the timeout; each asks the others what
    they wait in, so the message names rank 1 as the one that never arrived and the other as waiting."""
    code, out, elapsed = launch(mpiexec_command(WORKER, "kfac", "hang", ranks=3), 60.0, TORCHSSO2_DIST_TIMEOUT="3")
    assert code != 0, out
    said = [line for line in out.splitlines() if "uncaught CollectiveTimeoutError" in line]
    assert said, out
    for line in said:
        assert "allreduce over ranks [0, 1, 2] did not complete within 3 s: rank 1 did not reach it" in line, out
        assert "rank 0 waits in allreduce" in line or "rank 2 waits in allreduce" in line, out
    assert elapsed < 60.0, (elapsed, out)


def test_mpi_opt_out_installs_no_abort_hook() -> None:
    """TORCHSSO2_ABORT_ON_EXCEPTION=0: the library leaves sys.excepthook alone (the collective
    timeout still ends the job: rank 0 gives up waiting for the rank that raised)."""
    code, out, elapsed = launch(mpiexec_command(WORKER, "sso", "raise"), 60.0, TORCHSSO2_DIST_TIMEOUT="3",
                                 TORCHSSO2_ABORT_ON_EXCEPTION="0")
    assert code != 0, out
    assert "rank 1 fails on purpose" in out, out
    assert "calling MPI_Abort" not in out, out
    assert "did not complete within 3 s" in out, out


def test_readme_digits_demo_with_a_raising_rank_ends() -> None:
    """README's ``mpiexec -n 2 python examples/train_digits.py``, rank 1 raising in its third step
    (an exiting rank is the same mechanism as test_mpi_rank_that_exits_ends_the_job)."""
    pytest.importorskip("sklearn", reason="the demo needs scikit-learn")
    cmd = mpiexec_command(str(SCRIPTS / "digits_fault.py"), "raise", "--epochs", "1", "--no-progress",
                   "--optimizer", "sso-kfac")
    code, out, elapsed = launch(cmd, 60.0)  # the whole launch, data loading included (issue 33's bound)
    assert code != 0, out
    assert "rank 1 fails on purpose" in out, out
    assert elapsed < 60.0, (elapsed, out)


def test_torchrun_rank_that_hangs_times_out() -> None:
    """Under torchrun the survivor gives up after the configured timeout, not gloo's 300 s."""
    code, out, elapsed = launch(torchrun_command(WORKER, "sso", "hang"), 60.0, TORCHSSO2_DIST_TIMEOUT="3")
    assert code != 0, out
    assert "rank 0: allreduce over ranks [0, 1] did not complete within 3 s: rank 1 had not reached it" in out, out
    assert elapsed < 60.0, (elapsed, out)


@pytest.mark.parametrize("launcher, face, mismatch", [
    ("mpiexec", "kfac", "factor_update_steps (rank 0: 1, rank 1: 2)"),
    ("torchrun", "kfac", "factor_update_steps (rank 0: 1, rank 1: 2)"),
    # SecondOrderOptimizer (VIOptimizer shares the check, in their base class)
    ("mpiexec", "sso", "curv_update_interval (rank 0: 1, rank 1: 2)"),
])
def test_different_schedules_raise_on_every_rank(launcher: str, face: str, mismatch: str) -> None:
    command = mpiexec_command if launcher == "mpiexec" else torchrun_command
    code, out, elapsed = launch(command(WORKER, face, "mismatch"), 60.0)
    assert code != 0, out
    assert mismatch in out, out
    assert elapsed < 60.0, (elapsed, out)


@pytest.mark.parametrize("face", ["sso", "vi"])
def test_ranks_disagreeing_on_trainable_parameters_raise(face: str) -> None:
    """One rank freezes a layer after construction: the gradient buffers differ in size, which MPI
    reduced without an error (every step then skipped silently); now every rank raises, naming it."""
    code, out, elapsed = launch(mpiexec_command(WORKER, face, "freeze"), 60.0)
    assert code != 0, out
    assert "rank 0 averages gradients of 4 trainable parameters" in out, out
    assert "rank 1 averages gradients of 2 trainable parameters" in out, out
    assert elapsed < 60.0, (elapsed, out)


def test_mpi_job_without_failure_ends_normally() -> None:
    """The fault handlers (exit notices at exit, polled collectives) leave a normal run alone."""
    code, out, _ = launch(mpiexec_command(WORKER, "vi", "ok"), 120.0)
    assert code == 0, out
    assert "rank 0 done" in out and "rank 1 done" in out, out


BRANCH_WORKER = str(Path(__file__).parent / "dist_scripts" / "branch_worker.py")


@pytest.mark.parametrize("launcher", ["mpi", "torchrun"])
@pytest.mark.parametrize("face,mode", [("sso", "split"), ("vi", "split"), ("sso", "both")])
def test_ranks_taking_different_branches_equal_one_process(launcher: str, face: str, mode: str) -> None:
    """A parameter with a gradient on some ranks only is averaged with zeros from the others (as
    DistributedDataParallel does): 2 ranks equal one process on both shards; before, the gradient
    lists of the ranks were paired by position (head a's with head b's)."""
    cmd = mpiexec_command(BRANCH_WORKER, face, mode) if launcher == "mpi" else torchrun_command(BRANCH_WORKER, face, mode)
    code, out, _ = launch(cmd, 120.0)
    assert code == 0, out
    assert_replicas_equal_one_process(out)


NAN_LOSS_ON_ONE_RANK = '''
import sys
import torch, torch.nn.functional as F
from torch import nn
from torchsso2 import NonFiniteError, SecondOrderOptimizer
from torchsso2.distributed import get_communicator, shutdown
comm = get_communicator("torch")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
as_float = sys.argv[1] == "float"  # the closure returns loss.item(); the non-finite policy skips
opt = SecondOrderOptimizer(model, lr=0.1, on_nonfinite="skip" if as_float else "raise", seed=0)
x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

def closure():  # rank 1 returns a NaN loss (its gradients are finite)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    loss = loss * (float("nan") if comm.rank == 1 else 1.0)
    return loss.item() if as_float else loss

try:
    for _ in range(2):
        opt.step(closure)
    print(f"rank {comm.rank} stepped, skipped {opt.num_skipped}, first weight {model[0].weight[0, 0].item()!r}",
          flush=True)
except NonFiniteError as err:
    print(f"rank {comm.rank} raised: {err}", flush=True)
shutdown()
'''


def test_a_nonfinite_loss_on_one_rank_is_named_on_the_others(tmp_path) -> None:
    """``on_nonfinite="raise"``, a NaN loss on rank 1 only: both ranks raise, and rank 0's message says the
    value came from another rank (its own were finite; it had said only "non-finite loss ... at step 0")."""
    from dist_utils import torchrun_script
    code, out = torchrun_script(tmp_path, "nan_loss.py", NAN_LOSS_ON_ONE_RANK, "tensor")
    assert code == 0, out[-3000:]
    assert "rank 1 raised: non-finite loss, gradient or curvature at step 0 (the loss (nan));" in out, out[-3000:]
    assert "rank 0 raised: non-finite loss, gradient or curvature at step 0 (another rank's loss or batch" in out, \
        out[-3000:]


def test_a_nonfinite_float_loss_on_one_rank_is_skipped_on_every_rank(tmp_path) -> None:
    """A closure returning ``loss.item()``, NaN on rank 1 only: both ranks skip both steps and keep equal
    weights (the float was not flagged in the step's all-reduce: rank 1 skipped alone, and gloo aborted on the
    next collective)."""
    from dist_utils import torchrun_script
    code, out = torchrun_script(tmp_path, "nan_float_loss.py", NAN_LOSS_ON_ONE_RANK, "float")
    assert code == 0, out[-3000:]
    lines = [line for line in out.splitlines() if "stepped, skipped" in line]
    assert len(lines) == 2 and all("skipped 2," in line for line in lines), out[-3000:]
    assert lines[0].split("first weight")[1] == lines[1].split("first weight")[1], lines
