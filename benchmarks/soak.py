"""Soak and create/destroy figures: memory and step time over a long run, hooks and memory left
behind by dropped optimizers.

Examples::

    OMP_NUM_THREADS=1 python -m benchmarks.soak                       # 5000 steps per face, 200 optimizers
    OMP_NUM_THREADS=1 python -m benchmarks.soak --steps 500 --create 20 --json /tmp/soak.json

**Soak.** Each face trains an MLP ``32 → 64 → 64 → 10`` on a fixed synthetic data set
(1024 examples, batches of 32, cycled) for ``--steps`` steps, all in this process one after the
other. Reported per face: resident set size (``/proc/self/statm``; also every tenth of the run:
the allocator's warm-up shows as growth early that stops), the number of live tensors
the garbage collector tracks, and the median step time over the ``--window`` steps after a
``--warmup`` (start) and over the last ``--window`` steps (end). A leak shows as growing RSS or
tensor count; a slowdown as a growing end/start time ratio.

**Create/destroy.** For each face, ``--create`` optimizers are built on one model, stepped once
and dropped. Reported: module and tensor hooks left on the model, optimizers still alive after
``gc.collect()`` (weak references), RSS before and after, and the model's plain
forward+backward time before and after (leftover hooks slow it down).

Faces: ``sso-kfac`` (SecondOrderOptimizer, K-FAC, MC Fisher), ``sso-ef`` (K-FAC, empirical
Fisher from the user's backward: no ``targets``), ``vi-diag`` (VIOptimizer, diagonal MC Fisher,
VOGN-like), ``vi-ef`` (diagonal empirical Fisher from the backward) and ``kfac``
(KFACPreconditioner + SGD).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import load_average, machine_info, write_json  # noqa: E402
from examples.common import nonnegative_int, positive_int  # noqa: E402
from torchsso2 import SecondOrderOptimizer, VIOptimizer  # noqa: E402
from torchsso2.kfac import KFACPreconditioner  # noqa: E402

FACES = ("sso-kfac", "sso-ef", "vi-diag", "vi-ef", "kfac")
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "soak.json"


def rss_mib() -> float:
    """Resident set size of this process in MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _tensors() -> List[torch.Tensor]:
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def tensor_baseline() -> Dict[int, Any]:
    """The tensors alive now (weakly, by id): :func:`live_tensors` leaves them out, so what a process held
    before a soak (an earlier test's compiled graph freed mid-run) does not count as the soak's."""
    return {id(t): weakref.ref(t) for t in _tensors()}


def live_tensors(baseline: Optional[Dict[int, Any]] = None) -> int:
    """Tensors tracked by the garbage collector after a full collection, except those of ``baseline``."""
    before = baseline or {}
    return sum(1 for t in _tensors() if id(t) not in before or before[id(t)]() is not t)


def hooks_on(model: nn.Module) -> int:
    """Module hooks on ``model``'s modules plus tensor hooks on its parameters."""
    n = sum(len(getattr(m, d, None) or {}) for m in model.modules() for d in HOOK_DICTS)
    return n + sum(len(p._backward_hooks or {}) for p in model.parameters())


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def make_data(n: int = 1024, batch: int = 32) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    y = (x[:, :10].argmax(1) + (x[:, 10] > 1).long()) % 10  # learnable labels
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


def make_stepper(face: str, model: nn.Module) -> Tuple[Callable[[torch.Tensor, torch.Tensor], float], Any]:
    """``(step(x, y) -> loss, the optimizer object)`` for ``face``."""
    if face == "kfac":
        pre = KFACPreconditioner(model, lr=0.01, damping=0.01)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step_kfac(x: torch.Tensor, y: torch.Tensor) -> float:
            sgd.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            pre.step()
            sgd.step()
            return float(loss.detach())
        return step_kfac, pre
    if face.startswith("sso"):
        opt: Any = SecondOrderOptimizer(model, lr=0.01, momentum=0.9, approx="kfac", damping=0.1,
                                        curvature="empirical_fisher" if face == "sso-ef" else "fisher_mc", seed=0)
    else:
        opt = VIOptimizer(model, dataset_size=1024, lr=1e-4, approx="diag", prior_precision=1.0,
                          curvature="empirical_fisher" if face == "vi-ef" else "fisher_mc", seed=0)

    def step_native(x: torch.Tensor, y: torch.Tensor) -> float:
        def closure() -> Tuple[torch.Tensor, torch.Tensor]:
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            return loss, out
        loss, _ = opt.step(closure)
        return float(loss.detach())
    return step_native, opt


