"""Noisy K-FAC (``VIOptimizer(approx="kfac")``): validation quality and step time per curvature / decomposition interval.

The question it answers: does estimating the curvature every ``k`` steps and eigendecomposing the
K-FAC factors every ``m`` steps (instead of both at every step) keep the validation quality of
noisy K-FAC on the tasks of :mod:`benchmarks.vi_quality`, and how much step time does it save?

Quality. For each task (``digits-mlp``: 40 epochs, ``digits-cnn``: 15 epochs, ``diabetes`` on request:
50 epochs, Gaussian NLL and RMSE with the learned noise; the tasks, splits,
training loop and metrics of :mod:`benchmarks.vi_quality`, reused, not copied), each lr in
``--lrs`` (default: the lr VI K-FAC chose in ``benchmarks/results/vi.json`` and its two grid
neighbours) and each seed, every variant is trained from the same initialization with the same batch
order and evaluated on the **validation** split only (accuracy, NLL, ECE; the Bayesian model average of
``--mc-samples`` weight samples). Reported: each variant's mean, and the paired differences
``variant − reference`` (the first variant, by default today's ``1/1``) as mean ± standard error over
seeds. Every variant is ``VIOptimizer(model, dataset_size=N, lr=lr, approx="kfac", seed=seed)`` with
only the variant's own arguments added.

Variants (``--variants``, names ``k/m`` or ``k/m/decay``): ``k`` = ``curv_update_interval``, ``m`` =
``inv_update_interval``; ``decay`` (optional) is passed as ``ema_decay`` — ``pow`` means
``DEFAULT_VI_EMA_DECAY ** k`` (the same decay *per step* as the default's every-step EMA: each
estimate then carries the weight of the ``k`` steps it stands for).

Step time. The variants' steps on the digits MLP and the digits CNN (batch 64), round-robin in one
process (the order rotates every round), min, median and mean over ``--timing-steps`` timed steps, beside
Adam (lr 1e-3) and VI diag at its defaults, as in ``benchmarks/vi_step_time.py``. With intervals ``k/m``
the min and the median are the plain steps; the mean includes the curvature steps and the
decompositions (the cost per step over a run).

One command (10 seeds, about 10 minutes on an idle core; the JSON goes to ``--out``, never into
``benchmarks/results``)::

    OMP_NUM_THREADS=1 python benchmarks/vi_kfac_intervals.py --out /tmp/vi_kfac_intervals.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import vi_quality as vq  # noqa: E402
from benchmarks.common import load_average, machine_info, markdown_table, write_json  # noqa: E402
from benchmarks.vi_paired import paired_differences  # noqa: E402
from benchmarks.vi_step_time import round_robin, torch_step, vi_step, with_ratios  # noqa: E402
from examples.common import nonnegative_int, positive_float, positive_int  # noqa: E402
from torchsso2 import VIOptimizer  # noqa: E402
from torchsso2.optim.vi import DEFAULT_VI_EMA_DECAY  # noqa: E402

DEFAULT_OUT = Path(tempfile.gettempdir()) / "torchsso2-bench" / "vi_kfac_intervals.json"
#: every step (the reference), the kfac default (10/10, per-step decay), 10/100 with the per-step decay
#: and with the per-update one (docs/defaults.md, "Noisy K-FAC's intervals")
DEFAULT_VARIANTS = ("1/1", "10/10/pow", "10/100/pow", "10/100")
KEYS = ("accuracy", "nll", "ece")
#: the metrics of the regression task (Gaussian NLL and RMSE in the target's units)
REGRESSION_KEYS = ("nll", "rmse")


#: the form of a variant name, for the error messages
VARIANT_FORM = ("'k/m' or 'k/m/decay' (k, m: ints >= 1, the curvature and decomposition intervals; decay: a "
                "number in [0, 1) or 'pow'), e.g. " + ", ".join(DEFAULT_VARIANTS))


def variant_kwargs(name: str) -> Dict[str, Any]:
    """``"k/m"`` → ``{curv_update_interval: k, inv_update_interval: m}``; ``"k/m/d"`` adds ``ema_decay=d``
    (``"pow"``: ``DEFAULT_VI_EMA_DECAY ** k``). A malformed name is a ``ValueError`` naming the valid form."""
    parts = name.split("/")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        k, m = int(parts[0]), int(parts[1])
        decay = None if len(parts) == 2 else DEFAULT_VI_EMA_DECAY ** k if parts[2] == "pow" else float(parts[2])
        if k < 1 or m < 1 or (decay is not None and not 0.0 <= decay < 1.0):
            raise ValueError
    except ValueError:
        raise ValueError(f"variant {name!r}: expected {VARIANT_FORM}") from None
    kw: Dict[str, Any] = {"curv_update_interval": k, "inv_update_interval": m}
    if decay is not None:
        kw["ema_decay"] = decay
    return kw


def variant_name(text: str) -> str:
    """argparse ``type=`` of ``--variants``: ``text`` if :func:`variant_kwargs` takes it, else an argparse error."""
    try:
        variant_kwargs(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


@contextlib.contextmanager
def vi_with(**extra: Any) -> Iterator[None]:
    """Within the block, :mod:`benchmarks.vi_quality` builds its VIOptimizer with ``extra`` added."""

    class _VI(VIOptimizer):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **{**kw, **extra})

    saved = vq.VIOptimizer
    vq.VIOptimizer = _VI  # type: ignore[misc]
    try:
        yield
    finally:
        vq.VIOptimizer = saved  # type: ignore[misc]


def chosen_lr(task: str) -> Optional[float]:
    path = vq.RESULTS_DIR / "vi.json"
    try:
        return float(json.loads(path.read_text())["quality"][task]["methods"]["vi-kfac"]["chosen_lr"])
    except (OSError, KeyError, ValueError):
        return None


def neighbours(lr: float) -> List[float]:
    grid = sorted(vq.LR_GRIDS["vi-kfac"])
    i = min(range(len(grid)), key=lambda j: abs(grid[j] - lr))
    return grid[max(0, i - 1):i + 2]


def quality(task: str, lrs: Sequence[float], variants: Sequence[str], seeds: Sequence[int],
            mc_samples: int) -> Dict[str, Any]:
    split = vq.load_task(task)
    keys = REGRESSION_KEYS if split.regression else KEYS
    out: Dict[str, Any] = {}
    for lr in lrs:
        per: Dict[str, List[Dict[str, float]]] = {v: [] for v in variants}
        for seed in seeds:
            for v in variants:
                start = time.perf_counter()
                with vi_with(**variant_kwargs(v)):
                    run = vq.train(task, "vi-kfac", split, lr, seed, vq.EPOCHS[task], vq.BATCH_SIZE[task], None)
                    row = vq.evaluate(run, split, "val", mc_samples)
                row.update(seed=seed, skipped=run.skipped, seconds=time.perf_counter() - start)
                per[v].append(row)
                shown = " ".join(f"{k} {row[k]:.4f}" for k in keys)
                print(f"{task} lr={lr:g} seed={seed} {v}: {shown} skipped {run.skipped} ({row['seconds']:.1f}s)",
                      flush=True)
        means = {v: {k: statistics.fmean(r[k] for r in rows) for k in keys + ("skipped",)} for v, rows in per.items()}
        diffs = {v: paired_differences({v: per[v], variants[0]: per[variants[0]]}, base=v, keys=keys)[variants[0]]
                 for v in variants[1:]}
        out[f"{lr:g}"] = {"per_seed": per, "mean": means, f"minus_{variants[0]}": diffs}
    return out


def timing(variants: Sequence[str], steps: int, warmup: int) -> Dict[str, Any]:
    ce = F.cross_entropy
    out: Dict[str, Any] = {}
    for task in ("digits-mlp", "digits-cnn"):
        split = vq.load_task(task)
        n = len(split.y_train)
        batches = [(split.x_train[i:i + 64], split.y_train[i:i + 64]) for i in range(0, n - 63, 64)]

        def adam() -> Any:
            torch.manual_seed(0)
            model = vq.make_model(task)
            return torch_step(model, torch.optim.Adam(model.parameters(), lr=1e-3), ce)

        def vi(**kw: Any) -> Any:
            def make() -> Any:
                torch.manual_seed(0)
                model = vq.make_model(task)
                return vi_step(model, VIOptimizer(model, dataset_size=n, seed=0, **kw), ce)
            return make

        built = [("adam", adam), ("vi-diag", vi())] + \
            [(f"vi-kfac-{v}", vi(approx="kfac", **variant_kwargs(v))) for v in variants]
        load = load_average()
        res = with_ratios(round_robin(built, batches, steps, warmup), "adam")
        out[task] = {"load_average_before": load, "load_average_after": load_average(), "steps": res}
    return out


def report_tables(rep: Dict[str, Any], variants: Sequence[str]) -> str:
    lines: List[str] = []
    ref = variants[0]
    for task, by_lr in rep["quality"].items():
        for lr, r in by_lr.items():
            keys = [k for k in KEYS + REGRESSION_KEYS if k in r["mean"][ref]]
            keys = list(dict.fromkeys(keys))
            pct = {"accuracy", "ece"}  # shown in percent / percentage points
            rows = []
            for v in variants:
                m = r["mean"][v]
                row = [v] + [f"{100 * m[k]:.2f}" if k in pct else f"{m[k]:.4f}" for k in keys] + [f"{m['skipped']:g}"]
                if v != ref:
                    d = r[f"minus_{ref}"][v]
                    row += [f"{100 * d[k]['mean']:+.2f} ± {100 * d[k]['stderr']:.2f}" if k in pct else
                            f"{d[k]['mean']:+.4f} ± {d[k]['stderr']:.4f}" for k in keys]
                else:
                    row += [""] * len(keys)
                rows.append(row)
            lines.append(f"\n{task}, lr {lr}, validation, {len(r['per_seed'][ref])} seeds")
            lines.append(markdown_table(["variant"] + [k + (" %" if k in pct else "") for k in keys] + ["skipped"]
                                        + [f"Δ{k} vs {ref}" + (" (pp)" if k in pct else "") for k in keys], rows))
    for task, t in rep.get("timing", {}).items():
        rows = [[name, f"{s['min_ms']:.3f}", f"{s['median_ms']:.3f}", f"{s['mean_ms']:.3f}", f"{s['ratio_min']:.2f}×",
                 f"{s['ratio_median']:.2f}×", f"{s['ratio_mean']:.2f}×"] for name, s in t["steps"].items()]
        lines.append(f"\nstep time, {task}, batch 64 (load average before {t['load_average_before']}, "
                     f"after {t['load_average_after']})")
        lines.append(markdown_table(["variant", "min ms", "median ms", "mean ms", "min / adam", "median / adam",
                                     "mean / adam"], rows))
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/vi_kfac_intervals.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON report (default {DEFAULT_OUT})")
    p.add_argument("--tasks", nargs="+", default=["digits-mlp", "digits-cnn"], choices=["digits-mlp", "digits-cnn", "diabetes"], help='tasks (default: digits-mlp digits-cnn)')
    p.add_argument("--variants", nargs="+", type=variant_name, default=list(DEFAULT_VARIANTS),
                   help="'k/m' or 'k/m/decay' ('pow': the default decay to the power k); the first is the reference")
    p.add_argument("--lrs", nargs="+", type=positive_float, default=None,
                   help="learning rates (default: VI K-FAC's chosen lr in benchmarks/results/vi.json and its grid neighbours)")
    p.add_argument("--seeds", type=positive_int, default=10,
                   help="paired seeds first-seed … first-seed+seeds−1 (default 10)")
    p.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--mc-samples", type=positive_int, default=32,
                   help="weight samples of the validation BMA (default 32)")
    p.add_argument("--timing-steps", type=nonnegative_int, default=300,
                   help="timed round-robin steps per variant (0: no timing)")
    p.add_argument("--warmup", type=nonnegative_int, default=10, help="untimed steps before the timing (default 10)")
    p.add_argument("--skip-quality", action="store_true", help='only the step timing, no validation quality')
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rep: Dict[str, Any] = {"machine": machine_info(), "variants": {v: variant_kwargs(v) for v in args.variants},
                           "quality": {}}
    if not args.skip_quality:
        for task in args.tasks:
            lrs = args.lrs
            if lrs is None:
                c = chosen_lr(task)
                lrs = neighbours(c) if c is not None else [vq.VI_DEFAULT_LR]
            rep["quality"][task] = quality(task, lrs, args.variants, range(args.first_seed, args.first_seed + args.seeds),
                                           args.mc_samples)
    if args.timing_steps:
        rep["timing"] = timing(args.variants, args.timing_steps, args.warmup)
    print(report_tables(rep, args.variants))
    write_json(args.out, rep)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
