"""KAISA strategies of torchsso2's ``KFACPreconditioner`` on a small ResNet: time, memory, traffic.

For each world size (``--world-sizes``, default ``1,2``: gloo ranks spawned with
``torch.multiprocessing`` on this machine) and each grad-worker strategy (``COMM_OPT``,
``HYBRID_OPT``, ``MEM_OPT``) it measures, on a CIFAR-stem ResNet (examples/resnet.py) and
synthetic data:

* **step time** (min, median and mean over the timed steps) of ``zero_grad + forward + backward
  (DDP all-reduce) + preconditioner.step() + SGD step``; a step's time is the slowest rank's;
* **overhead vs plain SGD** (the same DDP model without the preconditioner, same run): the
  ratio of means and the extra milliseconds per step (the mean over whole inverse-update cycles
  includes the decomposition steps, which the median leaves out);
* **K-FAC memory**: ``preconditioner.memory_usage()["total"]`` (factors, batches and
  decompositions), largest over ranks;
* **bytes sent per step** by the preconditioner's communicator (``preconditioner.comm.bytes_sent``:
  factor all-reduces, decomposition and gradient broadcasts; the logical payload, see
  :mod:`torchsso2.distributed.communicator`), largest over ranks. DDP's gradient all-reduce is
  not included (it is the same for all strategies and for SGD).

The timed window is a whole number of inverse-update cycles (``--inv-update-steps``), so
every strategy's time includes its share of the decompositions.

Examples::

    python benchmarks/kaisa.py                       # writes benchmarks/results/kaisa.json
    python benchmarks/kaisa.py --quick               # smoke run (no file unless --json is given)
    python benchmarks/kaisa.py --world-sizes 1,2,4 --width 32 --json /tmp/k.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as ``python benchmarks/kaisa.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import load_average, machine_info, markdown_table, summarize, write_json
from examples.common import nonnegative_int, positive_int  # noqa: E402

STRATEGIES = ("COMM_OPT", "HYBRID_OPT", "MEM_OPT")
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "kaisa.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg: Dict[str, Any], out_path: str) -> None:
    """One gloo rank: SGD baseline, then each strategy; rank 0 writes the results to ``out_path``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from examples.resnet import ResNet
    from torchsso2.distributed import get_communicator
    from torchsso2.distributed.faults import resolve_timeout
    from torchsso2.kfac import DistributedStrategy, KFACPreconditioner

    torch.set_num_threads(cfg["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # the communicator's timeout for the group's too (a longer one is warned about: a lost rank would hang that long)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=resolve_timeout()))
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of a global batch
    size, classes = cfg["image_size"], cfg["num_classes"]
    x = torch.randn(cfg["batch_size"], 3, size, size, generator=g)
    y = torch.randint(classes, (cfg["batch_size"],), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()
    depths = tuple(cfg["depths"])

    def measure(strategy: Optional[str]) -> Dict[str, Any]:
        torch.manual_seed(0)
        model = DistributedDataParallel(ResNet(depths, cfg["width"], classes, "cifar"))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        pre = None
        if strategy is not None:
            pre = KFACPreconditioner(model, factor_update_steps=cfg["factor_update_steps"],
                                     inv_update_steps=cfg["inv_update_steps"], damping=0.003, lr=0.01,
                                     grad_worker_fraction=DistributedStrategy[strategy],
                                     communicator=get_communicator("torch"))

        def step() -> float:
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            if pre is not None:
                pre.step()
            opt.step()
            return time.perf_counter() - start

        for _ in range(cfg["warmup"]):
            step()
        dist.barrier()
        if pre is not None:
            pre.comm.reset_counters()
        times = torch.tensor([step() for _ in range(cfg["steps"])], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
        # min / median describe a typical step; the mean over the window (whole inverse-update cycles)
        # is the time per step with the decompositions' share, the basis of the overhead
        row: Dict[str, Any] = {"strategy": strategy or "SGD", **summarize(times.tolist()),
                               "mean_s": float(times.mean())}
        if pre is not None:
            stats = torch.tensor([pre.memory_usage()["total"], pre.comm.bytes_sent / cfg["steps"]],
                                 dtype=torch.float64)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            row.update(distributed_strategy=pre.distributed_strategy.name,
                       grad_worker_fraction=float(pre.grad_worker_fraction),
                       memory_bytes=int(stats[0]), bytes_sent_per_step=float(stats[1]))
            pre.remove_hooks()
        return row

    rows = [measure(None)] + [measure(s) for s in cfg["strategies"]]
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows), encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Spawn ``world`` gloo ranks and return rank 0's rows (SGD first)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(world, _free_port(), cfg, out), nprocs=world, join=True)
        rows = json.loads(Path(out).read_text(encoding="utf-8"))
    sgd = rows[0]["mean_s"]
    for row in rows:
        row["world_size"] = world
        row["overhead_x"] = row["mean_s"] / sgd
        row["overhead_ms"] = (row["mean_s"] - sgd) * 1e3
    return rows


def table(rows: Sequence[Dict[str, Any]]) -> str:
    out = []
    for r in rows:
        kfac = r["strategy"] != "SGD"
        out.append([r["world_size"], r["strategy"] + (f" ({r['distributed_strategy']})" if kfac and
                                                       r["distributed_strategy"] != r["strategy"] else ""),
                    f"{r['min_s'] * 1e3:.1f}", f"{r['median_s'] * 1e3:.1f}", f"{r['mean_s'] * 1e3:.1f}",
                    f"{r['overhead_x']:.2f}x" if kfac else "", f"{r['overhead_ms']:+.1f}" if kfac else "",
                    f"{r['memory_bytes'] / 2**20:.2f}" if kfac else "",
                    f"{r['bytes_sent_per_step'] / 2**10:.1f}" if kfac else ""])
    return markdown_table(["ranks", "strategy", "step min (ms)", "step median (ms)", "step mean (ms)",
                           "vs SGD (mean)", "extra ms/step (mean)", "K-FAC memory (MiB, max rank)",
                           "K-FAC sent/step (KiB, max rank)"], out, align="rlrrrrrrr")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/kaisa.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model and few steps (smoke run)")
    p.add_argument("--json", type=Path, default=None,
                   help=f"report path (default {DEFAULT_JSON.relative_to(DEFAULT_JSON.parents[2])}; "
                        "--quick writes no file unless given)")
    p.add_argument("--world-sizes", type=str, default="1,2", help="comma-separated numbers of ranks")
    p.add_argument("--strategies", type=str, default=",".join(STRATEGIES), help='comma-separated KAISA grad_worker_fraction strategies (default: all of them)')
    p.add_argument("--width", type=positive_int, default=None, help="ResNet base width (default 16; quick 4)")
    p.add_argument("--depths", type=str, default=None, help="blocks per stage (default 2,2,2,2; quick 1,1,1,1)")
    p.add_argument("--image-size", type=positive_int, default=None, help="default 32; quick 16")
    p.add_argument("--num-classes", type=positive_int, default=10, help='classes of the synthetic ResNet task (default 10)')
    p.add_argument("--batch-size", type=positive_int, default=None, help="per rank (default 32; quick 8)")
    p.add_argument("--factor-update-steps", type=positive_int, default=1, help='K-FAC factor update interval (default 1)')
    p.add_argument("--inv-update-steps", type=positive_int, default=None, help="default 10; quick 2")
    p.add_argument("--steps", type=positive_int, default=None, help="timed steps (default 20; quick 4)")
    p.add_argument("--warmup", type=nonnegative_int, default=None, help="untimed steps (default 2; quick 1)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    q = args.quick
    pick = lambda v, default, quick: v if v is not None else (quick if q else default)  # noqa: E731
    cfg = dict(width=pick(args.width, 16, 4),
               depths=[int(d) for d in pick(args.depths, "2,2,2,2", "1,1,1,1").split(",")],
               image_size=pick(args.image_size, 32, 16), num_classes=args.num_classes,
               batch_size=pick(args.batch_size, 32, 8), factor_update_steps=args.factor_update_steps,
               inv_update_steps=pick(args.inv_update_steps, 10, 2), steps=pick(args.steps, 20, 4),
               warmup=pick(args.warmup, 2, 1), threads=args.threads,
               strategies=[s.strip().upper().replace("-", "_") for s in args.strategies.split(",") if s.strip()])
    bad = [s for s in cfg["strategies"] if s not in STRATEGIES]
    if bad:
        raise SystemExit(f"unknown strategies {bad}; expected {', '.join(STRATEGIES)}")
    try:
        worlds = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    except ValueError:
        worlds = []
    if not worlds or min(worlds) < 1:
        raise SystemExit(f"--world-sizes must be positive integers, got {args.world_sizes!r}")
    start = time.perf_counter()
    rows: List[Dict[str, Any]] = []
    for world in worlds:
        rows += run_world(world, cfg)
    print(f"KAISA strategies, ResNet width={cfg['width']} depths={cfg['depths']} {cfg['image_size']}px, "
          f"batch {cfg['batch_size']}/rank, factor/inv update every {cfg['factor_update_steps']}/"
          f"{cfg['inv_update_steps']} steps, {cfg['steps']} timed steps, {cfg['threads']} thread(s)/rank")
    print(table(rows))
    path = args.json if args.json is not None else (None if q else DEFAULT_JSON)
    if path is not None:
        write_json(path, {"machine": machine_info(), "load_average": load_average(), "config": cfg,
                          "wall_s": time.perf_counter() - start, "rows": rows, "table": table(rows)})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
