"""Across ranks, each param group's own settings are compared (they were not: a group with another lr
on one rank made the replicas drift apart silently), at construction and at every step (a group added
later with another lr on one rank, a schedule that differs, an attribute such as ``kl_clip`` or ``damping``
set on one rank only: a ValueError on every rank at the next step, also under DistributedDataParallel;
equal settings pass); under DistributedDataParallel a name
regex in ``skip_modules`` / ``approx={...}`` written for the bare model matches (it silently did not)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from dist_utils import REPO, mpi_env, require_mpiexec, torchrun_script

GROUPS = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from torch import nn
    from torchsso2 import SecondOrderOptimizer, VIOptimizer
    from torchsso2.distributed import get_communicator, shutdown
    comm = get_communicator("torch")
    for make in ("sso", "vi"):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        ps = list(m.parameters())
        first = dict(params=ps[:2], lr=0.05 if comm.rank == 0 else 0.5)
        try:
            if make == "sso":
                SecondOrderOptimizer(m, params=[first, {"params": ps[2:]}], lr=0.1)
            else:
                VIOptimizer(m, dataset_size=10, params=[first, {"params": ps[2:]}], lr=0.1)
            print(f"rank {comm.rank} {make} built", flush=True)
        except ValueError as err:
            print(f"rank {comm.rank} {make} refused: {err}", flush=True)
    shutdown()
""")


def _torchrun_two_ranks(tmp_path, name: str, text: str) -> str:  # noqa: ANN001
    """Run ``text`` as a script on 2 gloo ranks under torchrun; its output (asserting a clean exit)."""
    code, out = torchrun_script(tmp_path, name, text, timeout=300)
    assert code == 0, out[-3000:]
    return out


def test_param_group_settings_are_compared_across_ranks(tmp_path) -> None:
    out = _torchrun_two_ranks(tmp_path, "groups.py", GROUPS)
    for rank in range(2):
        for make in ("sso", "vi"):
            assert f"rank {rank} {make} refused:" in out, out[-3000:]
    assert "param_groups[0] (rank 0: {lr: 0.05" in out and "rank 1: {lr: 0.5" in out, out[-3000:]


#: the closure of both scripts below: the model, then a side layer outside it (a plain update)
SIDE_CLOSURE = textwrap.dedent("""
    def closure_of(m, side, opt):
        def closure():
            opt.zero_grad()
            out = side(m(x))
            loss = F.cross_entropy(out, y)
            loss.backward()
            return loss, out
        return closure
""")

STEPS = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from torch import nn
    from torchsso2 import SecondOrderOptimizer, VIOptimizer
    from torchsso2.distributed import get_communicator, shutdown
    comm = get_communicator("torch")
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    # SIDE_CLOSURE

    def build(make, extra, ddp=False):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        if ddp:
            m = nn.parallel.DistributedDataParallel(m)
        side = nn.Linear(3, 3)  # outside the model: a plain update in an added group
        if make == "sso":
            opt = SecondOrderOptimizer(m, lr=0.1, **extra)
        else:
            opt = VIOptimizer(m, dataset_size=80, lr=0.1, **extra)
        return m, side, opt

    def set_attrs(opt, make, case):
        # attributes set between steps (after the first, whose decompositions a new damping re-damps)
        other = 1 + comm.rank if case == "attr-differs" else 1
        opt.kl_clip = 1e-3 * other
        if make == "sso":
            opt.damping = 0.1 * other  # K-FAC eigen: a re-damp, whose collective runs at the step
        else:
            opt.prior_precision = 2.0 * other

    for make in ("sso", "vi"):
        for case in ("same", "added", "schedule", "ddp-same", "ddp-added", "attr-same", "attr-differs"):
            m, side, opt = build(make, {}, ddp=case.startswith("ddp"))
            if case in ("same", "ddp-same", "attr-same", "attr-differs"):
                opt.add_param_group({"params": side.parameters(), "lr": 0.01})
            elif case in ("added", "ddp-added"):
                opt.add_param_group({"params": side.parameters(), "lr": 0.01 if comm.rank == 0 else 0.02})
            elif case == "schedule":
                opt.add_param_group({"params": side.parameters(), "lr": 0.01})
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s * (1 + comm.rank)))
            try:
                for step in range(3):
                    if step == 1 and case.startswith("attr"):
                        set_attrs(opt, make, case)
                    opt.step(closure_of(m, side, opt))
                    if case == "schedule":
                        sched.step()
                print(f"rank {comm.rank} {make} {case} stepped", flush=True)
            except ValueError as err:
                print(f"rank {comm.rank} {make} {case} refused: {err}", flush=True)
    shutdown()
""").replace("# SIDE_CLOSURE\n", SIDE_CLOSURE)


def test_param_group_settings_are_compared_at_each_step(tmp_path) -> None:
    out = _torchrun_two_ranks(tmp_path, "steps.py", STEPS)
    for rank in range(2):
        for make in ("sso", "vi"):
            for case in ("same", "ddp-same", "attr-same"):
                assert f"rank {rank} {make} {case} stepped" in out, out[-3000:]
            for case in ("added", "schedule", "ddp-added", "attr-differs"):
                assert f"rank {rank} {make} {case} refused: " in out, out[-3000:]
    assert "settings (lr, momentum, weight_decay, ...) or the attributes set between steps (damping, ema_decay, " \
           "kl_clip) differ between the ranks" in out, out[-3000:]


DDP_NAMES = textwrap.dedent("""
    import os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch import nn
    from torchsso2 import SecondOrderOptimizer
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60))
    m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    ddp = nn.parallel.DistributedDataParallel(m)
    print("skip", sorted(SecondOrderOptimizer(ddp, skip_modules=["^0$"]).engine.layouts))
    print("prefixed", sorted(SecondOrderOptimizer(ddp, skip_modules=[r"^module\\.0$"]).engine.layouts))
    rules = {"^0$": "full", "Linear": "diag"}
    print("approx", {k: v.value for k, v in SecondOrderOptimizer(ddp, approx=rules).engine.approx.items()})
    dist.destroy_process_group()
