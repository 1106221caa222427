"""Adaptive K-FAC (``use_adaptive_learning_rate`` / ``use_adaptive_momentum`` + ``adaptive_damping``):
extra cost per step and robustness over the initial damping.

Two parts, on scikit-learn's digits as issue 30 sets them up (1437 train / 360 test, stratified
split with seed 0, features standardized with the training set's mean and std), MLP 64-128-10:

1. **Step time**: one full training step (closure + update) of plain K-FAC
   (``SecondOrderOptimizer(approx="kfac")``, fixed lr/momentum), of adaptive lr + momentum, and
   of adaptive lr + momentum with LM ``adaptive_damping``, at each
   ``--batch-sizes`` and curvature/inverse intervals 1/1 and 10/100: every step of ``--repeats``
   cycles of one full update cycle (10 steps for 1/1, 100 for 10/100) is timed, each step's min
   (median) over the cycles at its position in the cycle is taken and averaged over the cycle,
   and the ratio adaptive / plain of each is reported (all variants interleaved in the same run,
   so the ratio is what to read on a loaded machine). Also the closure (forward + backward) and
   the quadratic model's two forward-mode passes alone, as many short interleaved calls (on a
   loaded machine a whole update cycle is often preempted; short calls less often).
2. **Robustness grid**: adaptive K-FAC (lr and momentum solved, LM damping from the given start)
   over ``--damping-decays`` × ``--dampings`` × ``--seeds`` at batch ``--grid-batch``: epochs to ``--target`` test
   accuracy (at most ``--max-epochs``), with the final accuracy and the last coefficients.

Examples::

    python benchmarks/kfac_adaptive.py                       # writes benchmarks/results/kfac_adaptive.json
    python benchmarks/kfac_adaptive.py --quick --json /tmp/a.json
    python benchmarks/kfac_adaptive.py --no-grid             # step times only

Timings use one thread (``--threads 1``).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (fill_unset, fmt_ratio, load_average, machine_info, machine_line,  # noqa: E402
                               markdown_table, write_json)
from examples.common import fraction_in, make_closure, positive_float, positive_int  # noqa: E402
from torchsso2 import SecondOrderOptimizer  # noqa: E402

logger = logging.getLogger("benchmarks.kfac_adaptive")
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "kfac_adaptive.json"
HIDDEN = 128
#: (name, adaptive lr/momentum, LM damping) of the timed optimizers
VARIANTS = (("kfac", False, False), ("adaptive", True, False), ("adaptive_lm", True, True))


def load_data(split_seed: int = 0) -> Dict[str, torch.Tensor]:
    """Digits as issue 30 uses them: 1437 / 360 stratified split, standardized (train statistics), flat [N, 64]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    ds = load_digits()
    xtr, xte, ytr, yte = train_test_split(ds.data, ds.target, test_size=360, random_state=split_seed,
                                          stratify=ds.target)
    xtr, xte = torch.tensor(xtr, dtype=torch.float32), torch.tensor(xte, dtype=torch.float32)
    mean, std = xtr.mean(0), xtr.std(0).clamp_min(1e-6)
    return {"x_train": (xtr - mean) / std, "y_train": torch.tensor(ytr), "x_test": (xte - mean) / std,
            "y_test": torch.tensor(yte)}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))


def make_optimizer(model: nn.Module, adaptive: bool, damping: float, intervals: Sequence[int], seed: int,
                   lr: float = 0.01, momentum: float = 0.9, lm: bool = True,
                   damping_decay: float = 0.95) -> SecondOrderOptimizer:
    """Plain K-FAC (``lr``, ``momentum``, fixed ``damping``) or adaptive K-FAC (lr and momentum
    solved; with ``lm`` LM damping starting at ``damping``)."""
    kw: Dict[str, Any] = dict(approx="kfac", damping=damping, curv_update_interval=intervals[0],
                              inv_update_interval=intervals[1], seed=seed)
    if adaptive:
        kw.update(use_adaptive_learning_rate=True, use_adaptive_momentum=True, adaptive_damping=lm,
                  damping_adaptation_decay=damping_decay)
    return SecondOrderOptimizer(model, lr=lr, momentum=momentum, **kw)


