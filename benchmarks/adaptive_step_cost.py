"""Whole training steps of adaptive K-FAC on the time-to-97% models, against SGD and Adam.

The models, data and optimizers of :mod:`benchmarks.kfac_time_to_accuracy` (digits MLP 64-128-10
and the small CNN, standardized digits, batch ``--batch``): SGD (lr 0.1, momentum 0.9), Adam
(lr 0.01), and ``SecondOrderOptimizer(approx="kfac")`` in adaptive mode (learning rate, momentum
and LM damping from 0.01, ``opt.step(closure, targets=y)``) at each curvature/decomposition
interval of ``--intervals``. Every optimizer trains its own copy of the model on the training
set's batches in order; the optimizers take turns, ``--steps`` consecutive steps each, for
``--rounds`` rounds (so load changes hit all alike), and each round's mean time per step is one
sample: the table gives the min and median over the rounds, in ms per step, and the ratio of the
min to SGD's and Adam's min in the same run. Steady state (after ``--warmup`` steps), so the
intervals' curvature estimates, decompositions and LM steps are averaged over each round. Also (unless
``--no-plain``) steps without curvature work (the curvature and decomposition of the first step
only): fixed K-FAC (lr 0.3, damping 0.01), and adaptive K-FAC with its products from the hand-written
pass of a plain ``nn.Sequential`` and from the forward-mode (dual-number) pass every other model takes.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/adaptive_step_cost.py            # about 2 minutes
    python benchmarks/adaptive_step_cost.py --models mlp --rounds 3 --json /tmp/a.json

Writes ``benchmarks/results/adaptive_step_cost.json`` unless ``--json`` says otherwise.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import load_average, machine_info, markdown_table, write_json  # noqa: E402
from benchmarks.kfac_robustness import load_data  # noqa: E402
from benchmarks.kfac_time_to_accuracy import make_model, make_optimizer  # noqa: E402
from examples.common import make_closure, nonnegative_int, positive_int  # noqa: E402
from torchsso2.optim import sequential_jvp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "adaptive_step_cost.json"


def stepper(method: str, point: Dict[str, Any], model_kind: str, x: torch.Tensor, y: torch.Tensor,
            batch: int, dual_numbers: bool = False) -> Callable[[], None]:
    """One training step per call of ``method`` at ``point`` on the next batch of ``(x, y)`` (in order,
    cycling). ``dual_numbers``: the adaptive products take the forward-mode path that models other than
    a plain ``nn.Sequential`` take (the hand-written pass is switched off during this stepper's steps)."""
    model = make_model(model_kind, 0)
    opt = make_optimizer(method, point, model, 0)
    starts = list(range(0, len(y) - batch + 1, batch))
    position = [0]

    def step() -> None:
        i = starts[position[0] % len(starts)]
        position[0] += 1
        xb, yb = x[i:i + batch], y[i:i + batch]
        closure = make_closure(opt, model, xb, yb)
        if method == "kfac-adaptive":
            opt.step(closure, targets=yb)
        elif method == "kfac-fixed":
            opt.step(closure)
        else:
            closure()
            opt.step()

    if not dual_numbers:
        return step

    def dual_step() -> None:
        supports, sequential_jvp.supports_model = sequential_jvp.supports_model, _never
        try:
            step()
        finally:
            sequential_jvp.supports_model = supports
    return dual_step


def _never(model: torch.nn.Module) -> bool:
    return False


def measure(model_kind: str, batch: int, intervals: Sequence[Tuple[int, int]], rounds: int, steps: int,
            warmup: int, no_curvature: bool = True) -> List[Dict[str, Any]]:
    """Interleaved per-step times of SGD, Adam and adaptive K-FAC at each interval pair (ms)."""
    data = load_data()
    x, y = data["x_train"], data["y_train"]
    runs: List[Tuple[str, Callable[[], None]]] = [
        ("sgd lr 0.1", stepper("sgd", {"lr": 0.1}, model_kind, x, y, batch)),
        ("adam lr 0.01", stepper("adam", {"lr": 0.01}, model_kind, x, y, batch))]
    for c, i in intervals:
        runs.append((f"adaptive {c}/{i}",
                     stepper("kfac-adaptive", {"damping": 0.01, "curv": c, "inv": i}, model_kind, x, y, batch)))
    if no_curvature:  # the curvature and decomposition of the first step only, then none
        never = {"curv": 10 ** 9, "inv": 10 ** 9}
        runs += [("K-FAC fixed, no curvature work",
                  stepper("kfac-fixed", {"lr": 0.3, "damping": 0.01, **never}, model_kind, x, y, batch)),
                 ("adaptive, no curvature work",
                  stepper("kfac-adaptive", {"damping": 0.01, **never}, model_kind, x, y, batch)),
                 ("adaptive, no curvature work, dual numbers",
                  stepper("kfac-adaptive", {"damping": 0.01, **never}, model_kind, x, y, batch, dual_numbers=True))]
    for _, step in runs:
        for _ in range(warmup):
            step()
    samples: Dict[str, List[float]] = {name: [] for name, _ in runs}
    for _ in range(rounds):
        for name, step in runs:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            samples[name].append((time.perf_counter() - start) / steps * 1e3)
    sgd, adam = min(samples[runs[0][0]]), min(samples[runs[1][0]])
    return [{"model": model_kind, "batch": batch, "optimizer": name, "min_ms": min(v),
             "median_ms": statistics.median(v), "min_over_sgd": min(v) / sgd, "min_over_adam": min(v) / adam}
            for name, v in samples.items()]


def table(rows: Sequence[Dict[str, Any]]) -> str:
    return markdown_table(["model", "batch", "optimizer", "ms/step min", "median", "÷ SGD", "÷ Adam"],
                          [[r["model"], r["batch"], r["optimizer"], f"{r['min_ms']:.2f}", f"{r['median_ms']:.2f}",
                            f"{r['min_over_sgd']:.2f}x", f"{r['min_over_adam']:.2f}x"] for r in rows], align="lrlrrrr")


def parse_args(argv: Sequence[str] = ()) -> Tuple[argparse.Namespace, List[Tuple[int, int]]]:
    """The command line and its ``--intervals`` as ``(curv, inv)`` pairs; an out-of-range value is an argparse error."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("mlp", "cnn"), default=["mlp", "cnn"], help='models to measure (default: mlp cnn)')
    parser.add_argument("--batch", type=positive_int, default=128, help="batch size (default 128)")
    parser.add_argument("--intervals", nargs="+", default=["5/5", "1/10", "3/12", "5/20"],
                        help="curvature/decomposition intervals of adaptive K-FAC (default 5/5 1/10 3/12 5/20)")
    parser.add_argument("--rounds", type=positive_int, default=15, help="rounds of interleaved timing (default 15)")
    parser.add_argument("--steps", type=positive_int, default=60,
                        help="consecutive steps per optimizer and round (default 60)")
    parser.add_argument("--warmup", type=nonnegative_int, default=20,
                        help="untimed steps of each optimizer first (default 20)")
    parser.add_argument("--no-plain", action="store_true",
                        help="leave out the steps without curvature work (K-FAC fixed, adaptive on both J·v paths)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"output JSON (default {DEFAULT_JSON})")
    args = parser.parse_args(list(argv) or None)
    intervals = []
    for text in args.intervals:
        try:
            c, i = (int(v) for v in text.split("/"))
        except ValueError:
            c = i = 0
        if c < 1 or i < 1:
            parser.error(f"--intervals takes CURV/INV pairs of whole numbers >= 1 such as 5/20, got {text!r}")
        intervals.append((c, i))
    return args, intervals


def main(argv: Sequence[str] = ()) -> int:
    args, intervals = parse_args(argv)
    torch.set_num_threads(args.threads)
    before = load_average()
    rows = [r for m in args.models for r in measure(m, args.batch, intervals, args.rounds, args.steps, args.warmup,
                                                           not args.no_plain)]
    after = load_average()
    print(table(rows))
    print(f"\nload average before/after: {before} / {after}")
    write_json(args.json, {"machine": machine_info(), "config": {**{k: v for k, v in vars(args).items() if k != "json"},
                                                                 "load_average_before": before,
                                                                 "load_average_after": after},
                           "rows": rows})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
