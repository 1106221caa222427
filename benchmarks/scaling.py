"""Data-parallel scaling of SecondOrderOptimizer and VIOptimizer: time per step and bytes vs ranks.

Examples::

    python benchmarks/scaling.py --quick                    # spawns 1 and 2 gloo ranks itself
    python benchmarks/scaling.py --ranks 1 2 4 --steps 20   # any N (each rank uses 1 thread)
    torchrun --nproc_per_node=2 benchmarks/scaling.py       # or launched: measures this world only
    mpiexec -n 2 python benchmarks/scaling.py               # (rows are merged into the JSON file)

Strong scaling: a fixed global batch (``--global-batch``) is split into N equal shards, so
N ranks do the work of one process on the whole batch (and give the same result, see
``tests/test_distributed_optim.py``). For each optimizer × shape × placement the table
shows the min and median time per step over ``--steps`` timed steps (after ``--warmup``;
the time of a step is the slowest rank's), the speed-up over one rank (from the min, the
more robust number on a shared machine), and the bytes each rank handed to collectives per step
(``Communicator.bytes_sent``: gradients, curvature statistics, decompositions or
preconditioned gradients, weight noise; see docs/scaling.md for the cost model).
The JSON report goes to ``benchmarks/results/scaling.json`` by default.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from examples.common import make_closure  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import load_average, machine_info, markdown_table, write_json  # noqa: E402

logger = logging.getLogger("benchmarks.scaling")

OPTIMIZERS = ("so", "vi")
SHAPES = ("full", "diag", "kfac")
PLACEMENTS = ("comm_opt", "mem_opt")
#: the settings a row was measured at beyond its key: rows of a saved report measured at others are dropped
SAME_RUN_KEYS = ("global_batch", "width", "steps", "warmup", "threads")
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "scaling.json"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/scaling.py",
        description="Time per step and bytes communicated per step of SecondOrderOptimizer and VIOptimizer "
        "for 1..N data-parallel ranks (strong scaling: fixed global batch). Spawns its own gloo ranks, "
        "or measures the current world when launched under torchrun / mpiexec.")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], metavar="N",
                   help="world sizes to spawn (default 1 2; ignored under torchrun/mpiexec)")
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS,
                   help="so = SecondOrderOptimizer, vi = VIOptimizer")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES, help='curvature shapes (default: all)')
    p.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS + ("hybrid_opt",),
                   help="KAISA grad_worker_fraction (comm_opt: every rank holds every decomposition; "
                   "mem_opt: one rank per block, preconditioned gradients broadcast)")
    p.add_argument("--global-batch", type=int, default=None, help="examples per step over all ranks (default 256; --quick 64)")
    p.add_argument("--width", type=int, default=None,
                   help="hidden width of the diag/kfac MLP 64-W-W-10 (default 256; --quick 64); "
                   "the full-shape MLP is 16-W/8-10")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --quick 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--quick", action="store_true", help="small model and few steps (a smoke run)")
    p.add_argument("--json", type=Path, default=None,
                   help=f"JSON report (default {DEFAULT_JSON}; with --quick none unless given: a smoke run "
                   "does not replace the published rows)")
    p.add_argument("--no-json", action="store_true", help="do not write the JSON report")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a spawned job is killed")
    args = p.parse_args(argv)
    args.global_batch = args.global_batch if args.global_batch is not None else (64 if args.quick else 256)
    args.width = args.width if args.width is not None else (64 if args.quick else 256)
    args.steps = args.steps if args.steps is not None else (4 if args.quick else 10)
    for flag, values in (("--ranks", args.ranks), ("--global-batch", [args.global_batch]), ("--width", [args.width]),
                         ("--steps", [args.steps]), ("--threads", [args.threads])):
        if min(values) < 1:
            p.error(f"{flag} {' '.join(map(str, values))}: expected integers >= 1")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: expected an integer >= 0")
    if args.json is None:
        args.json = DEFAULT_JSON
        args.no_json = args.no_json or args.quick
    return args


def merge_rows(saved: Optional[Dict[str, Any]], rows: List[Dict[str, Any]],
               args: argparse.Namespace) -> List[Dict[str, Any]]:
    """This run's ``rows`` with the rows of a ``saved`` report this run did not measure again (by optimizer,
    shape, placement and ranks), when the report was measured at this run's :data:`SAME_RUN_KEYS`; rows of
    another model, batch or step count are dropped (a merged table would put ranks of different models side
    by side under this run's title and speed-ups)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("rows"), list) or not isinstance(saved.get("config"), dict) \
            or any(saved["config"].get(k) != getattr(args, k) for k in SAME_RUN_KEYS):
        return list(rows)
    key = lambda r: (r["optimizer"], r["shape"], r["placement"], r["ranks"])  # noqa: E731
    mine = {key(r) for r in rows}
    return [r for r in saved["rows"] if key(r) not in mine] + rows


def build(shape: str, width: int) -> nn.Module:
    torch.manual_seed(0)
    if shape == "full":  # a full block is [P, P]: keep P in the hundreds
        w = max(8, width // 8)
        return nn.Sequential(nn.Linear(16, w), nn.ReLU(), nn.Linear(w, 10))
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def measure(comm: Any, args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Every configuration on this rank; returns one row per configuration (rank-local numbers)."""
    from torchsso2.optim import SecondOrderOptimizer, VIOptimizer

    world, rank = comm.world_size, comm.rank
    if args.global_batch % world:
        raise ValueError(f"--global-batch {args.global_batch} must be divisible by the world size {world}")
    local = args.global_batch // world
    rows = []
    for face in args.optimizers:
        for shape in args.shapes:
            for placement in args.placements:
                model = build(shape, args.width)
                d_in = model[0].in_features
                if face == "so":
                    opt = SecondOrderOptimizer(model, lr=1e-3, approx=shape, damping=0.1, kl_clip=1e-3,
                                               communicator=comm, grad_worker_fraction=placement, seed=0)
                else:
                    opt = VIOptimizer(model, dataset_size=10_000, lr=1e-3, approx=shape, prior_precision=1e3,
                                      communicator=comm, grad_worker_fraction=placement, seed=0)
                gen = torch.Generator().manual_seed(1234)
                x_all = torch.randn(args.global_batch, d_in, generator=gen)
                y_all = torch.randint(0, 10, (args.global_batch,), generator=gen)
                x, y = x_all[rank * local:(rank + 1) * local], y_all[rank * local:(rank + 1) * local]

                closure = make_closure(opt, model, x, y)

                times = []
                for step in range(args.warmup + args.steps):
                    if step == args.warmup:
                        comm.reset_counters()
                    comm.barrier()
                    t0 = time.perf_counter()
                    opt.step(closure)
                    times.append(time.perf_counter() - t0)
                timed = times[args.warmup:]
                rows.append(dict(optimizer=face, shape=shape, placement=placement, ranks=world,
                                 global_batch=args.global_batch, params=sum(p.numel() for p in model.parameters()),
                                 median_s=statistics.median(timed), min_s=min(timed),
                                 bytes_per_step=comm.bytes_sent / args.steps, skipped_steps=opt.num_skipped))
                if opt.num_skipped:
                    logger.warning("%s/%s/%s: %d skipped steps make the timing optimistic", face, shape, placement,
                                   opt.num_skipped)
    return rows


def _gather(comm: Any, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rank 0's rows with times = max over ranks and bytes = mean over ranks."""
    if comm.world_size == 1:
        for r in rows:
            r["bytes_per_rank_per_step"] = r.pop("bytes_per_step")
        return rows
    vals = torch.tensor([[r["median_s"], r["min_s"], r["bytes_per_step"]] for r in rows], dtype=torch.float64)
    table = torch.zeros(comm.world_size, *vals.shape, dtype=torch.float64)
    table[comm.rank] = vals
    comm.allreduce([table], op="sum")
    mx = table.max(dim=0).values
    sm = table.mean(dim=0)
    for i, r in enumerate(rows):
        r["median_s"], r["min_s"] = float(mx[i, 0]), float(mx[i, 1])
        r.pop("bytes_per_step")
        r["bytes_per_rank_per_step"] = float(sm[i, 2])
    return rows


def run_launched(args: argparse.Namespace) -> Optional[List[Dict[str, Any]]]:
    """Under torchrun / mpiexec: measure this world; rank 0 returns the rows."""
    from torchsso2.distributed import get_communicator

    torch.set_num_threads(args.threads)
    comm = get_communicator("auto")
    if comm.world_size > 1 and type(comm).__name__ == "MPICommunicator":
        from torchsso2.distributed import install_abort_on_exception

        install_abort_on_exception(comm)
    rows = _gather(comm, measure(comm, args))
    for r in rows:
        r["backend"] = type(comm).__name__
    return rows if comm.rank == 0 else None


def _spawned_rank(rank: int, world: int, init: str, out: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from datetime import timedelta

    from torchsso2.distributed import get_communicator

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    try:
        comm = get_communicator("torch", timeout=args.timeout)
        rows = _gather(comm, measure(comm, args))
        if rank == 0:
            for r in rows:
                r["backend"] = "TorchCommunicator(gloo, spawned)"
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def run_spawned(world: int, args: argparse.Namespace) -> List[Dict[str, Any]]:
    if world == 1:
        from torchsso2.distributed import LocalCommunicator

        torch.set_num_threads(args.threads)
        rows = _gather(LocalCommunicator(), measure(LocalCommunicator(), args))
        for r in rows:
            r["backend"] = "LocalCommunicator"
        return rows
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "rows.pt")
        procs = [ctx.Process(target=_spawned_rank, args=(r, world, init, out, args), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + args.timeout
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        if codes != [0] * world:
            raise RuntimeError(f"spawned ranks exited with {codes} (None: killed after {args.timeout} s)")
        return torch.load(out)


def table(rows: List[Dict[str, Any]]) -> str:
    base = {(r["optimizer"], r["shape"], r["placement"]): r["min_s"] for r in rows if r["ranks"] == 1}
    out = []
    for r in sorted(rows, key=lambda r: (r["optimizer"], r["shape"], r["placement"], r["ranks"])):
        one = base.get((r["optimizer"], r["shape"], r["placement"]))
        out.append([{"so": "SecondOrder", "vi": "VI"}[r["optimizer"]], r["shape"], r["placement"], r["ranks"],
                    f"{r['params']:,}", f"{1e3 * r['min_s']:.1f}", f"{1e3 * r['median_s']:.1f}",
                    "" if one is None else f"{one / r['min_s']:.2f}x",
                    f"{r['bytes_per_rank_per_step'] / 1024:.1f}"])
    return markdown_table(["optimizer", "shape", "placement", "ranks", "params", "ms/step (min)", "ms/step (median)",
                           "speed-up (min)", "KiB sent/rank/step"], out, align="lllrrrrrr")


def _launched() -> bool:
    from torchsso2.distributed.mpi_backend import mpi_launch_size
    from torchsso2.distributed.torch_backend import torchrun_world_size

    return torchrun_world_size() > 0 or mpi_launch_size() > 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    if _launched():
        rows = run_launched(args)
        if rows is None:
            return 0
    else:
        rows = []
        for world in args.ranks:
            print(f"measuring {world} rank(s) ...", flush=True)
            rows += run_spawned(world, args)
    print(table(rows))
    if not args.no_json:
        saved: Optional[Dict[str, Any]] = None
        if args.json.exists():
            try:
                saved = json.loads(args.json.read_text())
            except ValueError:
                saved = None
        now = time.time()
        for r in rows:  # rows kept from an earlier run keep their own time stamp
            r["measured_at_unix"] = now
        merged = merge_rows(saved, rows, args)
        write_json(args.json, {"machine": machine_info(), "load_average": load_average(),
                               "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                               "rows": merged})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
