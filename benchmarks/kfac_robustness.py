"""Robustness of K-FAC (fixed lr/damping at the library defaults, and adaptive) beside SGD and Adam.

Issue 30's grid: the digits MLP 64-128-10 (scikit-learn's 8×8 digits, 1437 train / 360 test,
stratified split with seed 0), batch 512 (two full batches per epoch; the partial batch is
dropped), at most ``--epochs`` epochs (default 60), 3 seeds, one thread, target 97% test accuracy
(350 of 360), with both input scalings (the issue does not name one): ``standardize`` (the
training set's per-pixel mean and std) and ``pixel16`` (pixels / 16, in [0, 1]).

* **K-FAC fixed**: ``SecondOrderOptimizer(model, approx="kfac", lr=lr, damping=damping,
  momentum=0.9, curv_update_interval=c, inv_update_interval=i)``, every other argument at the
  library default, lr ∈ {0.01, 0.03, 0.1} × damping ∈ {1e-3, 1e-2, 1e-1} × (c, i) ∈ {10/100,
  2/20, 1/1}.
* **K-FAC adaptive**: ``use_adaptive_learning_rate=True, use_adaptive_momentum=True,
  adaptive_damping=True`` from damping ∈ {1e-3, 1e-2, 1e-1} (no lr to set), intervals
  ``--adaptive-intervals`` (default 1/1 and 10/100).
* **SGD** (momentum 0.9) and **Adam** at lr ∈ {0.01, 0.03, 0.1}.
* **KFACPreconditioner** (the kfac_pytorch drop-in, ``kfac_preconditioner``): ``SGD(lr, momentum=0.9)``
  preconditioned by ``KFACPreconditioner(model, factor_update_steps=c, inv_update_steps=i,
  damping=damping, lr=lr)``, kfac_pytorch's defaults otherwise (``kl_clip=0.001``,
  ``factor_decay=0.95``), on the same lr × damping × intervals grid; and kfac_pytorch's own
  ``kfac.preconditioner.KFACPreconditioner`` the same way (``kfac_pytorch``; skipped with a message
  when it is not installed), which takes the same number of epochs seed by seed.

Per grid point and seed: the first epoch whose test accuracy reaches the target, the training
time (forward, backward and step; no evaluation) until then, the final test accuracy and
training loss, and whether the run diverged (a non-finite loss, a batch loss above 10× the
first one, or a final training loss not below the first batch loss). A point *reaches* the target when its median
seed does; its epochs and seconds are the medians over the seeds (a seed that never reaches
counts as infinitely many).

Usage (one command, about 10 minutes on one quiet core; writes the JSON and the plot)::

    OMP_NUM_THREADS=1 python benchmarks/kfac_robustness.py     # benchmarks/results/kfac_robustness.json,
                                                               # docs/kfac_robustness.png
    python benchmarks/kfac_robustness.py --quick --json /tmp/r.json --plot /tmp/r.png   # smoke run
    python benchmarks/kfac_robustness.py --readme              # print README's block from the JSON

Accuracy and epochs are deterministic (fixed seeds, one thread); seconds depend on the machine's load,
which is written into the JSON (load average before and after).
"""
from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import json  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks._peer_utils import peer, skip_message  # noqa: E402
from benchmarks.common import load_average, machine_info, write_json  # noqa: E402
from examples.common import fraction_in, nonnegative_int, positive_int  # noqa: E402
from torchsso2 import KFACPreconditioner, SecondOrderOptimizer  # noqa: E402
from torchsso2.optim.skips import NonFiniteError  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "kfac_robustness.json"
DEFAULT_PLOT = ROOT / "docs" / "kfac_robustness.png"
LRS = (0.01, 0.03, 0.1)
DAMPINGS = (1e-3, 1e-2, 1e-1)
INTERVALS = ((10, 100), (2, 20), (1, 1))
SCALINGS = ("standardize", "pixel16")
OPTIMIZERS = ("sgd", "adam", "kfac", "kfac_adaptive", "kfac_preconditioner", "kfac_pytorch")
#: the drop-in and its original: SGD with momentum, preconditioned at kfac_pytorch's defaults
DROP_INS = ("kfac_preconditioner", "kfac_pytorch")
#: the grid optimizers with an lr × damping × intervals grid
FIXED = ("kfac",) + DROP_INS
#: a run diverged when a batch loss exceeds this multiple of the first batch loss (a transient
#: spike of Adam at lr 0.1 reaches 2.7×; the blow-ups of unstable runs reach 1e7× or overflow)
DIVERGED_LOSS_RATIO = 10.0
#: the plot wraps its panels (one per optimizer and intervals) to at most this many a row
PANELS_PER_ROW = 5