# ---- part 1: step time ------------------------------------------------------------------------
def time_steps(data: Dict[str, torch.Tensor], batch_sizes: Sequence[int], repeats: int,
               intervals: Sequence[Sequence[int]]) -> List[Dict[str, Any]]:
    rows = []
    for bs in batch_sizes:
        x, y = data["x_train"][:bs], data["y_train"][:bs]
        for iv in intervals:
            window = max(iv[1], 10)
            opts = {}
            for name, adaptive, lm in VARIANTS:
                model = make_model(0)
                opts[name] = (model, make_optimizer(model, adaptive, 1e-2, iv, seed=0, lm=lm))
            closures = {name: make_closure(opt, model, x, y) for name, (model, opt) in opts.items()}
            for name, (model, opt) in opts.items():  # warm up: the first steps allocate and decompose
                for _ in range(window):
                    opt.step(closures[name])
            # per-step times of `repeats` cycles of `window` steps (one full update cycle), interleaved;
            # a step's estimate is its min (median) over the cycles at its position in the cycle, so a
            # preempted step on the loaded machine does not count
            per_step: Dict[str, List[List[float]]] = {name: [] for name in opts}
            for _ in range(repeats):
                for name, (model, opt) in opts.items():
                    cycle = []
                    for _ in range(window):
                        start = time.perf_counter()
                        opt.step(closures[name])
                        cycle.append(time.perf_counter() - start)
                    per_step[name].append(cycle)
            times: Dict[str, List[float]] = {}
            for name, cycles in per_step.items():
                mins = [min(c[i] for c in cycles) for i in range(window)]
                meds = [statistics.median(c[i] for c in cycles) for i in range(window)]
                times[name] = [sum(mins) / window, sum(meds) / window]
            row: Dict[str, Any] = {"batch": bs, "intervals": f"{iv[0]}/{iv[1]}"}
            plain = {"min_s": times["kfac"][0], "median_s": times["kfac"][1]}
            for name in opts:
                row[name] = {"min_s": times[name][0], "median_s": times[name][1]}
                if name != "kfac":
                    row[f"{name}_ratio_min"] = row[name]["min_s"] / plain["min_s"]
                    row[f"{name}_ratio_median"] = row[name]["median_s"] / plain["median_s"]
            rows.append(row)
            logger.info("batch %d intervals %s: %s", bs, row["intervals"],
                        ", ".join(f"{n} {1e3 * row[n]['min_s']:.2f} ms" for n in opts))
    return rows


def time_components(data: Dict[str, torch.Tensor], batch_sizes: Sequence[int], repeats: int) -> List[Dict[str, Any]]:
    """Min / median over ``repeats`` interleaved calls of the closure (forward + loss + backward) and
    of the quadratic model's Gram matrix for two directions (two forward-mode passes,
    :func:`torchsso2.optim.adaptive.ggn_gram`): short calls, so fewer of them are preempted on a
    loaded machine than whole update cycles."""
    from torchsso2.optim.adaptive import InputRecorder, ggn_gram

    rows = []
    for bs in batch_sizes:
        x, y = data["x_train"][:bs], data["y_train"][:bs]
        model = make_model(0)
        opt = make_optimizer(model, True, 1e-2, (1, 1), seed=0)
        closure = make_closure(opt, model, x, y)
        params = list(model.parameters())
        names = [n for n, _ in model.named_parameters()]
        rec = InputRecorder()
        with rec.record(model):
            closure()
        gen = torch.Generator().manual_seed(0)
        dirs = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(2)]
        calls = {"closure": closure,
                 "quad_model": lambda: ggn_gram(model, rec.calls, names, params, dirs, opt.engine.loss, lambda o: o)}
        times: Dict[str, List[float]] = {k: [] for k in calls}
        for _ in range(3):
            for fn in calls.values():
                fn()
        for _ in range(repeats):
            for k, fn in calls.items():
                start = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - start)
        row: Dict[str, Any] = {"batch": bs}
        for k, ts in times.items():
            row[k] = {"min_s": min(ts), "median_s": statistics.median(ts)}
        row["ratio_min"] = row["quad_model"]["min_s"] / row["closure"]["min_s"]
        rows.append(row)
        logger.info("batch %d: closure %.3f ms, quadratic model %.3f ms", bs, 1e3 * row["closure"]["min_s"],
                    1e3 * row["quad_model"]["min_s"])
    return rows


def component_table(rows: List[Dict[str, Any]]) -> str:
    return markdown_table(["batch", "closure (fwd + bwd) ms, min / median", "quadratic model (2 JVPs) ms",
                           "quadratic model / closure (min)"],
                          [[r["batch"], f"{1e3 * r['closure']['min_s']:.3f} / {1e3 * r['closure']['median_s']:.3f}",
                            f"{1e3 * r['quad_model']['min_s']:.3f} / {1e3 * r['quad_model']['median_s']:.3f}",
                            fmt_ratio(r["ratio_min"])] for r in rows])


