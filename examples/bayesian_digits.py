"""Bayesian deep learning on scikit-learn's digits: VI (diag = VOGN, kfac = noisy K-FAC) vs SGD / Adam.

Trains the same MLP (64-64-10) four ways, then compares the predictive distributions on the
test set — accuracy, NLL, ECE, Brier — saves reliability diagrams, and checks whether each
model is more uncertain (higher predictive entropy) on out-of-distribution inputs: the test
digits rotated by 90°, flipped left-right, and uniform noise images.

Examples::

    python examples/bayesian_digits.py                          # all four methods, 10 epochs (~20 s)
    python examples/bayesian_digits.py --methods vi-diag adam --epochs 5 --out-dir /tmp/rel   # default: <tmp>/torchsso2_bayesian_digits
    python examples/bayesian_digits.py --temperature 1          # the untempered posterior

The VI posterior is ``q(θ) = N(μ, P⁻¹)`` with ``P = (N/T)·C + δ·I`` (``C``: Fisher estimate,
``δ``: prior precision, ``T``: temperature). ``--temperature T`` < 1 is a "cold" posterior,
implemented by passing ``dataset_size = N / T`` to :class:`torchsso2.VIOptimizer` (the
likelihood raised to 1/T). On this small dataset the untempered posterior (T = 1) is
under-confident and less accurate (see docs/benchmarks.md); T = 0.1 is the default.
The predictions of the VI models are Bayesian model averages over ``--mc-samples`` weight samples.
"""
from __future__ import annotations

import argparse
import tempfile
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from torchsso2.distributed import shutdown  # noqa: E402
from examples.common import (process_rank, world_size, DEFAULT_LR, Digits, add_common_args, fit, load_digits_data,  # noqa: E402
                             launch_note, make_model, make_optimizer, num_batches, predict_probs, progress_bar,
                             setup_run)
from torchsso2 import VIOptimizer, metrics  # noqa: E402

METHODS = ("sgd", "adam", "vi-diag", "vi-kfac")

#: VIOptimizer settings used for both shapes: the library's defaults (docs/defaults.md) except lr
#: (0.1, the top of the range the defaults train in; 10 epochs of batch 32 on this split:
#: vi-diag 97.1% / NLL 0.108 / ECE 1.1%, vi-kfac 97.3% / 0.098 / 2.3%, seed 0)
VI_DEFAULTS = dict(lr=0.1, prior_precision=1.0, ema_decay=0.999, momentum=0.9, num_mc_samples=1)


#: the default output folder: under the system's temporary directory, not the current one
DEFAULT_OUT_DIR = Path(tempfile.gettempdir()) / "torchsso2_bayesian_digits"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python examples/bayesian_digits.py",
        description="Variational inference with torchsso2.VIOptimizer (diag / kfac) vs SGD and Adam point "
        "estimates on scikit-learn's digits: accuracy / NLL / ECE / Brier table, reliability diagrams, and an "
        "out-of-distribution predictive-entropy check.",
    )
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="default: all four")
    p.add_argument("--epochs", type=int, default=10, help="default 10")
    p.add_argument("--batch-size", type=int, default=32, help="default 32")
    p.add_argument("--hidden", type=int, nargs="+", default=[64], metavar="H", help="MLP hidden sizes (default 64)")
    p.add_argument("--vi-lr", type=float, default=VI_DEFAULTS["lr"], help="VI learning rate (default 0.1)")
    p.add_argument("--prior-precision", type=float, default=VI_DEFAULTS["prior_precision"],
                   help="VI prior precision δ (default 1)")
    p.add_argument("--temperature", type=float, default=0.1,
                   help="posterior temperature T: dataset_size = N / T (default 0.1; 1 = untempered)")
    p.add_argument("--ema-decay", type=float, default=VI_DEFAULTS["ema_decay"], help="VI curvature EMA (default 0.999)")
    p.add_argument("--mc-samples", type=int, default=32, help="posterior samples for predictions (default 32)")
    p.add_argument("--train-mc-samples", type=int, default=1, help="weight samples per VI step (default 1)")
    p.add_argument("--n-bins", type=int, default=15, help="ECE / reliability-diagram bins (default 15)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR,
                   help=f"where the reliability diagrams (PNG) and results.json go (default {DEFAULT_OUT_DIR}, "
                   "outside the working directory)")
    add_common_args(p)
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.mc_samples < 1 or args.temperature <= 0:
        p.error("--epochs, --batch-size, --mc-samples must be >= 1 and --temperature > 0")
    return args


def ood_sets(x_test: Tensor, seed: int) -> Dict[str, Tensor]:
    """Out-of-distribution inputs built from the test digits: rotated 90°, flipped left-right, uniform noise."""
    gen = torch.Generator().manual_seed(seed + 1)
    return {
        "rotated90": torch.rot90(x_test, 1, dims=(2, 3)),
        "flipped": torch.flip(x_test, dims=(3,)),
        "noise": torch.rand(x_test.shape, generator=gen),
    }