def load_data(split_seed: int = 0, standardize: bool = True) -> Dict[str, Tensor]:
    """Digits, 1437 / 360 stratified split; features standardized with the training statistics
    (``standardize=True``) or divided by 16 (pixels in [0, 1])."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    ds = load_digits()
    x = torch.tensor(ds.data, dtype=torch.float32)
    y = torch.tensor(ds.target, dtype=torch.long)
    tr, te = train_test_split(list(range(len(y))), test_size=0.2, random_state=split_seed, stratify=ds.target)
    tr, te = torch.tensor(tr), torch.tensor(te)
    mean, std = (x[tr].mean(0), x[tr].std(0).clamp_min(1e-3)) if standardize else (0.0, 16.0)
    return {"x_train": (x[tr] - mean) / std, "y_train": y[tr], "x_test": (x[te] - mean) / std, "y_test": y[te]}


class PreconditionedSGD:
    """``SGD(lr, momentum=0.9)`` with a kfac_pytorch-style preconditioner: ``step()`` after the
    user's backward runs ``preconditioner.step()`` (the gradients replaced by the preconditioned
    ones), then the SGD step, as kfac_pytorch's examples do."""

    def __init__(self, sgd: torch.optim.SGD, preconditioner: Any) -> None:
        self.sgd, self.preconditioner = sgd, preconditioner

    def zero_grad(self) -> None:
        self.sgd.zero_grad()

    def step(self) -> None:
        self.preconditioner.step()
        self.sgd.step()

    @property
    def num_skipped(self) -> int:
        """Steps the preconditioner skipped (non-finite gradients; torchsso2's drop-in counts them)."""
        return int(getattr(self.preconditioner, "num_skipped", 0))


def kfac_pytorch_class() -> Any:
    """kfac_pytorch's ``KFACPreconditioner`` (:func:`benchmarks._peer_utils.peer`), or None when it
    is not installed (or disabled for tests)."""
    module = peer("kfac_pytorch")
    return None if module is None else module.KFACPreconditioner


def make_optimizer(name: str, model: nn.Module, lr: Optional[float], damping: Optional[float], seed: int,
                   intervals: Sequence[int]) -> Any:
    """The optimizer of one grid point (``lr`` is unused by ``kfac_adaptive``, ``damping`` by SGD/Adam)."""
    if name in DROP_INS:
        cls = KFACPreconditioner if name == "kfac_preconditioner" else kfac_pytorch_class()
        if cls is None:
            raise RuntimeError(skip_message("kfac_pytorch"))
        pre = cls(model, factor_update_steps=intervals[0], inv_update_steps=intervals[1], damping=damping, lr=lr)
        return PreconditionedSGD(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), pre)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    kw: Dict[str, Any] = dict(approx="kfac", damping=damping, momentum=0.9, seed=seed,
                              curv_update_interval=intervals[0], inv_update_interval=intervals[1])
    if name == "kfac_adaptive":
        kw.update(use_adaptive_learning_rate=True, use_adaptive_momentum=True, adaptive_damping=True)
    else:
        kw["lr"] = lr
    return SecondOrderOptimizer(model, **kw)


