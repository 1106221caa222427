"""VIOptimizer benchmark (issue 27): step time and accuracy / NLL / ECE of VI diag, VI K-FAC, IVON, Adam
and SGD at their library defaults except the learning rate. One run, one JSON
(``benchmarks/results/vi.json``).

Methods (``benchmarks/vi_quality.py``'s :func:`make_optimizer`): ``VIOptimizer(model, dataset_size=N,
lr=lr)`` (diag; ``approx="kfac"`` for K-FAC; ``loss="mse", noise_variance="learned"`` for regression),
``ivon.IVON(params, lr, ess=N)`` (``pip install ivon-opt``; skipped with a message when missing),
``torch.optim.Adam(params, lr)``, ``torch.optim.SGD(params, lr, momentum=0.9)``.

Parts, all in one process:

1. **Step time** (``timing``): one training step (closure with forward and backward, weight
   sampling, curvature, update) on the digits MLP 64-128-10 and the digits CNN, batch 64, at each
   method's default lr (VIOptimizer's signature default, IVON 0.1, Adam 1e-3, SGD 0.03). The
   optimizers are timed round-robin (one window of steps each per round, so drifts of the machine
   hit all alike), ``--repeats`` rounds; min and median of the per-step times, and their ratio to
   Adam's in the same run. ``adam+noise (floor)``: Adam that also draws and adds weight noise per
   parameter tensor, a reference for a one-sample VI step's extra work (VIOptimizer draws its noise
   in one buffer and fuses its update, so it can take less; the JSON key keeps its old name). Run it
   on a quiet core: step times depend on the load (the JSON
   records the load average before and after).
2. **Quality** (``quality``): digits MLP (40 epochs), digits CNN (15 epochs), diabetes regression (50
   epochs); per method the lr is chosen from a small grid by the mean validation NLL over
   ``--select-seeds`` (3) seeds per value (never by test data; a choice at an end of the values
   tried adds a half-decade value beyond it, at most ``--edge-extensions`` (2) per end), then 5
   seeds at that lr (the
   selection's runs of seeds 0–2 reused) are evaluated on the test split (accuracy, NLL, ECE,
   Brier; Gaussian NLL and RMSE for diabetes), with issue 27's targets checked for VI diag. On the
   digits MLP also the mean predictive entropy on the test digits and on out-of-distribution inputs
   (seed 0), and with ``--plot`` the reliability diagrams of the same test predictions.
   Diabetes also over random splits (``regression_splits``, ``benchmarks/vi_splits.py``): the same
   protocol with one seed on each of ``--regression-splits`` (20) splits, and the paired differences
   VI diag − IVON / Adam / SGD over splits (mean ± standard error); the 5 seeds above share one
   89-example test split. The digits tasks likewise (``classification_splits``, ``--classification-splits``
   (20) splits each): test NLL, ECE and accuracy over splits and the paired NLL and ECE differences.
3. **Long run** (``long``): the digits MLP over ``--long-epochs`` (200) epochs for VI diag, IVON and
   Adam (``--long-seeds`` seeds, lr chosen again by validation at that length): a short run hides
   how the curvature average moves away from its start.
4. **Paired extra** (``paired`` in each digits task's record, :mod:`benchmarks.vi_paired`): VI diag,
   IVON and Adam at the lrs chosen in 2./3. on ``--paired-seeds`` (20) seeds, the protocol's seeds
   among them, with the per-seed differences VI diag − IVON / − Adam (mean ± standard error). It does
   not replace the 5-seed numbers and verdicts; it says whether a small ECE margin is more than seed noise.

Details of the tasks, splits, grids and the regression likelihood: ``benchmarks/vi_quality.py``.

Examples::

    OMP_NUM_THREADS=1 python -m benchmarks.vi            # the full run: writes benchmarks/results/vi.json
    python -m benchmarks.vi --quick                      # smoke run (JSON into a temp dir)
    python -m benchmarks.vi --skip-timing --tasks digits-mlp --methods vi-diag adam --seeds 2 --json /tmp/v.json
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import vi_paired  # noqa: E402
from benchmarks import vi_quality as vq  # noqa: E402
from benchmarks import vi_splits  # noqa: E402
from benchmarks.common import (fmt_ratio, load_average, machine_info, machine_line, markdown_table, summarize,  # noqa: E402
                               time_training_steps, try_import, write_json)
from torchsso2 import VIOptimizer  # noqa: E402
from torchsso2.optim.vi import shifted_params  # noqa: E402
from torchsso2.optim.vi_schedule import DEFAULT_VI_INTERVALS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
DEFAULT_JSON = RESULTS_DIR / "vi.json"

#: models timed (batch 64, the quality runs' batch)
TIMING_TASKS = ("digits-mlp", "digits-cnn")
TIMING_BATCH = 64
#: the lr each method is timed at: its library default (IVON has none: its README's 0.1)
DEFAULT_LRS: Dict[str, float] = {"vi-diag": vq.VI_DEFAULT_LR, "vi-kfac": vq.VI_DEFAULT_LR,
                                 "vi-fisher-mc": vq.VI_DEFAULT_LR, "ivon": 0.1, "adam": 1e-3, "sgd": 0.03}
FLOOR = "adam+noise (floor)"
#: the methods of the long run
LONG_METHODS = ("vi-diag", "ivon", "adam")


class AdamWithWeightNoise(torch.optim.Adam):
    """Adam that also does what every sampling VI method does each step: draw ``ε ~ N(0, σ²)`` for all
    weights, evaluate the closure at ``θ + ε`` and restore ``θ``, one tensor at a time: a reference
    for a one-sample VI step's extra work (no curvature at all; a VI step that draws its noise in one
    buffer and fuses its update can take less)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.noise_generator = torch.Generator().manual_seed(0)

    @contextlib.contextmanager
    def sampled_params(self, train: bool = True) -> Iterator[None]:
        """``θ ← θ + ε`` for the body, then ``θ`` restored (IVON's interface, so one step function serves both)."""
        params = [p for g in self.param_groups for p in g["params"]]
        noise = [torch.randn(p.shape, generator=self.noise_generator).mul_(1e-3) for p in params]
        with shifted_params(params, noise):  # the same mechanism as VIOptimizer's
            yield