def make_vi(method: str, model: nn.Module, n_train: int, args: argparse.Namespace) -> VIOptimizer:
    return VIOptimizer(model, dataset_size=max(1, round(n_train / args.temperature)), lr=args.vi_lr,
                       approx=method.split("-", 1)[1], curvature="fisher_mc",
                       prior_precision=args.prior_precision, ema_decay=args.ema_decay, momentum=0.9,
                       num_mc_samples=args.train_mc_samples, seed=args.seed)


def train_method(method: str, data: Digits, args: argparse.Namespace, show_progress: bool
                 ) -> tuple[nn.Module, torch.optim.Optimizer, float]:
    """Train one method from the same initialization; returns (model, optimizer, training seconds)."""
    gen = setup_run(args)  # same init and batch order for every method
    model = make_model("mlp", tuple(args.hidden))
    if method.startswith("vi-"):
        opt: torch.optim.Optimizer = make_vi(method, model, len(data.y_train), args)
    else:
        opt = make_optimizer(method, model, DEFAULT_LR[method])
    bar = progress_bar(args.epochs * num_batches(len(data.y_train), args.batch_size), method, not show_progress)
    start = time.perf_counter()
    fit(model, opt, data, args.epochs, args.batch_size, gen, progress=bar)
    bar.close()
    return model, opt, time.perf_counter() - start


def predictive(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, num_samples: int, seed: int) -> Tensor:
    """Softmax of the point estimate, or the VI Bayesian model average over ``num_samples`` samples."""
    if isinstance(opt, VIOptimizer):
        model.eval()
        return opt.predict(x, num_samples=num_samples, generator=torch.Generator().manual_seed(seed))
    return predict_probs(model, x)


def run(args: argparse.Namespace) -> Dict[str, Any]:
    if world_size() > 1:
        dropped = [m for m in args.methods if not m.startswith("vi-")]
        args.methods = [m for m in args.methods if m.startswith("vi-")]
        if not args.methods:
            raise SystemExit("under mpiexec/torchrun only the vi-* methods run data-parallel")
        if dropped and process_rank() == 0:
            print(f"data-parallel run: skipping the single-process baselines {dropped}", flush=True)
    if process_rank() != 0:  # only rank 0 reports and writes files
        args.no_progress = True
        sys.stdout = open(os.devnull, "w")
        args.out_dir = Path(os.devnull).parent / "tmp" / f"bayesian_digits_rank{process_rank()}"
    data = load_digits_data()
    if world_size() > 1:
        print(f"data-parallel run{launch_note()}: methods {', '.join(args.methods)}", flush=True)
    ood = ood_sets(data.x_test, args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {}
    reliability = {}
    for method in args.methods:
        model, opt, seconds = train_method(method, data, args, not args.no_progress)
        probs = predictive(model, opt, data.x_test, args.mc_samples, args.seed)
        scores = metrics.evaluate(probs, data.y_test, n_bins=args.n_bins)
        reliability[method] = metrics.reliability_diagram_data(probs, data.y_test, n_bins=args.n_bins)
        ent_test = float(metrics.predictive_entropy(probs).mean())
        ent_ood = {name: float(metrics.predictive_entropy(
            predictive(model, opt, x, args.mc_samples, args.seed)).mean()) for name, x in ood.items()}
        results[method] = {**scores, "train_seconds": seconds, "entropy_test": ent_test, "entropy_ood": ent_ood,
                           "ood_entropy_higher": {k: v > ent_test for k, v in ent_ood.items()}}
        print(f"{method:8s} trained in {seconds:5.1f} s: accuracy {100 * scores['accuracy']:.2f}%", flush=True)

    from torchsso2.plotting import save_reliability_diagram

    figures = [str(save_reliability_diagram(
        reliability, args.out_dir / "reliability_digits.png",
        title=f"digits MLP, {args.epochs} epochs (VI: T={args.temperature:g}, {args.mc_samples} samples)"))]
    for method, rd in reliability.items():
        figures.append(str(save_reliability_diagram(rd, args.out_dir / f"reliability_{method}.png", title=method)))

    print()
    print("| method | accuracy | NLL | ECE | Brier | train s |")
    print("|---|---:|---:|---:|---:|---:|")
    for m, r in results.items():
        print(f"| {m} | {100 * r['accuracy']:.2f}% | {r['nll']:.4f} | {100 * r['ece']:.2f}% | {r['brier']:.4f} | "
              f"{r['train_seconds']:.1f} |")
    print()
    names = list(ood)
    print("mean predictive entropy (nats; log 10 = 2.303 is the maximum), OOD vs test digits:")
    print("| method | test | " + " | ".join(names) + " | OOD higher? |")
    print("|---|---:|" + "---:|" * len(names) + "---|")
    for m, r in results.items():
        higher = r["ood_entropy_higher"]
        verdict = "yes (all)" if all(higher.values()) else \
            ("no (" + ", ".join(k for k, v in higher.items() if not v) + " not higher)")
        print(f"| {m} | {r['entropy_test']:.3f} | " + " | ".join(f"{r['entropy_ood'][k]:.3f}" for k in names)
              + f" | {verdict} |")
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "results": results, "figures": figures}
    (args.out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {', '.join(figures)} and {args.out_dir / 'results.json'}")
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(parse_args(argv))
    shutdown()  # under torchrun: every rank finishes before the process group goes
    return 0


if __name__ == "__main__":
    sys.exit(main())