def train(name: str, lr: Optional[float], damping: Optional[float], seed: int, data: Dict[str, Tensor], epochs: int,
          batch_size: int, target: float, intervals: Sequence[int]) -> Dict[str, Any]:
    """One run of ``epochs`` epochs; the epoch and training seconds at which the test accuracy
    first reaches ``target`` (None if never), the final accuracy and loss, and divergence."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = make_optimizer(name, model, lr, damping, seed, intervals)
    gen = torch.Generator().manual_seed(seed)
    x, y = data["x_train"], data["y_train"]
    reached: Optional[int] = None
    reached_s: Optional[float] = None
    acc = loss_value = float("nan")
    batch_losses: List[float] = []
    seconds = 0.0
    stalled = False
    for epoch in range(1, epochs + 1):
        perm = torch.randperm(len(y), generator=gen)
        start = time.perf_counter()
        for i in range(0, len(y) - batch_size + 1, batch_size):
            idx = perm[i:i + batch_size]

            def closure() -> Any:
                opt.zero_grad()
                out = model(x[idx])
                loss = F.cross_entropy(out, y[idx])
                loss.backward()
                return loss, out

            try:
                if isinstance(opt, SecondOrderOptimizer):
                    loss, _ = opt.step(closure)
                else:
                    loss, _ = closure()
                    opt.step()
            except NonFiniteError:  # max_consecutive_skips skipped steps in a row: the run diverged
                stalled = True
                break
            batch_losses.append(float(loss.detach()))
        seconds += time.perf_counter() - start
        if stalled:
            acc = loss_value = float("nan")
            break
        # evaluation in eval mode: kfac_pytorch records every training-mode forward, no_grad or not, into its
        # input factors (docs/kfac.md); this MLP computes the same in either mode
        model.eval()
        with torch.no_grad():
            acc = float((model(data["x_test"]).argmax(1) == data["y_test"]).float().mean())
            loss_value = float(F.cross_entropy(model(x), y))
        model.train()
        if reached is None and acc >= target:
            reached, reached_s = epoch, seconds
    finite = not stalled and all(math.isfinite(v) for v in batch_losses + [loss_value])
    ratio = max(batch_losses) / batch_losses[0] if finite and batch_losses and batch_losses[0] > 0 else math.inf
    return {"seed": seed, "reached_epoch": reached, "seconds_to_target": reached_s, "final_accuracy": acc,
            "final_train_loss": loss_value if math.isfinite(loss_value) else None, "train_seconds": seconds,
            "max_batch_loss_ratio": ratio if math.isfinite(ratio) else None,
            "first_batch_loss": batch_losses[0] if batch_losses else None,
            "diverged": not finite or ratio > DIVERGED_LOSS_RATIO or loss_value >= batch_losses[0],
            "skipped": int(getattr(opt, "num_skipped", 0)),
            "final_damping": getattr(opt, "damping", None)}


def summarize(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Medians over seeds; a never-reached seed counts as infinitely many epochs and seconds."""
    epochs = [r["reached_epoch"] if r["reached_epoch"] is not None else math.inf for r in runs]
    secs = [r["seconds_to_target"] if r["seconds_to_target"] is not None else math.inf for r in runs]
    med, med_s = statistics.median(epochs), statistics.median(secs)
    losses = [r["final_train_loss"] for r in runs]
    return {"reached": math.isfinite(med), "median_epochs": med if math.isfinite(med) else None,
            "median_seconds": med_s if math.isfinite(med_s) else None,
            "median_final_accuracy": statistics.median(r["final_accuracy"] for r in runs),
            "min_final_accuracy": min(r["final_accuracy"] for r in runs),
            "max_final_train_loss": max(losses) if all(v is not None for v in losses) else None,
            "diverged": any(r["diverged"] for r in runs),
            "skipped": sum(r["skipped"] for r in runs)}


def grid_points(optimizers: Sequence[str], intervals: Sequence[Tuple[int, int]],
                adaptive_intervals: Sequence[Tuple[int, int]]) -> List[Dict[str, Any]]:
    """The grid points (without runs) in table order."""
    points: List[Dict[str, Any]] = []
    for name in optimizers:
        if name in ("sgd", "adam"):
            points += [dict(optimizer=name, lr=lr, damping=None, intervals=None) for lr in LRS]
        elif name in FIXED:
            points += [dict(optimizer=name, lr=lr, damping=d, intervals=list(iv))
                       for iv in intervals for lr in LRS for d in DAMPINGS]
        else:
            points += [dict(optimizer=name, lr=None, damping=d, intervals=list(iv))
                       for iv in adaptive_intervals for d in DAMPINGS]
    return points


def _g(v: Optional[float]) -> str:
    return "-" if v is None else format(v, "g")


def _label(p: Dict[str, Any]) -> str:
    iv = p.get("intervals")
    return p["optimizer"] if iv is None else f"{p['optimizer']} {iv[0]}/{iv[1]}"