""")


def test_name_regexes_match_under_ddp(tmp_path) -> None:
    script = tmp_path / "names.py"
    script.write_text(DDP_NAMES)
    proc = subprocess.run([sys.executable, str(script), "29677"], cwd=REPO, capture_output=True, text=True,
                          timeout=240, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "skip ['module.2']" in out and "prefixed ['module.2']" in out, out
    assert "approx {'module.0': 'full', 'module.2': 'diag'}" in out, out


THREE = textwrap.dedent("""
    import sys, logging, warnings
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    import torch, torch.nn.functional as F
    from torch import nn
    import torchsso2.distributed.consistency as consistency
    from torchsso2 import SecondOrderOptimizer
    from torchsso2.distributed import get_communicator, shutdown
    comm = get_communicator("mpi")
    case = sys.argv[1]
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    # SIDE_CLOSURE
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    side = nn.Linear(3, 3, bias=False)
    extra = nn.Parameter(torch.zeros(3, 3), requires_grad=False)  # not in the forward
    opt = SecondOrderOptimizer(m, params=list(m.parameters()) + [side.weight, extra], lr=0.1)
    if case == "sizes" and comm.rank == 1:
        side.weight.requires_grad_(False)  # rank 1 trains one tensor of 9 less, rank 2 one more: the mean is rank 0's
    if case == "sizes" and comm.rank == 2:
        extra.requires_grad_(True)
    if case == "settings":  # each rank another lr, whose first digests average to rank 0's own
        opt.param_groups[0]["lr"] = [0.1, 0.2, 0.3][comm.rank]
        real = consistency._digest
        consistency._digest = lambda text: real(text) if text.startswith("salt:") or not text.startswith("[{") \\
            else [100, 50, 150][comm.rank]
    try:
        opt.step(closure_of(m, side, opt))
        print(f"rank {comm.rank} {case} stepped", flush=True)
    except (ValueError, RuntimeError) as err:  # the check's own error, or another rank's absence (other)
        why = "sizes" if "other numbers or sizes" in str(err) else "settings" if "differ between the ranks" in str(err) \
            else "other"
        print(f"rank {comm.rank} {case} refused: {why}", flush=True)
    shutdown()
""").replace("# SIDE_CLOSURE\n", SIDE_CLOSURE)


@pytest.mark.parametrize("case", ["settings", "sizes"])
def test_three_ranks_whose_mean_equals_one_ranks_values_are_all_refused(tmp_path, case: str) -> None:
    """With three ranks the mean of differing values can equal one rank's own (lr digests 50, 150 around
    100; parameter counts and sizes one tensor below and above): that rank passed the check and the others
    raised (a hang or a crash in the next collective). A second, independent digest (of the settings, of
    the sizes) makes every rank raise."""
    mpiexec = require_mpiexec()
    script = tmp_path / "three.py"
    script.write_text(THREE)
    proc = subprocess.run([mpiexec, "-n", "3", sys.executable, str(script), case], cwd=REPO, capture_output=True,
                          text=True, timeout=240, env=dict(mpi_env(), OMP_NUM_THREADS="1", TORCHSSO2_DIST_TIMEOUT="60"))
    out = proc.stdout + proc.stderr
    for rank in range(3):
        assert f"rank {rank} {case} refused: {case}" in out, out[-3000:]


DAMPING_CHECKPOINT = textwrap.dedent("""
    import copy
    import torch, torch.nn.functional as F
    from torch import nn
    from torchsso2 import SecondOrderOptimizer
    from torchsso2.distributed import get_communicator, shutdown
    comm = get_communicator("torch")
    g = torch.Generator().manual_seed(100 + comm.rank)  # each rank its own batches
    data = [(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(5)]

    def build(model=None):
        torch.manual_seed(0)
        model = model if model is not None else nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        return model, SecondOrderOptimizer(model, approx="kfac", curvature="fisher", lr=0.1, damping=1e-2,
                                           inv_update_interval=3)

    def run(model, opt, steps):
        for s in steps:
            x, y = data[s]
            def closure():
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss
            opt.step(closure)

    model, opt = build()  # uninterrupted: the damping set after the first step (its eigenbases re-damped in place)
    run(model, opt, [0])
    opt.damping = 0.5
    saved = copy.deepcopy(opt.state_dict())  # saved between the setting and the step that takes it
    copied = copy.deepcopy(model)
    run(model, opt, range(1, 5))
    resumed, opt2 = build(copied)
    opt2.load_state_dict(saved)
    assert opt2.damping == 0.5
    run(resumed, opt2, range(1, 5))
    diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), resumed.parameters()))
    print(f"rank {comm.rank} resumed diff {diff!r}", flush=True)
    shutdown()
""")


def test_a_damping_set_between_steps_resumes_exactly_from_a_checkpoint(tmp_path) -> None:
    """With several processes ``opt.damping = x`` is taken at the next step (after the ranks agree on it); a
    checkpoint saved in between keeps it as a request, so the resumed run re-damps the same eigenbases in place
    and continues bit for bit (it had marked a full re-decomposition, 1.7e-4 off)."""
    out = _torchrun_two_ranks(tmp_path, "damping_ckpt.py", DAMPING_CHECKPOINT)
    for rank in range(2):
        assert f"rank {rank} resumed diff 0.0" in out, out[-3000:]