def soak(face: str, steps: int, warmup: int, window: int) -> Dict[str, Any]:
    baseline = tensor_baseline()
    model = make_model()
    data = make_data()
    step, opt = make_stepper(face, model)
    times: List[float] = []
    cpu: List[float] = []
    losses: List[float] = []
    start: Dict[str, float] = {}
    trace: List[Tuple[int, float]] = []  # (step, RSS MiB) every `every` steps: warm-up vs growth
    every = max(1, steps // 10)
    for i in range(steps):
        if i == warmup:
            start = {"rss_mib": rss_mib(), "live_tensors": live_tensors(baseline)}
        if i % every == 0:
            trace.append((i, round(rss_mib(), 1)))
        x, y = data[i % len(data)]
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(x, y))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    end = {"rss_mib": rss_mib(), "live_tensors": live_tensors(baseline)}
    t_start = statistics.median(times[warmup:warmup + window]) * 1e3
    t_end = statistics.median(times[-window:]) * 1e3
    return {
        "face": face, "steps": steps,
        "rss_mib_start": round(start["rss_mib"], 1), "rss_mib_end": round(end["rss_mib"], 1),
        "rss_growth_mib": round(end["rss_mib"] - start["rss_mib"], 1),
        "rss_growth_second_half_mib": round(end["rss_mib"] - next(r for i, r in trace if i >= steps // 2), 1),
        "rss_trace_mib": trace,
        "live_tensors_start": int(start["live_tensors"]), "live_tensors_end": int(end["live_tensors"]),
        "step_ms_start": round(t_start, 3), "step_ms_end": round(t_end, 3),
        "step_time_ratio_end_start": round(t_end / t_start, 2),
        # CPU time of this process per step (one thread): less disturbed by other processes than wall time
        "step_cpu_ms_start": round(statistics.median(cpu[warmup:warmup + window]) * 1e3, 3),
        "step_cpu_ms_end": round(statistics.median(cpu[-window:]) * 1e3, 3),
        "skipped_steps": int(getattr(opt, "num_skipped", 0)),
            "loss_first": round(losses[0], 4), "loss_last_mean": round(statistics.fmean(losses[-window:]), 4),
    }


def fwd_bwd_ms(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reps: int = 200) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
        best = min(best, (time.perf_counter() - t0) / reps * 1e3)
    return best


def create_destroy(face: str, count: int, reps: int = 200) -> Dict[str, Any]:
    model = make_model()
    x, y = make_data()[0]
    hooks_before, ms_before = hooks_on(model), fwd_bwd_ms(model, x, y, reps)
    gc.collect()
    rss_before = rss_mib()
    refs = []
    for _ in range(count):
        step, opt = make_stepper(face, model)
        step(x, y)
        refs.append(weakref.ref(opt))
        del step, opt
    gc.collect()
    return {
        "face": face, "created": count,
        "hooks_before": hooks_before, "hooks_left": hooks_on(model) - hooks_before,
        "alive_after_gc": sum(r() is not None for r in refs),
        "rss_mib_before": round(rss_before, 1), "rss_mib_after": round(rss_mib(), 1),
        "fwd_bwd_ms_before": round(ms_before, 3), "fwd_bwd_ms_after": round(fwd_bwd_ms(model, x, y, reps), 3),
    }


def main(argv: List[str] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=5000, help="soak steps per face (default 5000)")
    parser.add_argument("--warmup", type=nonnegative_int, default=50, help="steps before the start figures (default 50)")
    parser.add_argument("--window", type=positive_int, default=200, help="steps in each timing window (default 200)")
    parser.add_argument("--create", type=nonnegative_int, default=200, help="optimizers created and dropped per face (default 200)")
    parser.add_argument("--timing-reps", type=positive_int, default=200,
                        help="forward+backward passes per timing of the create/destroy model (default 200)")
    parser.add_argument("--faces", nargs="+", choices=FACES, default=list(FACES), help="faces to run (default: all)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"output file (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    if args.steps < args.warmup + 2 * args.window:
        parser.error(f"--steps={args.steps} must be at least --warmup + 2·--window = {args.warmup + 2 * args.window}")
    report: Dict[str, Any] = {"machine": machine_info(), "load_average_start": load_average(),
                              "config": vars(args) | {"json": str(args.json)}, "soak": [], "create_destroy": []}
    for face in args.faces:
        row = soak(face, args.steps, args.warmup, args.window)
        report["soak"].append(row)
        print(row, flush=True)
    for face in args.faces:
        row = create_destroy(face, args.create, args.timing_reps)
        report["create_destroy"].append(row)
        print(row, flush=True)
    report["load_average_end"] = load_average()
    write_json(args.json, report)
    print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
