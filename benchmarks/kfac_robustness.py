"""Robustness of K-FAC's non-adaptive defaults over an (lr × damping) grid, beside SGD and Adam.

The grid of issue 30: the digits MLP 64-128-10 (scikit-learn's 8×8 digits, 1437 train /
360 test, pixels standardized with the training set's mean and std), batch 512,
``SecondOrderOptimizer(model, approx="kfac", lr=lr, damping=damping, momentum=0.9,
curv_update_interval=10, inv_update_interval=100)`` with every other argument at the library
default, lr ∈ {0.01, 0.03, 0.1} × damping ∈ {1e-3, 1e-2, 1e-1}; SGD (momentum 0.9) and Adam
at the same learning rates. Per grid point and seed: the first epoch whose test accuracy
reaches the target (97%), and the final test accuracy and training loss. A point "reaches"
the target when its median seed does.

Usage::

    python benchmarks/kfac_robustness.py --help
    python benchmarks/kfac_robustness.py                # writes benchmarks/results/kfac_robustness.json
    python benchmarks/kfac_robustness.py --seeds 0 --epochs 10 --json /tmp/x.json   # a quick look

Run it with one thread (``OMP_NUM_THREADS=1``; the script also calls ``torch.set_num_threads(1)``).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.common import machine_info
from torchsso2 import SecondOrderOptimizer

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "kfac_robustness.json"
LRS = (0.01, 0.03, 0.1)
DAMPINGS = (1e-3, 1e-2, 1e-1)


def load_data(split_seed: int = 0, standardize: bool = True) -> Dict[str, Tensor]:
    """Digits, 1437 / 360 stratified split, features standardized with the training statistics."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    ds = load_digits()
    x = torch.tensor(ds.data, dtype=torch.float32)
    y = torch.tensor(ds.target, dtype=torch.long)
    tr, te = train_test_split(list(range(len(y))), test_size=0.2, random_state=split_seed, stratify=ds.target)
    tr, te = torch.tensor(tr), torch.tensor(te)
    mean, std = (x[tr].mean(0), x[tr].std(0).clamp_min(1e-3)) if standardize else (0.0, 16.0)
    return {"x_train": (x[tr] - mean) / std, "y_train": y[tr], "x_test": (x[te] - mean) / std, "y_test": y[te]}


def make_optimizer(name: str, model: nn.Module, lr: float, damping: Optional[float], seed: int,
                   intervals: Sequence[int]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    return SecondOrderOptimizer(model, lr=lr, approx="kfac", damping=damping, momentum=0.9, seed=seed,
                                curv_update_interval=intervals[0], inv_update_interval=intervals[1])


def train(name: str, lr: float, damping: Optional[float], seed: int, data: Dict[str, Tensor], epochs: int,
          batch_size: int, target: float, intervals: Sequence[int]) -> Dict[str, Any]:
    """One run; returns the epoch reaching ``target`` (None if never), final accuracy and loss."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = make_optimizer(name, model, lr, damping, seed, intervals)
    gen = torch.Generator().manual_seed(seed)
    x, y = data["x_train"], data["y_train"]
    reached: Optional[int] = None
    acc = loss_value = float("nan")
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        perm = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y) - batch_size + 1, batch_size):
            idx = perm[i:i + batch_size]

            def closure() -> Any:
                opt.zero_grad()
                out = model(x[idx])
                loss = F.cross_entropy(out, y[idx])
                loss.backward()
                return loss, out

            if isinstance(opt, SecondOrderOptimizer):
                opt.step(closure)
            else:
                closure()
                opt.step()
        with torch.no_grad():
            acc = float((model(data["x_test"]).argmax(1) == data["y_test"]).float().mean())
            loss_value = float(F.cross_entropy(model(x), y))
        if reached is None and acc >= target:
            reached = epoch
    return {"seed": seed, "reached_epoch": reached, "final_accuracy": acc, "final_train_loss": loss_value,
            "seconds": time.perf_counter() - start,
            "skipped": int(getattr(opt, "num_skipped", 0))}


def summarize(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Median over seeds; a never-reached seed counts as infinitely many epochs."""
    epochs = [r["reached_epoch"] if r["reached_epoch"] is not None else math.inf for r in runs]
    med = statistics.median(epochs)
    loss = [r["final_train_loss"] for r in runs]
    return {"reached": math.isfinite(med), "median_epochs": med if math.isfinite(med) else None,
            "median_final_accuracy": statistics.median(r["final_accuracy"] for r in runs),
            "max_final_train_loss": max(loss) if all(math.isfinite(v) for v in loss) else None,
            "skipped": sum(r["skipped"] for r in runs)}


def format_table(points: List[Dict[str, Any]]) -> str:
    lines = ["| optimizer | lr | damping | reached 97% | median epochs | median final acc | max final loss |",
             "|---|---|---|---|---|---|---|"]
    for p in points:
        s = p["summary"]
        lines.append(f"| {p['optimizer']} | {p['lr']:g} | {'-' if p['damping'] is None else format(p['damping'], 'g')} "
                     f"| {'yes' if s['reached'] else 'no'} | {s['median_epochs'] if s['reached'] else '-'} "
                     f"| {s['median_final_accuracy']:.3f} | "
                     f"{'nan' if s['max_final_train_loss'] is None else format(s['max_final_train_loss'], '.3f')} |")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/kfac_robustness.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (default: 0 1 2)")
    p.add_argument("--epochs", type=int, default=60, help="epochs per run (default: 60)")
    p.add_argument("--batch-size", type=int, default=512, help="batch size (default: 512)")
    p.add_argument("--target", type=float, default=0.97, help="test accuracy to reach (default: 0.97)")
    p.add_argument("--intervals", type=int, nargs=2, default=[10, 100], metavar=("CURV", "INV"),
                   help="K-FAC curv_update_interval and inv_update_interval (default: 10 100)")
    p.add_argument("--optimizers", nargs="+", default=["sgd", "adam", "kfac"], choices=["sgd", "adam", "kfac"])
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"output JSON (default: {DEFAULT_JSON})")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("torchsso2").setLevel(logging.ERROR)  # skipped steps are counted in the table instead
    data = load_data()
    points: List[Dict[str, Any]] = []
    for name in args.optimizers:
        for lr in LRS:
            for damping in (DAMPINGS if name == "kfac" else (None,)):
                runs = [train(name, lr, damping, s, data, args.epochs, args.batch_size, args.target, args.intervals)
                        for s in args.seeds]
                points.append({"optimizer": name, "lr": lr, "damping": damping, "runs": runs,
                               "summary": summarize(runs)})
                print(format_table(points[-1:]).splitlines()[-1], flush=True)
    kfac = [p for p in points if p["optimizer"] == "kfac"]
    report = {"machine": machine_info(),
              "config": {"seeds": args.seeds, "epochs": args.epochs, "batch_size": args.batch_size,
                         "target": args.target, "intervals": args.intervals, "model": "MLP 64-128-10",
                         "data": "digits 1437/360, standardized"},
              "points": points,
              "kfac_reached": sum(p["summary"]["reached"] for p in kfac), "kfac_points": len(kfac)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print()
    print(format_table(points))
    print(f"\nK-FAC at defaults reaches {args.target:.0%} on {report['kfac_reached']} of {len(kfac)} points; "
          f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
