"""Bayesian deep learning on scikit-learn's digits: VI (diag = VOGN, kfac = noisy K-FAC) vs IVON / SGD / Adam.

Trains the same MLP (64-64-10) several ways, then compares the predictive distributions on the
test set — accuracy, NLL, ECE, Brier — saves reliability diagrams, and checks whether each
model is more uncertain (higher predictive entropy) on out-of-distribution inputs: the test
digits rotated by 90°, flipped left-right, uniform noise images and Gaussian noise images (with
the test pixels' mean and std). The per-example entropies of the test digits and of each OOD set
are drawn as box plots, one panel per method (``--entropy-plot``, default
``<out-dir>/ood_entropy.png``).

IVON (``pip install ivon-opt``; ``ivon.IVON(params, lr=--ivon-lr, ess=N)``, its other arguments at
their defaults) is one of the methods when ``import ivon`` works; it predicts with the Bayesian
model average of ``--mc-samples`` samples, as VI does.

Examples::

    python examples/bayesian_digits.py                          # all methods, 10 epochs (~20 s)
    python examples/bayesian_digits.py --methods vi-diag adam --epochs 5 --out-dir /tmp/rel   # default: <tmp>/torchsso2_bayesian_digits
    python examples/bayesian_digits.py --temperature 1          # the untempered posterior

The VI posterior is ``q(θ) = N(μ, P⁻¹)`` with ``P = (N/T)·C + δ·I`` (``C``: Fisher estimate,
``δ``: prior precision, ``T``: temperature). ``--temperature T`` < 1 is a "cold" posterior,
implemented by passing ``dataset_size = N / T`` to :class:`torchsso2.VIOptimizer` (the
likelihood raised to 1/T). T = 0.1 is the default: on this split (seed 0, the default 10 epochs)
it gives vi-diag 97.3% accuracy / NLL 0.101 / ECE 1.15% and vi-kfac 97.8% / 0.099 / 1.15%, the
untempered posterior (T = 1) 97.6% / 0.108 / 2.2% and 96.9% / 0.112 / 1.6%.
The predictions of the VI models are Bayesian model averages over ``--mc-samples`` weight samples.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from torchsso2.distributed import shutdown  # noqa: E402
from examples.common import (DEFAULT_LR, Digits, add_common_args, batches, fit, fraction_in,  # noqa: E402
                             launch_note, load_digits_data, make_model, make_optimizer, num_batches, positive_float,
                             positive_int, predict_probs, process_rank, progress_bar, setup_run, world_size,
                             write_json)
from torchsso2 import VIOptimizer, metrics  # noqa: E402

METHODS = ("sgd", "adam", "vi-diag", "vi-kfac")
#: the methods of ``--methods``: METHODS and IVON (when ivon-opt is installed)
ALL_METHODS = METHODS + ("ivon",)

#: IVON's learning rate in this example (its other arguments at their defaults; ess = N): the value
#: benchmarks/vi.py's grid (0.032, 0.1, 0.32) picks by validation NLL on the digits MLP
IVON_LR = 0.3


def ivon_module() -> Any:
    """``import ivon`` (pip install ivon-opt), or None when it is not installed."""
    try:
        import ivon
    except ImportError:
        return None
    return ivon

#: VIOptimizer settings used for both shapes: the library's defaults (docs/defaults.md) except lr
#: (0.1, the top of the range the defaults train in; 10 epochs of batch 32 on this split:
#: vi-diag 97.3% / NLL 0.101 / ECE 1.15%, vi-kfac 97.8% / 0.099 / 1.15%, seed 0)
#: (``ema_decay`` None: the library's, 0.99999 per step, i.e. per update for diag and ``0.99999**10`` for
#: kfac, whose default curvature interval is 10)
VI_DEFAULTS = dict(lr=0.1, prior_precision=1.0, ema_decay=None, momentum=0.9, num_mc_samples=1)


#: the default output folder: under the system's temporary directory, not the current one
DEFAULT_OUT_DIR = Path(tempfile.gettempdir()) / "torchsso2_bayesian_digits"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python examples/bayesian_digits.py",
        description="Variational inference with torchsso2.VIOptimizer (diag / kfac) vs SGD and Adam point "
        "estimates on scikit-learn's digits: accuracy / NLL / ECE / Brier table, reliability diagrams, and an "
        "out-of-distribution predictive-entropy check.",
    )
    p.add_argument("--methods", nargs="+", choices=ALL_METHODS, default=None,
                   help="default: all (ivon only when installed)")
    p.add_argument("--epochs", type=positive_int, default=10, help="default 10")
    p.add_argument("--batch-size", type=positive_int, default=32, help="default 32")
    p.add_argument("--hidden", type=positive_int, nargs="+", default=[64], metavar="H",
                   help="MLP hidden sizes (default 64)")
    p.add_argument("--vi-lr", type=positive_float, default=VI_DEFAULTS["lr"], help="VI learning rate (default 0.1)")
    p.add_argument("--prior-precision", type=positive_float, default=VI_DEFAULTS["prior_precision"],
                   help="VI prior precision δ > 0 (default 1)")
    p.add_argument("--temperature", type=positive_float, default=0.1,
                   help="posterior temperature T: dataset_size = N / T (default 0.1; 1 = untempered)")
    p.add_argument("--ema-decay", type=fraction_in(0.0, 1.0, high_open=True), default=VI_DEFAULTS["ema_decay"],
                   help="VI curvature EMA decay per update, in [0, 1) (default: the library's, 0.99999 per step)")
    p.add_argument("--mc-samples", type=positive_int, default=32, help="posterior samples for predictions (default 32)")
    p.add_argument("--train-mc-samples", type=positive_int, default=1, help="weight samples per VI step (default 1)")
    p.add_argument("--ivon-lr", type=positive_float, default=IVON_LR, help=f"IVON learning rate (default {IVON_LR:g})")
    p.add_argument("--entropy-plot", type=Path, default=None, metavar="PATH",
                   help="where the OOD predictive-entropy box plots (PNG) go (default <out-dir>/ood_entropy.png)")
    p.add_argument("--n-bins", type=positive_int, default=15, help="ECE / reliability-diagram bins (default 15)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR,
                   help=f"where the reliability diagrams (PNG) and results.json go (default {DEFAULT_OUT_DIR}, "
                   "outside the working directory)")
    add_common_args(p)
    args = p.parse_args(argv)
    if args.methods is None:
        args.methods = [m for m in ALL_METHODS if m != "ivon" or ivon_module() is not None]
    elif "ivon" in args.methods and ivon_module() is None:
        p.error("--methods ivon needs ivon-opt (pip install ivon-opt)")
    return args


def ood_sets(x_test: Tensor, seed: int, gaussian_noise: bool = False) -> Dict[str, Tensor]:
    """Out-of-distribution inputs built from the test digits ``[N, 1, 8, 8]``: rotated 90°, flipped
    left-right, uniform noise in ``[0, 1]``, and (``gaussian_noise=True``, as this example uses)
    Gaussian noise with the test pixels' mean and std; each ``[N, 1, 8, 8]``."""
    gen = torch.Generator().manual_seed(seed + 1)
    sets = {
        "rotated90": torch.rot90(x_test, 1, dims=(2, 3)),
        "flipped": torch.flip(x_test, dims=(3,)),
        "noise": torch.rand(x_test.shape, generator=gen),
    }
    if gaussian_noise:
        sets["gaussian_noise"] = torch.randn(x_test.shape, generator=gen) * x_test.std() + x_test.mean()
    return sets


