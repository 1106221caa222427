"""Checkpoints across module wrappers (saved under DistributedDataParallel or torch.compile, loaded
into the bare model, and the reverse), and the warning about a user-created process group whose
timeout outlives the communicator's."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import REPO, torchrun_script
from torchsso2 import SecondOrderOptimizer

DDP_ROUNDTRIP = textwrap.dedent("""
    import logging, os, sys
    from datetime import timedelta
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torch import nn
    from torchsso2 import SecondOrderOptimizer, VIOptimizer
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=int(sys.argv[2])))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    for face in ("soo", "vi"):
        def build(wrapped):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
            net = nn.parallel.DistributedDataParallel(model) if wrapped else model
            opt = SecondOrderOptimizer(net) if face == "soo" else VIOptimizer(net, dataset_size=64)
            return net, opt
        def closure_of(net, opt):
            def closure():
                opt.zero_grad(); out = net(x); loss = F.cross_entropy(out, y); loss.backward(); return loss, out
            return closure
        for saved_wrapped in (True, False):
            net, opt = build(saved_wrapped)
            for _ in range(2):
                opt.step(closure_of(net, opt))
            sd = opt.state_dict()
            opt.step(closure_of(net, opt))
            net2, opt2 = build(not saved_wrapped)
            torch.manual_seed(1)
            opt2.load_state_dict(sd)
            print(face, "ddp" if saved_wrapped else "bare", "->", "bare" if saved_wrapped else "ddp", "loaded",
                  opt2.num_steps, sorted(opt2.running.blocks))
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("group_timeout", [1800, 60])
def test_checkpoints_load_across_ddp_and_the_group_timeout_warning(tmp_path, group_timeout: int) -> None:
    """One rank: the checkpoints load either way, and no timeout warning (no other rank can hang;
    two ranks below)."""
    script = tmp_path / "roundtrip.py"
    script.write_text(DDP_ROUNDTRIP)
    port = str(29600 + group_timeout % 97)
    proc = subprocess.run([sys.executable, str(script), port, str(group_timeout)], cwd=REPO, capture_output=True,
                          text=True, timeout=240, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                                       "PYTHONPATH": str(REPO)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for line in ("soo ddp -> bare loaded 2 ['0', '2']", "soo bare -> ddp loaded 2 ['module.0', 'module.2']",
                 "vi ddp -> bare loaded 2", "vi bare -> ddp loaded 2"):
        assert line in out, out
    assert "is longer than the communicator's" not in out, out


GROUP_TIMEOUT = textwrap.dedent("""
    import logging, sys
    from datetime import timedelta
    import torch.distributed as dist
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(sys.argv[1])))
    from torchsso2.distributed import TorchCommunicator
    TorchCommunicator()
    print(f"built on rank {dist.get_rank()}", flush=True)  # one write: unbuffered ranks interleave print's parts
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("group_timeout,warned", [(1800, True), (60, False)])
def test_two_ranks_warn_about_a_group_timeout_longer_than_the_communicators(tmp_path, group_timeout: int,
                                                                            warned: bool) -> None:
    code, out = torchrun_script(tmp_path, "timeout.py", GROUP_TIMEOUT, str(group_timeout))
    assert code == 0, out
    assert "built on rank 0" in out and "built on rank 1" in out, out
    # rank 0 says it, once per communicator (before, every rank did)
    assert out.count("the process group's timeout (1800 s) is longer than the communicator's (60 s)") == int(warned), out


@pytest.mark.parametrize("saved_compiled", [True, False])
def test_checkpoints_load_between_a_compiled_and_the_plain_model(saved_compiled: bool) -> None:
    def build(compiled: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        net = torch.compile(model, backend="eager") if compiled else model
        return net, SecondOrderOptimizer(net)

    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))

    def run(net, opt, steps):
        def closure():
            opt.zero_grad()
            out = net(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            return loss, out
        for _ in range(steps):
            opt.step(closure)

    torch._dynamo.reset()
    net, opt = build(saved_compiled)
    run(net, opt, 2)
    sd = opt.state_dict()
    torch._dynamo.reset()
    net2, opt2 = build(not saved_compiled)
    opt2.load_state_dict(sd)
    assert opt2.num_steps == 2
    mine = sorted(opt2.running.blocks)
    assert mine == (["0", "2"] if saved_compiled else ["_orig_mod.0", "_orig_mod.2"])
    for name in mine:
        theirs = name.replace("_orig_mod.", "") if not saved_compiled else "_orig_mod." + name
        for a, b in zip(opt2.running.blocks[name].tensors(), opt.running.blocks[theirs].tensors()):
            assert torch.equal(a, b)
    torch._dynamo.reset()


LOW_PRECISION = textwrap.dedent("""
    import os, sys
    import torch, torch.nn.functional as F
    from torch import nn
    from torchsso2 import SecondOrderOptimizer
    from torchsso2.distributed import get_communicator, shutdown
    comm = get_communicator("torch")
    torch.manual_seed(0)
    dtype = getattr(torch, sys.argv[1])
    model = nn.Sequential(nn.Linear(189, 1)).to(dtype)  # 190 numbers: bfloat16 rounds a sum of 3 of them
    opt = SecondOrderOptimizer(model, approx="diag", curvature="empirical_fisher", loss="mse", communicator=comm)
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(8, 189, generator=g).to(dtype), torch.randn(8, 1, generator=g).to(dtype)
    def closure():
        opt.zero_grad(); out = model(x); loss = F.mse_loss(out.float(), y.float()); loss.backward(); return loss, out
    for _ in range(2):
        opt.step(closure)
    print(f"rank {comm.rank} stepped {opt.num_steps}", flush=True)
    shutdown()
""")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_rank_agreement_flag_holds_in_low_precision_on_three_ranks(tmp_path, dtype: str) -> None:
    """The flag's parameter count and size are all-reduced in the gradients' dtype: identical ranks must
    agree (bfloat16 rounded a 3-rank sum of 190 and every rank raised)."""
    code, out = torchrun_script(tmp_path, "flag.py", LOW_PRECISION, dtype, ranks=3)
    assert code == 0, out[-3000:]
    assert all(f"rank {r} stepped 2" in out for r in range(3)), out[-3000:]


SPARSE_TWO_RANKS = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from torch import nn
    from torchsso2 import SecondOrderOptimizer
    from torchsso2.distributed import get_communicator, shutdown
    comm = get_communicator("torch")

    class Table(nn.Module):
        def __init__(self):
            super().__init__(); self.w = nn.Parameter(torch.randn(10, 4))
        def forward(self, ids):
            return F.embedding(ids, self.w, sparse=True)

    torch.manual_seed(0)
    model = nn.Sequential(Table(), nn.Flatten(), nn.Linear(12, 3))
    opt = SecondOrderOptimizer(model, skip_modules=["^0$"], communicator=comm)
    ids, y = torch.randint(0, 10, (6, 3)), torch.randint(0, 3, (6,))
    def closure():
        opt.zero_grad(); out = model(ids); loss = F.cross_entropy(out, y); loss.backward(); return loss, out
    try:
        opt.step(closure)
    except TypeError as e:
        print(f"rank {comm.rank} TypeError: {e}", flush=True)
    shutdown()
""")


def test_a_sparse_gradient_is_refused_before_the_all_reduce(tmp_path) -> None:
    _, out = torchrun_script(tmp_path, "sparse.py", SPARSE_TWO_RANKS)
    for r in range(2):
        assert f"rank {r} TypeError: a torch.sparse_coo tensor" in out, out[-3000:]