def _sampled_step(opt: Any, closure: Any) -> None:
    """IVON (and the adam+noise floor): the closure at sampled weights, then the step."""
    with opt.sampled_params(train=True):
        closure()
    opt.step()


def run_timing(args: argparse.Namespace, ivon_mod: Any) -> List[Dict[str, Any]]:
    """Round-robin step times per model (see the module docstring); one row per (model, method)."""
    rows: List[Dict[str, Any]] = []
    for task in TIMING_TASKS:
        split = vq.load_task(task)
        x, y = split.x_train[:TIMING_BATCH], split.y_train[:TIMING_BATCH]
        runs = []
        for name in [*args.methods, FLOOR]:
            if name == "ivon" and ivon_mod is None:
                continue
            torch.manual_seed(0)
            model = vq.make_model(task)
            if name == FLOOR:
                opt: Any = AdamWithWeightNoise(model.parameters(), lr=DEFAULT_LRS["adam"])
            else:
                opt = vq.make_optimizer(name, model, DEFAULT_LRS[name], len(split.y_train), False, 0, ivon_mod)
            step = _sampled_step if hasattr(opt, "sampled_params") and not isinstance(opt, VIOptimizer) else None
            runs.append((name, model, opt, step))
        times: Dict[str, List[float]] = {name: [] for name, *_ in runs}
        for r in range(args.repeats):
            for name, model, opt, step in runs:
                times[name] += time_training_steps(model, opt, x, y, args.window, 1, step=step,
                                                   warmup=5 if r == 0 else 0)
        stats = {name: summarize(t) for name, t in times.items()}
        adam = stats.get("adam")
        for name, model, opt, _ in runs:
            s = stats[name]
            row = {"model": task, "batch": TIMING_BATCH, "optimizer": name, "lr": DEFAULT_LRS.get(name, 1e-3),
                   "window_steps": args.window, **s,
                   "ratio_adam_min": s["min_s"] / adam["min_s"] if adam else None,
                   "ratio_adam_median": s["median_s"] / adam["median_s"] if adam else None,
                   "ratio_sgd_min": s["min_s"] / stats["sgd"]["min_s"] if "sgd" in stats else None,
                   "skipped_steps": int(getattr(opt, "num_skipped", 0))}
            rows.append(row)
            print(f"  {task} B={TIMING_BATCH} {name:20s} {1e3 * s['min_s']:7.3f} ms min {1e3 * s['median_s']:7.3f} ms "
                  f"median  ({fmt_ratio(row['ratio_adam_min'])} / {fmt_ratio(row['ratio_adam_median'])} Adam)",
                  flush=True)
    return rows