# ---- part 2: robustness grid ------------------------------------------------------------------
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def epochs_to_target(data: Dict[str, torch.Tensor], damping: float, seed: int, batch: int, target: float,
                     max_epochs: int, intervals: Sequence[int], damping_decay: float = 0.95) -> Dict[str, Any]:
    """Train adaptive K-FAC until the test accuracy reaches ``target`` (checked after every epoch)."""
    model = make_model(seed)
    opt = make_optimizer(model, True, damping, intervals, seed=seed, damping_decay=damping_decay)
    gen = torch.Generator().manual_seed(seed)
    n = data["x_train"].shape[0]
    loss_fn = nn.CrossEntropyLoss()
    reached: Optional[int] = None
    acc, wall = 0.0, 0.0
    for epoch in range(1, max_epochs + 1):
        start = time.perf_counter()
        for idx in torch.randperm(n, generator=gen).split(batch):  # the last batch is partial (1437 = 2·512 + 413)
            x, y = data["x_train"][idx], data["y_train"][idx]

            def closure():
                opt.zero_grad()
                out = model(x)
                loss = loss_fn(out, y)
                loss.backward()
                return loss, out
            opt.step(closure)
        wall += time.perf_counter() - start
        acc = accuracy(model, data["x_test"], data["y_test"])
        if acc >= target:
            reached = epoch
            break
    return {"damping": damping, "damping_decay": damping_decay, "seed": seed, "epochs": reached, "final_accuracy": acc, "wall_s": wall,
            "final_damping": opt.damping, "last": dict(opt.adaptive.last), "num_skipped": opt.num_skipped}


def grid(data: Dict[str, torch.Tensor], dampings: Sequence[float], seeds: Sequence[int], batch: int, target: float,
         max_epochs: int, intervals: Sequence[int], decays: Sequence[float] = (0.95,)) -> List[Dict[str, Any]]:
    runs = []
    for decay in decays:
        for damping in dampings:
            for seed in seeds:
                runs.append(epochs_to_target(data, damping, seed, batch, target, max_epochs, intervals, decay))
                logger.info("decay %g damping %g seed %d: epochs %s, accuracy %.3f", decay, damping, seed,
                            runs[-1]["epochs"], runs[-1]["final_accuracy"])
    return runs


def grid_table(runs: List[Dict[str, Any]], target: float) -> str:
    rows = []
    for decay, damping in sorted({(r["damping_decay"], r["damping"]) for r in runs}, key=lambda k: (-k[0], k[1])):
        mine = [r for r in runs if r["damping"] == damping and r["damping_decay"] == decay]
        eps = [r["epochs"] for r in mine]
        got = [e for e in eps if e is not None]
        med = statistics.median(e if e is not None else float("inf") for e in eps)
        rows.append([f"{decay:g} ({decay ** 5:.3g})", f"{damping:g}", f"{len(got)}/{len(eps)}", " ".join(str(e) if e else "-" for e in eps),
                     "-" if med == float("inf") else f"{med:g}",
                     " ".join(f"{r['final_accuracy']:.3f}" for r in mine),
                     f"{statistics.median(r['wall_s'] for r in mine):.2f}",
                     " ".join(f"{r['final_damping']:.2g}" for r in mine)])
    return markdown_table(["damping_adaptation_decay per step (per LM adjustment)", "initial damping", f"seeds reaching {target:.0%}", "epochs per seed", "median epochs",
                           "final test accuracy", "median wall s", "final damping"], rows)


def step_table(rows: List[Dict[str, Any]]) -> str:
    def ms(r: Dict[str, Any], n: str) -> str:
        return f"{1e3 * r[n]['min_s']:.2f} / {1e3 * r[n]['median_s']:.2f}"

    def ratio(r: Dict[str, Any], n: str) -> str:
        return f"{fmt_ratio(r[n + '_ratio_min'])} / {fmt_ratio(r[n + '_ratio_median'])}"
    return markdown_table(
        ["batch", "intervals", "K-FAC ms (min / median)", "adaptive ms", "adaptive + LM ms",
         "adaptive / K-FAC (min / median)", "adaptive + LM / K-FAC"],
        [[r["batch"], r["intervals"], ms(r, "kfac"), ms(r, "adaptive"), ms(r, "adaptive_lm"),
          ratio(r, "adaptive"), ratio(r, "adaptive_lm")] for r in rows])


def format_tables(report: Dict[str, Any]) -> str:
    """The report's tables (step time, the quadratic model's cost, the damping grid), as printed."""
    parts = []
    if "step_time" in report:
        parts += ["Step time (ms), interleaved:", "", step_table(report["step_time"]), "",
                  "The quadratic model's extra work alone vs the closure:", "", component_table(report["components"])]
    if "grid" in report:
        cfg = report.get("config", {})
        intervals = cfg.get("intervals", ["?", "?"])
        parts += ["" if parts else "", f"Epochs to {cfg.get('target', 0.97):.0%} test accuracy, batch "
                  f"{cfg.get('grid_batch', '?')}, intervals {intervals[0]}/{intervals[1]}:", "",
                  grid_table(report["grid"], cfg.get("target", 0.97))]
    return "\n".join(parts).strip()