def make_vi(method: str, model: nn.Module, n_train: int, args: argparse.Namespace) -> VIOptimizer:
    return VIOptimizer(model, dataset_size=max(1, round(n_train / args.temperature)), lr=args.vi_lr,
                       approx=method.split("-", 1)[1],  # the library's default curvature for the shape
                       prior_precision=args.prior_precision, ema_decay=args.ema_decay, momentum=0.9,
                       num_mc_samples=args.train_mc_samples, seed=args.seed)


def train_method(method: str, data: Digits, args: argparse.Namespace, show_progress: bool
                 ) -> tuple[nn.Module, torch.optim.Optimizer, float]:
    """Train one method from the same initialization; returns (model, optimizer, training seconds)."""
    gen = setup_run(args)  # same init and batch order for every method
    model = make_model("mlp", tuple(args.hidden))
    if method == "ivon":
        return train_ivon(model, data, args, gen, show_progress)
    if method.startswith("vi-"):
        opt: torch.optim.Optimizer = make_vi(method, model, len(data.y_train), args)
    else:
        opt = make_optimizer(method, model, DEFAULT_LR[method])
    bar = progress_bar(args.epochs * num_batches(len(data.y_train), args.batch_size), method, not show_progress)
    start = time.perf_counter()
    fit(model, opt, data, args.epochs, args.batch_size, gen, progress=bar)
    bar.close()
    return model, opt, time.perf_counter() - start


