"""An optimizer built on the bare model whose closure runs it inside DistributedDataParallel (``model =
DDP(model)`` after building the optimizer, Lightning's DDP strategy) averaged the gradients again after
DDP had: the same values, one more all-reduce of every gradient per step. Now the step skips it when a
DDP wrapper averaged every closure call's gradients and the ranks' gradient fingerprints agree
(torchsso2/optim/ddp_sync.py), and keeps it otherwise. Two gloo ranks under torchrun: the parameters
equal those of the same run with the check switched off (the old path) and of the optimizer built on
the DDP wrapper, bit for bit; the gradients' all-reduce is gone only where DDP averaged them."""
from __future__ import annotations

import re
import textwrap

from dist_utils import torchrun_script

SCRIPT = textwrap.dedent("""
    import contextlib
    import torch, torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchsso2 import SecondOrderOptimizer, VIOptimizer
    from torchsso2.distributed import get_communicator, shutdown

    comm = get_communicator("torch")
    g = torch.Generator().manual_seed(10 + comm.rank)  # each rank its own shard
    batches = [(torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(5)]

    def make(face, model):
        if face == "kfac":
            return SecondOrderOptimizer(model, lr=0.1, seed=0, curv_update_interval=2, inv_update_interval=2)
        if face == "adaptive":
            return SecondOrderOptimizer(model, seed=0, use_adaptive_learning_rate=True, use_adaptive_momentum=True,
                                        adaptive_damping=True)
        return VIOptimizer(model, dataset_size=64, lr=0.05, seed=0, num_mc_samples=2 if face == "vi-2" else 1)

    def run(face, mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
        if mode == "built-on-ddp":
            net = DDP(model)
            opt = make(face, net)
        else:
            opt = make(face, model)
            net = model if mode == "bare" else DDP(model)
        if mode.endswith("check-off"):
            opt._ddp_sync = None  # the path before: the optimizer averages the gradients itself
        calls, sizes, original = [], [], opt.comm.allreduce
        def counting(tensors, *args, **kwargs):  # whether the call carries the gradients, and its bytes
            grads = {id(p.grad) for p in model.parameters() if p.grad is not None}
            calls.append(any(id(t) in grads for t in tensors))
            sizes.append(sum(t.numel() * t.element_size() for t in tensors))
            return original(tensors, *args, **kwargs)
        firsts = []  # the bytes of each step's first all-reduce (the flag, when DDP averaged the gradients)
        opt.comm.allreduce = counting
        for x, y in batches:
            def closure():
                opt.zero_grad()
                with net.no_sync() if mode == "no_sync" else contextlib.nullcontext():
                    out = net(x)
                    loss = F.cross_entropy(out, y)
                    loss.backward()
                if mode.startswith("changed-after"):  # a rank-dependent change after DDP's average
                    model[0].bias.grad.add_(0.01 * comm.rank)
                if mode.startswith("sign-flip") and comm.rank == 1:  # the same norms, another gradient
                    model[0].weight.grad[0, 0].neg_()
                if mode.startswith("bare-pass"):  # a second pass of the bare model: gradients DDP never saw
                    (1e-3 * model(x + 1).pow(2).mean()).backward()
                return loss, out
            mark = len(calls)
            opt.step(closure)
            firsts.append(sizes[mark])
        grads_reduced = sum(calls)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), grads_reduced, sorted(set(firsts))

    for face in ("kfac", "vi", "vi-2", "adaptive"):
        res = {m: run(face, m) for m in ("ddp", "check-off", "built-on-ddp", "no_sync", "changed-after", "bare",
                                         "changed-after-check-off", "sign-flip", "sign-flip-check-off", "bare-pass",
                                         "bare-pass-check-off")}
        gathered = [torch.zeros_like(res["ddp"][0]) for _ in range(2)]
        torch.distributed.all_gather(gathered, res["ddp"][0])
        line = (f"rank {comm.rank} {face}: "
                f"ddp=check-off {torch.equal(res['ddp'][0], res['check-off'][0])} "
                f"ddp=built-on-ddp {torch.equal(res['ddp'][0], res['built-on-ddp'][0])} "
                f"ranks-equal {torch.equal(*gathered)} "
                + " ".join(f"{m}=check-off {torch.equal(res[m][0], res[m + '-check-off'][0])}"
                           for m in ("changed-after", "sign-flip", "bare-pass")) + " "
                + " ".join(f"{m}:{res[m][1]}" for m in res)
                + f" ddp-flag:{res['ddp'][2]} built-on-ddp-flag:{res['built-on-ddp'][2]}")
        lines = [None, None]
        torch.distributed.all_gather_object(lines, line)  # printed by one rank: the ranks' output interleaves
        if comm.rank == 0:
            for text in lines:
                print(text, flush=True)
    shutdown()
""")