def _quality_args(args: argparse.Namespace, epochs: Dict[str, int], seeds: int, entropy_tasks: Sequence[str]
                  ) -> argparse.Namespace:
    """The namespace :func:`benchmarks.vi_quality.run_method` reads."""
    return argparse.Namespace(epochs=epochs, seeds=seeds, select_seeds=args.select_seeds, mc_samples=args.mc_samples,
                              grids=args.grids, edge_extensions=args.edge_extensions,
                              entropy_tasks=tuple(entropy_tasks), reliability=args.reliability)


def _add_paired(tasks: Dict[str, Any], qargs: argparse.Namespace, seeds: int, ivon_mod: Any) -> None:
    """Adds :func:`benchmarks.vi_paired.run_paired`'s record as ``"paired"`` to each classification task of ``tasks``."""
    for task, res in tasks.items():
        if "noise_var" in res:  # regression: no ECE, no paired extra
            continue
        t0 = time.perf_counter()
        paired = vi_paired.run_paired(task, res, qargs, ivon_mod, seeds)
        if paired:
            res["paired"] = paired
            print(f"  {task} ({qargs.epochs[task]} ep) paired extra, {seeds} seeds "
                  f"({time.perf_counter() - t0:.1f} s): {vi_paired.paired_text(paired)}", flush=True)