def table_row(p: Dict[str, Any]) -> str:
    s = p["summary"]
    loss = s["max_final_train_loss"]
    return (f"| {p['scaling']} | {_label(p)} | {_g(p['lr'])} | {_g(p['damping'])} | {'yes' if s['reached'] else 'no'} "
            f"| {_g(s['median_epochs'])} | {'-' if s['median_seconds'] is None else format(s['median_seconds'], '.2f')} "
            f"| {s['median_final_accuracy']:.3f} | {'nan' if loss is None else format(loss, '.3g')} "
            f"| {'yes' if s['diverged'] else 'no'} |")


TABLE_HEAD = ["| inputs | optimizer | lr | damping | reached 97% | median epochs | median s to 97% | median final acc "
              "| max final loss | diverged |", "|---|---|---|---|---|---:|---:|---:|---:|---|"]


def format_table(points: List[Dict[str, Any]]) -> str:
    """Every point as one Markdown row."""
    return "\n".join(TABLE_HEAD + [table_row(p) for p in points])


def format_tables(report: Dict[str, Any]) -> str:
    """docs/results.md's section (:mod:`benchmarks.run`): README's summary, then every point as a row."""
    return readme_block(report) + "\n\n" + format_table(report["points"])


def counts(points: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per input scaling and optimizer (K-FAC: per intervals): points reaching the target, diverged
    points, and the best and median (over reaching points) epochs and seconds."""
    groups: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["scaling"], _label(p)), []).append(p)
    out = []
    for (scaling, label), ps in groups.items():
        ok = [p["summary"] for p in ps if p["summary"]["reached"]]
        ep = [s["median_epochs"] for s in ok]
        sec = [s["median_seconds"] for s in ok]
        out.append(dict(scaling=scaling, optimizer=label, points=len(ps), reached=len(ok),
                        diverged=sum(p["summary"]["diverged"] for p in ps),
                        best_epochs=min(ep) if ep else None, median_epochs=statistics.median(ep) if ep else None,
                        best_seconds=min(sec) if sec else None, median_seconds=statistics.median(sec) if sec else None))
    return out


def readme_block(report: Dict[str, Any]) -> str:
    """README's K-FAC robustness table: per input scaling and optimizer, how many grid points
    reach the target, how many diverge, and their epochs and seconds to the target."""
    cfg = report["config"]
    lines = ["| inputs | optimizer (intervals) | points reaching 97% | diverged | epochs to 97% (best / median) "
             "| s to 97% (best / median) |", "|---|---|---:|---:|---:|---:|"]
    for c in report["counts"]:
        def pair(a: Optional[float], b: Optional[float], fmt: str) -> str:
            return "-" if a is None else f"{format(a, fmt)} / {format(b, fmt)}"
        lines.append(f"| {c['scaling']} | {c['optimizer']} | {c['reached']}/{c['points']} | {c['diverged']} "
                     f"| {pair(c['best_epochs'], c['median_epochs'], 'g')} "
                     f"| {pair(c['best_seconds'], c['median_seconds'], '.2f')} |")
    load = report.get("load_average_before")
    lines.append("")
    lines.append(f"Median of {len(cfg['seeds'])} seeds, at most {cfg['epochs']} epochs, batch {cfg['batch_size']}, "
                 f"one thread; seconds are training time only"
                 + (f" (load average {load[0]:.1f} when it started)" if load else "") + ".")
    return "\n".join(lines)


def plot(report: Dict[str, Any], path: Path) -> None:
    """Per input scaling (rows of panels, wrapped at :data:`PANELS_PER_ROW`): K-FAC fixed (lr ×
    damping) per intervals, adaptive (intervals × damping), SGD/Adam (optimizer × lr), then the
    drop-in and kfac_pytorch (lr × damping) per intervals; cells: median epochs / seconds to the
    target (grey: not reached, red: diverged)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["points"]
    scalings = list(dict.fromkeys(p["scaling"] for p in points))
    panels: List[Tuple[str, List[Dict[str, Any]], List[str], List[str], Any, Any]] = []

    def fixed_panels(name: str, title: str) -> None:
        for iv in dict.fromkeys(tuple(p["intervals"]) for p in points if p["optimizer"] == name):
            panels.append((f"{title} {iv[0]}/{iv[1]}", [], [f"lr {lr:g}" for lr in LRS],
                           [f"λ {d:g}" for d in DAMPINGS],
                           lambda p, iv=iv, name=name: p["optimizer"] == name and tuple(p["intervals"]) == iv,
                           lambda p: (LRS.index(p["lr"]), DAMPINGS.index(p["damping"]))))

    fixed_panels("kfac", "K-FAC fixed")
    aivs = list(dict.fromkeys(tuple(p["intervals"]) for p in points if p["optimizer"] == "kfac_adaptive"))
    if aivs:
        panels.append(("K-FAC adaptive", [], [f"{a}/{b}" for a, b in aivs], [f"λ₀ {d:g}" for d in DAMPINGS],
                       lambda p: p["optimizer"] == "kfac_adaptive",
                       lambda p: (aivs.index(tuple(p["intervals"])), DAMPINGS.index(p["damping"]))))
    base = [n for n in ("sgd", "adam") if any(p["optimizer"] == n for p in points)]
    if base:
        panels.append(("SGD / Adam", [], base, [f"lr {lr:g}" for lr in LRS],
                       lambda p: p["optimizer"] in base,
                       lambda p: (base.index(p["optimizer"]), LRS.index(p["lr"]))))
    fixed_panels("kfac_preconditioner", "KFACPreconditioner + SGD")
    fixed_panels("kfac_pytorch", "kfac_pytorch + SGD")
    # one figure row per input scaling and at most PANELS_PER_ROW panels a row (wrapped)
    wrap = -(-len(panels) // PANELS_PER_ROW)
    ncols = -(-len(panels) // wrap)
    fig, axes = plt.subplots(len(scalings) * wrap, ncols, figsize=(3.1 * ncols, 2.8 * len(scalings) * wrap),
                             squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    epochs = report["config"]["epochs"]
    for r, scaling in enumerate(scalings):
        for c, (title, _, rows, cols, select, cell) in enumerate(panels):
            ax = axes[r * wrap + c // ncols][c % ncols]
            ax.set_visible(True)
            grid = [[float("nan")] * len(cols) for _ in rows]
            text = [[""] * len(cols) for _ in rows]
            for p in points:
                if p["scaling"] != scaling or not select(p):
                    continue
                i, j = cell(p)
                s = p["summary"]
                if s["diverged"]:
                    grid[i][j] = -1.0
                    text[i][j] = "diverged" + (f"\n(97% at {s['median_epochs']:g} ep)" if s["reached"] else "")
                elif s["reached"]:
                    grid[i][j] = s["median_epochs"]
                    text[i][j] = f"{s['median_epochs']:g} ep\n{s['median_seconds']:.2f} s"
                else:
                    text[i][j] = f"no\n{s['median_final_accuracy']:.3f}"
            cmap = matplotlib.colormaps["viridis_r"].with_extremes(bad="#d0d0d0", under="#e06060")
            ax.imshow(grid, cmap=cmap, vmin=0, vmax=epochs, aspect="auto")
            for i in range(len(rows)):
                for j in range(len(cols)):
                    ax.text(j, i, text[i][j], ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(cols)), cols, fontsize=7)
            ax.set_yticks(range(len(rows)), rows, fontsize=7)
            ax.set_title(f"{title}\n({scaling})", fontsize=8)
    fig.suptitle(f"Digits MLP, batch {report['config']['batch_size']}: epochs / training seconds to "
                 f"{report['config']['target']:.0%} test accuracy (median of {len(report['config']['seeds'])} seeds; "
                 f"grey: not reached, with the final accuracy; red: a seed diverged)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # room for the title
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _intervals(text: str) -> Tuple[int, int]:
    try:
        a, b = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"intervals must look like CURV/INV (e.g. 10/100), got {text!r}") from None
    return a, b


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/kfac_robustness.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=nonnegative_int, nargs="+", default=None, help="training seeds (default: 0 1 2; --quick 0)")
    p.add_argument("--epochs", type=positive_int, default=None, help="epochs per run (default: 60; --quick 2)")
    p.add_argument("--batch-size", type=positive_int, default=512, help="batch size (default: 512)")
    p.add_argument("--target", type=fraction_in(0, 1, low_open=True), default=0.97, help="test accuracy to reach (default: 0.97)")
    p.add_argument("--scalings", nargs="+", default=list(SCALINGS), choices=SCALINGS,
                   help="input scalings (default: both)")
    p.add_argument("--intervals", type=_intervals, nargs="+", default=list(INTERVALS), metavar="CURV/INV",
                   help="K-FAC fixed curv_update_interval/inv_update_interval (default: 10/100 2/20 1/1)")
    p.add_argument("--adaptive-intervals", type=_intervals, nargs="+", default=[(1, 1), (10, 100)],
                   metavar="CURV/INV", help="intervals of adaptive K-FAC (default: 1/1 10/100)")
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS, help='optimizers of the grid (default: all)')
    p.add_argument("--quick", action="store_true",
                   help="smoke run: seed 0, 2 epochs, standardized inputs, intervals 10/100 only; "
                        "writes files only where --json / --plot say")
    p.add_argument("--json", type=Path, default=None, help=f"output JSON (default: {DEFAULT_JSON})")
    p.add_argument("--plot", type=Path, default=None, help=f"output plot (default: {DEFAULT_PLOT})")
    p.add_argument("--readme", action="store_true", help="print README's block from the JSON and exit")
    args = p.parse_args(argv)
    if args.seeds is None:
        args.seeds = [0] if args.quick else [0, 1, 2]
    if args.epochs is None:
        args.epochs = 2 if args.quick else 60
    if args.quick:  # what the user gave wins; the rest of --quick's smaller grid
        args.scalings = ["standardize"] if args.scalings == list(SCALINGS) else args.scalings
        args.intervals = [(10, 100)] if args.intervals == list(INTERVALS) else args.intervals
        args.adaptive_intervals = [(10, 100)] if args.adaptive_intervals == [(1, 1), (10, 100)] else args.adaptive_intervals
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    json_path = args.json or DEFAULT_JSON
    if args.readme:
        print(readme_block(json.loads(Path(json_path).read_text())))
        return 0
    torch.set_num_threads(1)
    logging.getLogger("torchsso2").setLevel(logging.ERROR)  # skipped steps are counted in the table instead
    load_before = load_average()
    optimizers = list(args.optimizers)
    if "kfac_pytorch" in optimizers and kfac_pytorch_class() is None:
        print(f"kfac_pytorch skipped: {skip_message('kfac_pytorch')}", flush=True)
        optimizers.remove("kfac_pytorch")
    points: List[Dict[str, Any]] = []
    print("\n".join(TABLE_HEAD), flush=True)
    with warnings.catch_warnings():  # the filter ends with the runs (main() is also called in-process)
        # kfac_pytorch registers full backward hooks on modules whose inputs need no gradient: torch warns each run
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for scaling in args.scalings:
            data = load_data(standardize=scaling == "standardize")
            for point in grid_points(optimizers, args.intervals, args.adaptive_intervals):
                runs = [train(point["optimizer"], point["lr"], point["damping"], s, data, args.epochs,
                              args.batch_size, args.target, point["intervals"] or (1, 1)) for s in args.seeds]
                points.append(dict(point, scaling=scaling, runs=runs, summary=summarize(runs)))
                print(table_row(points[-1]), flush=True)
    kfac = [p for p in points if p["optimizer"] == "kfac"]
    report = {"machine": machine_info(), "load_average_before": load_before, "load_average_after": load_average(),
              "config": {"seeds": args.seeds, "epochs": args.epochs, "batch_size": args.batch_size,
                         "target": args.target, "scalings": args.scalings,
                         "optimizers": optimizers, "intervals": [list(iv) for iv in args.intervals],
                         "adaptive_intervals": [list(iv) for iv in args.adaptive_intervals],
                         "model": "MLP 64-128-10", "data": "digits 1437/360 (stratified, seed 0)",
                         "command": "OMP_NUM_THREADS=1 python benchmarks/kfac_robustness.py" + (" --quick" if args.quick else "")},
              "points": points, "counts": [],
              "kfac_reached": sum(p["summary"]["reached"] for p in kfac), "kfac_points": len(kfac)}
    report["counts"] = counts(points)
    # a --quick run writes only where it is told to (never over the published results)
    written = []
    if not args.quick or args.json is not None:
        write_json(json_path, report)
        written.append(str(json_path))
    if not args.quick or args.plot is not None:
        plot(report, args.plot or DEFAULT_PLOT)
        written.append(str(args.plot or DEFAULT_PLOT))
    print()
    print(readme_block(report))
    print(f"\nwrote {' and '.join(written) or 'nothing (--quick without --json/--plot)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