def train_ivon(model: nn.Module, data: Digits, args: argparse.Namespace, gen: torch.Generator,
               show_progress: bool) -> tuple[nn.Module, torch.optim.Optimizer, float]:
    """IVON at its defaults except lr (``ess`` = N): each step's loss and gradient at one weight sample."""
    opt = ivon_module().IVON(model.parameters(), lr=args.ivon_lr, ess=len(data.y_train))
    loss_fn = nn.CrossEntropyLoss()
    bar = progress_bar(args.epochs * num_batches(len(data.y_train), args.batch_size), "ivon", not show_progress)
    start = time.perf_counter()
    model.train()
    for _ in range(args.epochs):
        for idx in batches(len(data.y_train), args.batch_size, gen):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                loss_fn(model(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
            bar.update(1)
    bar.close()
    return model, opt, time.perf_counter() - start


def predictive(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, num_samples: int, seed: int) -> Tensor:
    """Softmax of the point estimate, or the Bayesian model average over ``num_samples`` samples (VI, IVON)."""
    if hasattr(opt, "sampled_params") and not isinstance(opt, VIOptimizer):  # IVON
        model.eval()
        with torch.no_grad():
            probs = []
            for _ in range(num_samples):
                with opt.sampled_params():
                    probs.append(torch.softmax(model(x), -1))
        return metrics.bayesian_model_average(torch.stack(probs))
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
    scratch = None  # the other ranks' files go to a directory removed when run() returns (or the process ends)
    if process_rank() != 0:  # only rank 0 reports and writes files
        args.no_progress = True
        sys.stdout = open(os.devnull, "w")
        scratch = tempfile.TemporaryDirectory(prefix=f"bayesian_digits_rank{process_rank()}_")
        args.out_dir, args.entropy_plot = Path(scratch.name), None
    data = load_digits_data()
    if world_size() > 1:
        print(f"data-parallel run{launch_note()}: methods {', '.join(args.methods)}", flush=True)
    ood = ood_sets(data.x_test, args.seed, gaussian_noise=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {}
    reliability = {}
    entropies: Dict[str, Dict[str, Tensor]] = {}
    for method in args.methods:
        model, opt, seconds = train_method(method, data, args, not args.no_progress)
        probs = predictive(model, opt, data.x_test, args.mc_samples, args.seed)
        scores = metrics.evaluate(probs, data.y_test, n_bins=args.n_bins)
        reliability[method] = metrics.reliability_diagram_data(probs, data.y_test, n_bins=args.n_bins)
        entropies[method] = {"test": metrics.predictive_entropy(probs)}
        entropies[method].update({name: metrics.predictive_entropy(predictive(model, opt, x, args.mc_samples, args.seed))
                                  for name, x in ood.items()})
        ent_test = float(entropies[method]["test"].mean())
        ent_ood = {name: float(entropies[method][name].mean()) for name in ood}
        results[method] = {**scores, "train_seconds": seconds, "entropy_test": ent_test, "entropy_ood": ent_ood,
                           "ood_entropy_higher": {k: v > ent_test for k, v in ent_ood.items()}}
        print(f"{method:8s} trained in {seconds:5.1f} s: accuracy {100 * scores['accuracy']:.2f}%", flush=True)

    from torchsso2.plotting import save_reliability_diagram

    figures = [str(save_reliability_diagram(
        reliability, args.out_dir / "reliability_digits.png",
        title=f"digits MLP, {args.epochs} epochs (VI: T={args.temperature:g}, {args.mc_samples} samples)"))]
    for method, rd in reliability.items():
        figures.append(str(save_reliability_diagram(rd, args.out_dir / f"reliability_{method}.png", title=method)))
    figures.append(str(save_entropy_plot(entropies, args.entropy_plot or args.out_dir / "ood_entropy.png",
                                         title=f"digits MLP, {args.epochs} epochs: predictive entropy, test vs OOD")))

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
    write_json(args.out_dir / "results.json", report)
    print(f"\nwrote {', '.join(figures)} and {args.out_dir / 'results.json'}")
    if scratch is not None:
        scratch.cleanup()
    return report


def save_entropy_plot(entropies: Dict[str, Dict[str, Tensor]], path: Path, title: str = "") -> Path:
    """Box plots of per-example predictive entropies: one panel per method, one box per input set.

    Args:
        entropies: ``{method: {input set: [N] entropies (nats)}}``, the same input sets for every method.
        path: the PNG to write (its directory is created).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(entropies)
    sets = list(entropies[methods[0]])
    fig, axes = plt.subplots(1, len(methods), figsize=(2.6 * len(methods) + 1, 3.6), sharey=True, squeeze=False)
    for ax, method in zip(axes[0], methods):
        ax.boxplot([entropies[method][s].detach().cpu().numpy() for s in sets], showfliers=False)
        ax.set_xticks(range(1, len(sets) + 1), sets, rotation=45, ha="right", fontsize=8)
        ax.axhline(float(torch.log(torch.tensor(10.0))), color="grey", lw=0.8, ls="--")
        ax.set_title(method)
    axes[0][0].set_ylabel("predictive entropy (nats; dashed: log 10)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    run(parse_args(argv))
    shutdown()  # under torchrun: every rank finishes before the process group goes
    return 0


if __name__ == "__main__":
    sys.exit(main())