def test_ddp_averaged_gradients_are_not_averaged_again(tmp_path) -> None:
    code, out = torchrun_script(tmp_path, "ddp_sync.py", SCRIPT, timeout=400)
    assert code == 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(lines) == 8, out[-3000:]
    for line in lines:
        face = line.split()[2].rstrip(":")
        assert "ddp=check-off True" in line and "ranks-equal True" in line, line
        # gradients that differ between the ranks after DDP's average: averaged as before, equal to the old path
        for m in ("changed-after", "sign-flip", "bare-pass"):
            assert f"{m}=check-off True" in line, line
        if face != "adaptive":  # adaptive's products on a DDP-built model go through dual numbers (other rounding)
            assert "ddp=built-on-ddp True" in line, line
        # 5 steps: DDP averaged every one (no gradient all-reduce of ours); the old path averaged each again;
        # outside DDP (no_sync, a bare model) and where the ranks' gradients differ after DDP, ours runs
        assert " ddp:0 check-off:5 built-on-ddp:0 no_sync:5 changed-after:5 bare:5" in line, line
        assert " sign-flip:5 " in line and " bare-pass:5 " in line, line
        # docs/scaling.md, bytes per step: where DDP averaged the gradients, the flag alone, 8·(3 + B + W) bytes per
        # rank (float64: the flag, two settings digests, at a curvature step one slot per covered module (B = 2) for
        # which ones this rank called, one fingerprint slot per rank), built on either model
        flags = re.search(r" ddp-flag:(\[[0-9, ]*\]) built-on-ddp-flag:(\[[0-9, ]*\])", line)
        assert flags is not None and flags.group(1) == flags.group(2), line
        sizes = {int(v) for v in flags.group(1).strip("[]").split(",")}  # kfac estimates every other step
        assert sizes <= {8 * (3 + 2), 8 * (3 + 2 + 2)} and 8 * (3 + 2 + 2) in sizes, line


RAISING = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchsso2 import SecondOrderOptimizer
    from torchsso2.distributed import get_communicator, shutdown

    comm = get_communicator("torch")
    g = torch.Generator().manual_seed(3 + comm.rank)
    for check in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
        opt = SecondOrderOptimizer(model, lr=0.1, seed=0)
        if not check:
            opt._ddp_sync = None
        net = DDP(model)
        steps, i = 0, 0
        while steps < 4:  # rank 0's closure raises once (a bad batch it catches): it takes one more batch
            x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
            def closure():
                opt.zero_grad()
                if comm.rank == 0 and i == 1:
                    raise ValueError("bad batch")
                loss = F.cross_entropy(net(x), y)
                loss.backward()
                return loss
            i += 1
            try:
                opt.step(closure)
                steps += 1
            except ValueError:
                pass
        p = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
        both = [torch.zeros_like(p) for _ in range(2)]
        torch.distributed.all_gather(both, p)
        if comm.rank == 0:
            print(f"check {check}: ranks-equal {torch.equal(*both)}", flush=True)
    shutdown()
""")


def test_a_closure_that_raised_on_one_rank_leaves_no_verdict_for_the_next_step(tmp_path) -> None:
    """A closure that raised on rank 0 only (the user catches the bad batch and goes on) left that rank's
    verdict "not averaged by DDP" for its next step, whose collectives then differed from rank 1's: gloo
    aborted on a collective mismatch. The verdict is reset at every step, and a raising call leaves none."""
    code, out = torchrun_script(tmp_path, "raising.py", RAISING, timeout=300)
    assert code == 0, out[-3000:]
    assert "check True: ranks-equal True" in out and "check False: ranks-equal True" in out, out[-3000:]


UNSYNCED = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchsso2 import SecondOrderOptimizer, VIOptimizer
    from torchsso2.distributed import get_communicator, shutdown

    comm = get_communicator("torch")
    g = torch.Generator().manual_seed(20 + comm.rank)
    batches = [(torch.randn(10, 5, generator=g), torch.randint(0, 2, (10,), generator=g)) for _ in range(4)]
    out = []
    for face in ("sso", "vi"):
        params = []
        for built_on in ("ddp", "bare"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
            model[0].requires_grad_(False)
            net = DDP(model)  # DDP registers the trainable parameters only: layer 0 is never synced by it
            model[0].requires_grad_(True)
            target = net if built_on == "ddp" else model
            opt = SecondOrderOptimizer(target, seed=1) if face == "sso" else VIOptimizer(target, 64, seed=1)
            for x, y in batches:
                def closure():
                    opt.zero_grad()
                    loss = F.cross_entropy(net(x), y)
                    loss.backward()
                    return loss
                opt.step(closure)
            params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        gathered = [torch.zeros_like(params[0]) for _ in range(2)]
        torch.distributed.all_gather(gathered, params[0])
        out.append(f"{face}: ranks-equal {torch.equal(*gathered)} ddp=bare {torch.equal(params[0], params[1])}")
    lines = [None, None]
    torch.distributed.all_gather_object(lines, " | ".join(out))
    if comm.rank == 0:
        for text in lines:
            print("RESULT", text, flush=True)
    shutdown()
""")