#: what ``--quick`` fills in for the options not given on the command line (a tiny smoke run)
QUICK: Dict[str, Any] = dict(batch_sizes=[128], repeats=2, dampings=[1e-2], damping_decays=[0.95], seeds=[0],
                             max_epochs=2)
#: the full run's values of the same options
FULL: Dict[str, Any] = dict(batch_sizes=[512, 128], repeats=15, dampings=[1e-3, 1e-2, 1e-1], damping_decays=[0.95],
                            seeds=[0, 1, 2], max_epochs=30)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line; the options of :data:`FULL` not given take its values, or :data:`QUICK`'s with ``--quick``
    (an explicit value is always kept)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch-sizes", type=positive_int, nargs="+", default=None,
                    help="batch sizes of the step timing (default 512 128; --quick: 128)")
    ap.add_argument("--repeats", type=positive_int, default=None,
                    help="timed update cycles per optimizer (min/median over them; default 15, --quick: 2)")
    ap.add_argument("--dampings", type=positive_float, nargs="+", default=None,
                    help="initial dampings of the grid (default 1e-3 1e-2 1e-1; --quick: 1e-2)")
    ap.add_argument("--damping-decays", type=fraction_in(0.0, 1.0, low_open=True, high_open=True), nargs="+",
                    default=None,
                    help="damping_adaptation_decay values of the grid (per step, kfac-jax's convention: one LM "
                         "adjustment every 5 steps moves the damping by decay**5; default: the library default 0.95)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds of the grid (default 0 1 2; --quick: 0)")
    ap.add_argument("--grid-batch", type=positive_int, default=512, help="batch size of the grid")
    ap.add_argument("--target", type=fraction_in(0.0, 1.0), default=0.97, help="test accuracy to reach")
    ap.add_argument("--max-epochs", type=positive_int, default=None,
                    help="epochs per grid run at most (default 30; --quick: 2)")
    ap.add_argument("--intervals", type=positive_int, nargs=2, default=[1, 1], metavar=("CURV", "INV"),
                    help="curvature / inverse update intervals of the grid runs")
    ap.add_argument("--no-grid", action="store_true", help="step timing only")
    ap.add_argument("--no-timing", action="store_true", help="grid only")
    ap.add_argument("--quick", action="store_true",
                    help="tiny smoke run (no file unless --json is given): fills in the options above that are not "
                         "given with small values; explicit ones are kept")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    ap.add_argument("--json", type=Path, default=None, help=f"output file (default {DEFAULT_JSON.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    fill_unset(args, QUICK if args.quick else FULL)
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    data = load_data()
    report: Dict[str, Any] = {"machine": machine_info(), "config": {**{k: (str(v) if isinstance(v, Path) else v)
                                                                       for k, v in vars(args).items()},
                                                                    "load_average_before": load_average()}}
    if not args.no_timing:
        report["step_time"] = time_steps(data, args.batch_sizes, args.repeats, [(1, 1), (10, 100)])
        report["components"] = time_components(data, args.batch_sizes, 10 * args.repeats)
    if not args.no_grid:
        report["grid"] = grid(data, args.dampings, args.seeds, args.grid_batch, args.target, args.max_epochs,
                              args.intervals, args.damping_decays)
    report["config"]["load_average_after"] = load_average()
    print(machine_line(report))
    if "step_time" in report:
        print("\nStep time: plain K-FAC (lr 0.01, momentum 0.9, damping 1e-2), adaptive lr + momentum, and adaptive "
              "with LM damping (interval 5; each damping change re-decomposes), interleaved in one run:\n")
        print(step_table(report["step_time"]))
        print("\nThe quadratic model's extra work alone vs the closure, short calls interleaved:\n")
        print(component_table(report["components"]))
    if "grid" in report:
        print(f"\nAdaptive K-FAC, batch {args.grid_batch}, intervals {args.intervals[0]}/{args.intervals[1]}, "
              f"epochs to {args.target:.0%} test accuracy (at most {args.max_epochs}):\n")
        print(grid_table(report["grid"], args.target))
        report["grid_table"] = grid_table(report["grid"], args.target)
    out = args.json if args.json is not None else (None if args.quick else DEFAULT_JSON)
    if out is not None:
        write_json(out, report)
        print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
