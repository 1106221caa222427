"""How a SecondOrderOptimizer step's time grows with layer width d, per curvature shape,
measured beside a FLOP model.

Examples::

    python -m benchmarks.width_scaling --quick                 # d = 32 … 512
    python -m benchmarks.width_scaling --full --json benchmarks/results/width_scaling.json \
        --plot docs/width_scaling.png                          # d = 32 … 2048

Model: ``Linear(d, d) - ReLU - Linear(d, d) - ReLU - Linear(d, 10)``, batch B (default 128),
``SecondOrderOptimizer(curvature="fisher_mc", curv_update_interval=1, inv_update_interval=1)``
— the worst case, where every step estimates and decomposes the curvature — and plain SGD
as the floor. ``full`` only runs while a layer's block ``(d·d + d)²`` stays small (d ≤ 64).

FLOP model per step (layers ``(d_in, d_out)``, ``p = d_out·(d_in + 1)``):

* forward + backward of every optimizer: ``6·B·d_in·d_out``;
* ``kfac``: factors ``2·B·(d_in² + d_out²)``, two eigendecompositions ``≈ 9·(d_in³ + d_out³)``,
  preconditioning ``4·(d_out²·d_in + d_out·d_in²)`` (into the eigenbases and back: two matmuls with
  each, ``2·n·m·(n + m)`` multiply-adds, as step_overhead's eigen-basis floor);
* ``diag``: per-example gradients and their squares ``3·B·p``;
* ``full``: per-example outer products ``2·B·p²``, eigendecomposition ``≈ 9·p³``, solve ``4·p²``.

The dashed lines are the FLOP model divided by one throughput per shape, fitted to the larger
half of the measured widths (geometric mean of measured FLOP/s), so the plot compares the
*shape* of the growth, not absolute speed; at small d the fixed per-step overhead (Python,
hooks, kernel launches) sits above the line. Times are min (and median) over adaptive repeats.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import _peer_utils as pu  # noqa: E402
from benchmarks.common import progress, read_report  # noqa: E402

logger = logging.getLogger("benchmarks.width_scaling")

SHAPES = ("sgd", "diag", "kfac", "full")
FULL_MAX_D = 64
QUICK_WIDTHS = (32, 64, 128, 256, 512)
#: largest width of the `full` shape in a --quick run (its [d², d²] blocks: 4160² at d = 64 take a minute a step)
QUICK_FULL_MAX_D = 32
FULL_WIDTHS = (32, 64, 128, 256, 512, 1024, 2048)  # 32: a second point for `full`


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.width_scaling",
                                description="Step time vs layer width per curvature shape, beside a FLOP model.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help=f"widths {' '.join(map(str, QUICK_WIDTHS))}")
    mode.add_argument("--full", action="store_true", help=f"widths {' '.join(map(str, FULL_WIDTHS))} (default)")
    p.add_argument("--widths", type=int, nargs="+", default=None, help="layer widths d (default: --full's list; --quick a short one)")
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES), help='curvature shapes (default: all)')
    p.add_argument("--batch", type=int, default=128, help='batch size (default 128)')
    p.add_argument("--budget", type=float, default=None, help="seconds of timed steps per point (default 2; --quick 0.3)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help='write the JSON report here (default: none)')
    p.add_argument("--plot", type=Path, default=None, metavar="PNG", help="write the plot here (needs matplotlib)")
    p.add_argument("--replot", type=Path, default=None, metavar="JSON",
                   help="no measurement: refit the FLOP model on this JSON, rewrite it, print and --plot")
    p.add_argument("-v", "--verbose", action="store_true", help='log progress (INFO)')
    a = p.parse_args(argv)
    a.widths = a.widths or list(QUICK_WIDTHS if a.quick else FULL_WIDTHS)
    if min(a.widths) < 1:
        p.error(f"--widths {' '.join(map(str, a.widths))}: expected integers >= 1")
    if a.batch < 1:
        p.error(f"--batch {a.batch}: expected an integer >= 1")
    a.budget = a.budget if a.budget is not None else (0.3 if a.quick else 2.0)
    a.full_max_d = QUICK_FULL_MAX_D if a.quick else FULL_MAX_D
    return a


def layer_dims(d: int) -> List[Tuple[int, int]]:
    return [(d, d), (d, d), (d, 10)]


def model_flops(shape: str, d: int, batch: int) -> float:
    """The FLOP model of one step (see the module docstring)."""
    total = 0.0
    for din, dout in layer_dims(d):
        total += 6.0 * batch * din * dout
        p = dout * (din + 1)
        if shape == "kfac":
            a = din + 1
            total += 2.0 * batch * (a * a + dout * dout) + 9.0 * (a ** 3 + dout ** 3) + 4.0 * (dout ** 2 * a + dout * a ** 2)
        elif shape == "diag":
            total += 3.0 * batch * p
        elif shape == "full":
            total += 2.0 * batch * p * p + 9.0 * p ** 3 + 4.0 * p * p
    return total


def _step_fn(shape: str, d: int, batch: int) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 10))
    x, y = torch.randn(batch, d), torch.randint(0, 10, (batch,))
    loss_fn = nn.CrossEntropyLoss()
    if shape == "sgd":
        opt: Any = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def step() -> None:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        return step
    from torchsso2 import SecondOrderOptimizer

    opt = SecondOrderOptimizer(model, lr=1e-3, momentum=0.9, curvature="fisher_mc", approx=shape, damping=1e-2,
                               curv_update_interval=1, inv_update_interval=1, seed=0)

    def closure() -> Any:
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        return loss, out

    return lambda: opt.step(closure)


def _fit_points(rows: List[Dict[str, Any]], shape: str) -> List[Dict[str, Any]]:
    """The rows of ``shape`` its throughput is fitted to: the larger half of its widths."""
    rs = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["d"])
    return rs[len(rs) // 2:]


def fit_model(rows: List[Dict[str, Any]]) -> None:
    """Add ``fitted_flops_per_s`` and ``model_s`` to ``rows``: one throughput per shape, the
    geometric mean of measured FLOP/s over the larger half of its widths (where the FLOPs, not
    the fixed per-step overhead, dominate)."""
    for shape in {r["shape"] for r in rows}:
        big = _fit_points(rows, shape)
        rs = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["d"])
        rate = math.exp(sum(math.log(r["model_flops"] / r["min_s"]) for r in big) / len(big))
        for r in rs:
            r["fitted_flops_per_s"] = rate
            r["model_s"] = r["model_flops"] / rate


def run(args: argparse.Namespace) -> Dict[str, Any]:
    rows: List[Dict[str, Any]] = []
    full_max_d = getattr(args, "full_max_d", FULL_MAX_D)
    jobs = [(s, d) for s in args.shapes for d in args.widths if s != "full" or d <= full_max_d]
    it: Any = progress(jobs, "width_scaling")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for shape, d in it:
            fn = _step_fn(shape, d, args.batch)
            _, t = pu.time_adaptive(fn, budget_s=args.budget, min_repeats=3, max_repeats=50)
            rows.append({"shape": shape, "d": d, "batch": args.batch, "min_s": t["min_s"], "median_s": t["median_s"],
                         "times_s": t["times_s"], "model_flops": model_flops(shape, d, args.batch)})
            logger.info("%s d=%d: %.2f ms", shape, d, 1e3 * t["min_s"])
    fit_model(rows)
    return pu.report("width_scaling", {"widths": args.widths, "shapes": args.shapes, "batch": args.batch,
                                       "budget_s": args.budget, "full_max_d": full_max_d,
                                       "model": "MLP d-d-d-10, SecondOrderOptimizer fisher_mc, "
                                       "curv/inv update every step"}, rows, {})


def format_table(rep: Dict[str, Any]) -> str:
    shapes = [s for s in rep["config"]["shapes"] if any(r["shape"] == s for r in rep["results"])]
    widths = rep["config"]["widths"]
    by = {(r["shape"], r["d"]): r for r in rep["results"]}
    # a throughput fitted to one point gives that point 1.00 by construction: not a measured agreement
    alone = {(s, fit[0]["d"]) for s in shapes for fit in [_fit_points(rep["results"], s)] if len(fit) == 1}
    hdr = ["d"] + [f"{s} ms (min)" for s in shapes] + [f"{s} / model" for s in shapes if s != "sgd"]
    rows = []
    for d in widths:
        row: List[Any] = [d]
        row += [pu.fmt(1e3 * by[(s, d)]["min_s"], ".2f") if (s, d) in by else "" for s in shapes]
        row += [("fit" if (s, d) in alone else pu.fmt(by[(s, d)]["min_s"] / by[(s, d)]["model_s"], ".2f"))
                if (s, d) in by else "" for s in shapes if s != "sgd"]
        rows.append(row)
    note = ("\n\n`shape / model` = measured time ÷ FLOP-model time (one fitted throughput per shape): "
            "≈ 1 everywhere means the growth follows the FLOP model; `fit`: the one point a shape's throughput "
            "is fitted to (1 by construction).")
    return pu.markdown_table(hdr, rows, "r" * len(hdr)) + note


def plot(rep: Dict[str, Any], path: Path) -> bool:
    """Write the log-log plot; False (with a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colors = {"sgd": "tab:gray", "diag": "tab:green", "kfac": "tab:blue", "full": "tab:red"}
    for shape in rep["config"]["shapes"]:
        rs = sorted((r for r in rep["results"] if r["shape"] == shape), key=lambda r: r["d"])
        if not rs:
            continue
        ds = [r["d"] for r in rs]
        ax.plot(ds, [1e3 * r["min_s"] for r in rs], "o-", color=colors.get(shape), label=f"{shape} (measured)")
        ax.plot(ds, [1e3 * r["model_s"] for r in rs], "--", color=colors.get(shape), alpha=0.6,
                label=f"{shape} (FLOP model, {rs[0]['fitted_flops_per_s'] / 1e9:.1f} GFLOP/s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("layer width d  (MLP d-d-d-10)")
    ax.set_ylabel("time per step, ms (min)")
    m = rep["machine"]
    ax.set_title(f"SecondOrderOptimizer step vs width, B={rep['config']['batch']}\n"
                 f"{m['cpu'][:40]}, {m['torch_threads']} threads, torch {m['torch']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.replot is not None:
        rep = read_report(args.replot, ["results"], "benchmarks.width_scaling")
        fit_model(rep["results"])
        pu.save(args.replot, rep)
    else:
        rep = run(args)
        pu.save(args.json, rep)
    print(format_table(rep))
    if args.plot is not None:
        plot(rep, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