def test_an_optimizer_built_on_ddp_averages_what_ddp_does_not_sync(tmp_path) -> None:
    """A layer frozen when DDP was built and trainable when the optimizer was (as the optimizer's own
    frozen-layer warning advises) is not in DDP's reducer: built on the DDP module, the optimizer trusted
    DDP and never averaged it, and the replicas drifted apart (0.086 after 3 steps). The per-step check
    (ddp_sync.py) now runs for it too: its gradient is averaged, as the optimizer built on the bare model does."""
    code, out = torchrun_script(tmp_path, "ddp_unsynced.py", UNSYNCED, timeout=300)
    assert code == 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("RESULT")]
    assert len(lines) == 2, out[-3000:]
    for line in lines:
        assert line.count("ranks-equal True") == 2 and line.count("ddp=bare True") == 2, line


SAMPLE_GROUPS = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchsso2 import VIOptimizer
    from torchsso2.distributed import get_communicator, shutdown

    comm = get_communicator("torch")
    x, y = torch.randn(12, 5, generator=torch.Generator().manual_seed(1)), torch.randn(12, 1)
    for curvature in (None, "fisher"):  # None: the diagonal's default, "reparam"
        for mode in ("bare", "built-on-ddp", "closure-in-ddp", "ddp-and-bare-pass", "second-sample-in-ddp"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1))
            net = DDP(model) if mode != "bare" else model
            opt = VIOptimizer(net if mode == "built-on-ddp" else model, dataset_size=120, lr=0.1, loss="mse",
                              seed=5, approx="diag", curvature=curvature, mc_parallel=2,
                              num_mc_samples=4 if mode == "second-sample-in-ddp" else 2)
            before = [p.detach().clone() for p in model.parameters()]
            calls = []

            def closure():
                opt.zero_grad()
                calls.append(1)
                # the first sample of this rank's two bare, the second through DDP
                out = (model if mode == "second-sample-in-ddp" and len(calls) == 1 else net)(x)
                loss = 0.5 * (out - y).pow(2).mean()
                if mode == "ddp-and-bare-pass":  # an extra term from a pass DDP does not see
                    loss = loss + 1e-3 * model(x + 1).pow(2).mean()
                loss.backward()
                return loss, out
            try:
                opt.step(closure)
                outcome = "stepped"
            except ValueError as err:
                same = all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and opt.num_steps == 0
                outcome = "refused-unchanged" if same else "refused-changed"
                if "pair each group's gradient with its own weight sample" not in str(err):
                    outcome = "other error: " + str(err)
            print(f"rank {comm.rank} {curvature or 'reparam'} {mode}: {outcome}", flush=True)
    shutdown()
""")


def test_reparam_sample_groups_refuse_gradients_ddp_averaged_across_the_groups(tmp_path) -> None:
    """VIOptimizer's default diagonal with mc_parallel > 1: DDP averages the gradients over all ranks, across
    the sample groups, so no group's ĥ = g ⊙ ε/s² can pair its gradient with its ε (the probe: 1.4e-3 off one
    process with both samples at the first step, 7.7e-2 after 5). A ValueError on every rank, the optimizer
    unchanged, also where only some of the step's forwards (a bare second pass in the closure) or samples (the
    second of a rank's two) ran inside DDP; without DDP, and with a kind that does not read the gradient, it
    steps."""
    code, out = torchrun_script(tmp_path, "sample_groups.py", SAMPLE_GROUPS, timeout=300)
    assert code == 0, out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} reparam bare: stepped" in out, out[-3000:]
        for mode in ("built-on-ddp", "closure-in-ddp", "ddp-and-bare-pass", "second-sample-in-ddp"):
            assert f"rank {rank} reparam {mode}: refused-unchanged" in out, out[-3000:]
        for mode in ("bare", "built-on-ddp", "closure-in-ddp", "ddp-and-bare-pass", "second-sample-in-ddp"):
            assert f"rank {rank} fisher {mode}: stepped" in out, out[-3000:]