def format_tables(report: Dict[str, Any]) -> str:
    lines = [machine_line(report)]
    c = report["config"]
    if report.get("timing"):
        lines += ["", f"Step time (ms per training step at each method's default lr, batch {TIMING_BATCH}, "
                  f"{c['threads']} thread; min / median over {c['repeats']} round-robin windows of {c['window']} "
                  f"steps; x Adam = ratio to Adam in the same run; load average before {c['load_average_before']}, "
                  f"after {c['load_average_after']})"]
        rows = [[r["model"], r["optimizer"], f"{1e3 * r['min_s']:.3f}", f"{1e3 * r['median_s']:.3f}",
                 fmt_ratio(r["ratio_adam_min"]), fmt_ratio(r["ratio_adam_median"]), r["skipped_steps"]]
                for r in report["timing"]]
        lines.append(markdown_table(["model", "optimizer", "min ms", "median ms", "x Adam (min)", "x Adam (median)",
                                     "skipped"], rows, "llrrrrr"))
    if report.get("quality"):
        lines.append(vq.format_tables(report["quality"], c["mc_samples"]))
        ent = {m: r["entropy"] for t in report["quality"].values() for m, r in t["methods"].items() if "entropy" in r}
        if ent:
            sets = list(next(iter(ent.values()))["entropy_ood"])
            lines += ["", "Mean predictive entropy (nats) on the digits MLP, seed 0: test digits vs out-of-distribution sets"]
            lines.append(markdown_table(["method", "test", *sets],
                                        [[m, f"{e['entropy_test']:.3f}", *(f"{e['entropy_ood'][o]:.3f}" for o in sets)]
                                         for m, e in ent.items()]))
    if report.get("regression_splits"):
        lines.append(vi_splits.format_splits(report["regression_splits"]))
    for res in (report.get("classification_splits") or {}).values():
        lines.append(vi_splits.format_splits(res))
    if report.get("long"):
        lines += ["", "Long run:" + vq.format_tables(report["long"], c["mc_samples"])]
    for what, why in report["skipped"].items():
        lines.append(f"\nskipped {what}: {why}")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.vi",
        description="Issue 27's VI benchmark: step time and accuracy/NLL/ECE of VIOptimizer (diag, kfac), IVON, Adam "
        "and SGD at library defaults except lr, on the digits MLP, a digits CNN and diabetes regression, plus a "
        "200-epoch digits-MLP run; one JSON.")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 epoch (diabetes 3), 2 seeds, 4 samples, 2 timing rounds, a 2-epoch long run; "
                        "JSON into a temp dir unless --json")
    p.add_argument("--tasks", nargs="+", choices=vq.TASKS, default=list(vq.TASKS), help='tasks (default: all)')
    p.add_argument("--methods", nargs="+", choices=vq.ALL_METHODS, default=list(vq.METHODS),
                   help=f"default: {' '.join(vq.METHODS)} (vi-fisher-mc: VI diag with curvature='fisher_mc', on request)")
    p.add_argument("--seeds", type=int, default=None, help="seeds at the chosen lr (default 5; quick 2)")
    p.add_argument("--select-seeds", type=int, default=None,
                   help="seeds per grid value in the lr selection: the lr with the smallest mean validation NLL over "
                        "seeds 0 … N−1 is chosen; those runs are reused as test seeds (default 3; quick 2)")
    p.add_argument("--epochs", type=int, default=None,
                   help=f"epochs for every task (default per task: {vq.EPOCHS}; quick: 1, diabetes 3)")
    p.add_argument("--grid", type=float, nargs="+", default=None, metavar="LR",
                   help="one lr grid for every method (default: per method, see benchmarks/vi_quality.py LR_GRIDS)")
    p.add_argument("--edge-extensions", type=int, default=vq.EDGE_EXTENSIONS,
                   help="grid-edge rule: while the chosen lr is at an end of the values tried, one more value a "
                        "half-decade beyond that end is trained on the selection seeds and the choice is made again, "
                        f"at most N times per end (default {vq.EDGE_EXTENSIONS}; 0: the grid only)")
    p.add_argument("--mc-samples", type=int, default=None, help="posterior samples per prediction (default 32; quick 4)")
    p.add_argument("--long-epochs", type=int, default=None,
                   help="epochs of the long digits-MLP run (default 200; quick 2; 0: no long run)")
    p.add_argument("--long-seeds", type=int, default=None,
                   help="seeds of the long run (default 5, issue 27's protocol; quick 1)")
    p.add_argument("--paired-seeds", type=int, default=None,
                   help="seeds of the paired extra (VI diag, IVON, Adam at their chosen lrs; digits tasks and the "
                        "long run; default 20; quick 3; 0: none)")
    p.add_argument("--repeats", type=int, default=None, help="round-robin timing rounds (default 30; quick 2)")
    p.add_argument("--window", type=int, default=None, help="steps per timed window (default 20; quick 3)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--skip-timing", action="store_true", help='only the quality tables, no step timing')
    p.add_argument("--skip-quality", action="store_true", help="no quality and no long run")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="also save the reliability diagrams of the digits-MLP test predictions (seed 0)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help=f"where the JSON goes (default {DEFAULT_JSON.relative_to(ROOT)}; quick: a new temp dir)")
    p.add_argument("--regression-splits", type=int, default=None,
                   help="random diabetes splits of the paired comparison (default 20; quick 2; 0: none; "
                        "benchmarks/vi_splits.py)")
    p.add_argument("--classification-splits", type=int, default=None,
                   help="random splits of each digits task's paired comparison (default 20; quick 2; 0: none; "
                        "benchmarks/vi_splits.py)")
    args = p.parse_args(argv)
    q = args.quick
    args.seeds = args.seeds or (2 if q else 5)
    args.select_seeds = args.select_seeds if args.select_seeds is not None else (2 if q else 3)
    args.mc_samples = args.mc_samples or (4 if q else 32)
    args.long_seeds = args.long_seeds or (1 if q else 5)
    args.paired_seeds = args.paired_seeds if args.paired_seeds is not None else (3 if q else 20)
    args.long_epochs = args.long_epochs if args.long_epochs is not None else (2 if q else 200)
    args.repeats = args.repeats or (2 if q else 30)
    args.window = args.window or (3 if q else 20)
    epochs = {t: (3 if t == "diabetes" else 1) for t in vq.TASKS} if q else dict(vq.EPOCHS)
    if args.epochs is not None:
        epochs = {t: args.epochs for t in vq.TASKS}
    args.epochs = epochs
    if not q:  # a smoke run writes into results/ only when told to: main() makes its temp dir when it writes
        args.json = args.json or DEFAULT_JSON
    args.grids = {m: tuple(args.grid) if args.grid else vq.LR_GRIDS[m] for m in vq.ALL_METHODS}
    if args.seeds < 1 or args.select_seeds < 1 or args.mc_samples < 2 or min(epochs.values()) < 1 or args.long_epochs < 0 \
            or args.paired_seeds < 0 or args.repeats < 1 or args.window < 1:
        p.error("--seeds, --select-seeds, --epochs, --repeats, --window must be >= 1, --long-epochs and --paired-seeds >= 0 and "
                "--mc-samples >= 2")
    if any(lr <= 0 for g in args.grids.values() for lr in g):
        p.error("learning rates must be > 0")
    args.reliability = {}
    args.regression_splits = args.regression_splits if args.regression_splits is not None else (2 if q else 20)
    if args.edge_extensions < 0:
        p.error(f"--edge-extensions must be >= 0, got {args.edge_extensions}")
    if args.regression_splits < 0:
        p.error(f"--regression-splits must be >= 0, got {args.regression_splits}")
    args.classification_splits = args.classification_splits if args.classification_splits is not None else \
        (2 if q else 20)
    if args.classification_splits < 0:
        p.error(f"--classification-splits must be >= 0, got {args.classification_splits}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.getLogger("torchsso2").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(args.threads)
    ivon_mod, why = try_import("ivon")
    skipped: Dict[str, str] = {}
    methods = list(args.methods)
    if "ivon" in methods and ivon_mod is None:
        skipped["ivon"] = f"`import ivon` failed ({why}); pip install ivon-opt"
        print(f"IVON skipped: {skipped['ivon']}", flush=True)
        methods.remove("ivon")
    args.methods = methods
    load_before = load_average()
    start = time.perf_counter()
    timing = [] if args.skip_timing else run_timing(args, ivon_mod)
    quality: Dict[str, Any] = {}
    long: Dict[str, Any] = {}
    if not args.skip_quality:
        qargs = _quality_args(args, args.epochs, args.seeds, ("digits-mlp",))
        quality = vq.run_tasks(qargs, ivon_mod, args.tasks, methods)
        _add_paired(quality, qargs, args.paired_seeds, ivon_mod)
        if args.long_epochs and "digits-mlp" in args.tasks:
            largs = _quality_args(args, {"digits-mlp": args.long_epochs}, args.long_seeds, ())
            long = vq.run_tasks(largs, ivon_mod, ["digits-mlp"], [m for m in LONG_METHODS if m in methods])
            _add_paired(long, largs, args.paired_seeds, ivon_mod)
    if args.plot is not None and args.reliability.get("digits-mlp"):
        from torchsso2.plotting import save_reliability_diagram

        save_reliability_diagram(args.reliability["digits-mlp"], args.plot,
                                 title=f"digits MLP, {args.epochs['digits-mlp']} epochs, seed 0 (lr chosen by "
                                 "validation NLL; VI/IVON: Bayesian model average)")
        print(f"wrote {args.plot}")
    splits = _regression_splits(args, ivon_mod, methods)
    class_splits = _classification_splits(args, ivon_mod, methods)
    report = {"machine": machine_info(),
              "config": {"quick": args.quick, "tasks": list(args.tasks), "methods": methods, "seeds": args.seeds,
                         "select_seeds": args.select_seeds,
                         "epochs": dict(args.epochs), "batch_size": vq.BATCH_SIZE,
                         "lr_grids": {m: list(args.grids[m]) for m in methods},
                         "edge_extensions": args.edge_extensions, "mc_samples": args.mc_samples,
                         "long_epochs": args.long_epochs, "long_seeds": args.long_seeds,
                         "paired_seeds": args.paired_seeds,
                         "repeats": args.repeats, "window": args.window, "threads": args.threads,
                         "timing_lrs": {m: DEFAULT_LRS[m] for m in methods if m in DEFAULT_LRS},
                         "vi_default_lr": vq.VI_DEFAULT_LR,
                         "vi_kfac_intervals": list(DEFAULT_VI_INTERVALS["kfac"]),
                         "ivon": getattr(ivon_mod, "__version__", "installed") if ivon_mod else None,
                         "plot": str(args.plot) if args.plot is not None and quality else None,
                         "selection": f"lr with the smallest mean validation NLL over seeds 0-{args.select_seeds - 1} "
                                      "per grid value",
                         "regression_splits": args.regression_splits,
                         "classification_splits": args.classification_splits,
                         "regression_noise": "VI: noise_variance='learned'; IVON/Adam/SGD: given OLS residual variance "
                                             "on the training split, trained on y/σ; Adam/SGD predictive variance = "
                                             "validation residual variance",
                         "load_average_before": load_before, "load_average_after": load_average(),
                         "seconds": time.perf_counter() - start},
              "timing": timing, "quality": quality, "regression_splits": splits,
              "classification_splits": class_splits, "long": long,
              "skipped": skipped}
    print()
    print(format_tables(report))
    json_path = args.json or Path(tempfile.mkdtemp(prefix="vi_bench_")) / "vi.json"
    write_json(json_path, report)
    print(f"\nwrote {json_path}")
    return 0


def _classification_splits(args: argparse.Namespace, ivon_mod: Any, methods: Sequence[str]) -> Dict[str, Any]:
    """:func:`benchmarks.vi_splits.run_splits` of each digits task run, for VI diag, IVON, Adam and SGD (those
    run): ``{task: result}``, empty when off (``--classification-splits 0``, ``--skip-quality``, no VI diag)."""
    split_methods = [m for m in ("vi-diag", *vi_splits.REFERENCES) if m in methods]
    if args.skip_quality or not args.classification_splits or "vi-diag" not in split_methods:
        return {}
    qargs = _quality_args(args, args.epochs, 1, ())
    return {task: vi_splits.run_splits(qargs, ivon_mod, split_methods, args.classification_splits, task)
            for task in args.tasks if task != vi_splits.TASK}


def _regression_splits(args: argparse.Namespace, ivon_mod: Any, methods: Sequence[str]) -> Dict[str, Any]:
    """:func:`benchmarks.vi_splits.run_splits` for VI diag, IVON, Adam and SGD (those run), or ``{}`` when
    it is off (``--regression-splits 0``, ``--skip-quality``, no diabetes task or no VI diag)."""
    split_methods = [m for m in ("vi-diag", *vi_splits.REFERENCES) if m in methods]
    if args.skip_quality or not args.regression_splits or "diabetes" not in args.tasks or "vi-diag" not in split_methods:
        return {}
    return vi_splits.run_splits(_quality_args(args, args.epochs, 1, ()), ivon_mod, split_methods, args.regression_splits)


if __name__ == "__main__":
    sys.exit(main())
