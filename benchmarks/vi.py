"""VIOptimizer benchmark: step time relative to Adam, and predictive quality on digits (vs IVON if installed).

Two parts, measured in one process:

1. **Step time** of one VI training step (sample weights, closure, curvature, update) for
   ``VIOptimizer`` diag (VOGN, 1 MC sample) and kfac (noisy K-FAC, 1 MC sample; curvature
   and decomposition every step, and every 10 / 100 steps), relative to Adam and SGD on the
   same model and batch in the same run (min and median over repeated windows). The target
   for diag is ≤ 1.3× Adam. IVON (``pip install ivon-opt``) is timed too when ``import ivon`` works.
2. **Predictive quality** on scikit-learn's digits (MLP 64-64-10, the settings of
   ``examples/bayesian_digits.py``): accuracy, NLL, ECE and Brier of the Bayesian model average
   for VI diag / kfac (and IVON), against SGD and Adam point estimates.

Examples::

    python benchmarks/vi.py                  # writes benchmarks/results/vi.json
    python benchmarks/vi.py --quick          # smoke run (no files unless --json)
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (fmt_ratio, load_average, machine_info, machine_line, markdown_table, summarize,  # noqa: E402
                               time_training_steps, try_import, write_json)
from benchmarks.step_overhead import mlp  # noqa: E402
from torchsso2 import VIOptimizer, metrics  # noqa: E402
from torchsso2.optim.vi import shifted_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "vi.json"

#: IVON settings for the digits MLP (small grid on this split; see docs/benchmarks.md)
IVON_LR, IVON_HESS_INIT = 0.5, 0.5

#: prior precision of the timed VI configurations: σ_prior ≈ 0.03, the scale of the initial weights
#: (784-512-512-10: default init std ≈ 0.036). With precision 10 (σ ≈ 0.3) a one-sample K-FAC VI step
#: on mlp784 sampled weights ten times larger than the weights themselves: the loss at the samples
#: grew to 1e29 and 97% of the timed 10/100 steps were skipped as non-finite (a time of skipped
#: steps, not of training); with 1000 every configuration trains without a skipped step
TIMING_PRIOR_PRECISION = 1000.0


# ------------------------------------------------------------------------------------------------
# step timing
# ------------------------------------------------------------------------------------------------
def _vi(model: nn.Module, approx: str, curv: int = 1, inv: int = 1, curvature: str = "fisher_mc") -> VIOptimizer:
    return VIOptimizer(model, dataset_size=10_000, lr=1e-4, approx=approx, prior_precision=TIMING_PRIOR_PRECISION,
                       ema_decay=0.99, num_mc_samples=1, curv_update_interval=curv, inv_update_interval=inv, seed=0,
                       curvature=curvature)


class AdamWithWeightNoise(torch.optim.Adam):
    """Adam that also does what every sampling VI method must do each step: draw ``ε ~ N(0, σ²)`` for
    all P weights, evaluate the closure at ``θ + ε`` and restore ``θ``. Its time over Adam's is
    the floor of a one-sample VI step on this machine (no curvature at all)."""

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


def _timing_specs(ivon_mod: Any) -> List[Tuple[str, int, Any]]:
    specs: List[Tuple[str, int, Any]] = [
        ("sgd", 20, lambda m: torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9)),
        ("adam", 20, lambda m: torch.optim.Adam(m.parameters(), lr=1e-4)),
        ("adam+noise (floor)", 20, lambda m: AdamWithWeightNoise(m.parameters(), lr=1e-4)),
        ("vi-diag", 10, lambda m: _vi(m, "diag")),
        ("vi-diag ef", 10, lambda m: _vi(m, "diag", curvature="empirical_fisher")),
        ("vi-diag 10/10", 20, lambda m: _vi(m, "diag", 10, 10)),
        ("vi-diag 10/100", 100, lambda m: _vi(m, "diag", 10, 100)),
        ("vi-kfac", 10, lambda m: _vi(m, "kfac")),
        ("vi-kfac 10/100", 100, lambda m: _vi(m, "kfac", 10, 100)),
    ]
    if ivon_mod is not None:
        specs.append(("ivon", 20, lambda m: ivon_mod.IVON(m.parameters(), lr=1e-4, ess=10_000, hess_init=0.1)))
    return specs


def _ivon_step(opt: Any, closure: Any) -> None:
    """IVON (and the adam+noise floor) evaluate the loss at sampled weights, then step."""
    with opt.sampled_params(train=True):
        closure()
    opt.step()


def run_timing(args: argparse.Namespace, ivon_mod: Any) -> List[Dict[str, Any]]:
    models = [("digits-mlp", lambda: mlp([64, 64, 10]), (64,), (32, 128))]
    if not args.quick:
        models.append(("mlp784", lambda: mlp([784, 512, 512, 10]), (784,), (128, 512)))
    rows: List[Dict[str, Any]] = []
    for mname, build, shape, batches in models:
        for batch in batches:
            gen = torch.Generator().manual_seed(batch)
            x = torch.randn(batch, *shape, generator=gen)
            y = torch.randint(0, 10, (batch,), generator=gen)
            # build all optimizers, then time them round-robin (one window each per round), so slow
            # drifts of the machine hit every optimizer alike
            runs = []
            for name, window, make in _timing_specs(ivon_mod):
                torch.manual_seed(0)
                model = build()
                opt = make(model)
                step = _ivon_step if hasattr(opt, "sampled_params") and not isinstance(opt, VIOptimizer) else None
                runs.append((name, min(window, 20) if args.quick else window, model, opt, step))
            times: Dict[str, List[float]] = {name: [] for name, *_ in runs}
            for r in range(args.repeats):
                for name, window, model, opt, step in runs:
                    times[name] += time_training_steps(model, opt, x, y, window, 1, step=step,
                                                       warmup=3 if r == 0 else 0)
            base: Dict[str, Tuple[float, float]] = {}
            for name, window, model, opt, step in runs:
                s = summarize(times[name])
                if name in ("sgd", "adam"):
                    base[name] = (s["min_s"], s["median_s"])
                row = {"model": mname, "batch": batch, "optimizer": name, "window_steps": window, **s,
                       "ratio_adam_min": s["min_s"] / base["adam"][0] if "adam" in base else None,
                       "ratio_adam_median": s["median_s"] / base["adam"][1] if "adam" in base else None,
                       "ratio_sgd_min": s["min_s"] / base["sgd"][0] if "sgd" in base else None,
                       "skipped_steps": getattr(opt, "num_skipped", 0)}
                rows.append(row)
                print(f"  {mname} B={batch} {name:15s} {1e3 * s['min_s']:8.2f} ms  ({fmt_ratio(row['ratio_adam_min'])} Adam)",
                      flush=True)
            del runs
    return rows


# ------------------------------------------------------------------------------------------------
# predictive quality on digits
# ------------------------------------------------------------------------------------------------
def train_ivon(ivon_mod: Any, data: Any, args: argparse.Namespace) -> Tuple[nn.Module, Any, float]:
    from examples.common import batches, make_model

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = make_model("mlp", (64,))
    opt = ivon_mod.IVON(model.parameters(), lr=IVON_LR, ess=len(data.y_train), hess_init=IVON_HESS_INIT)
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    for _ in range(args.epochs):
        model.train()
        for idx in batches(len(data.y_train), 32, gen):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                loss_fn(model(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
    return model, opt, time.perf_counter() - start


@torch.no_grad()
def ivon_predict(model: nn.Module, opt: Any, x: torch.Tensor, num_samples: int) -> torch.Tensor:
    model.eval()
    probs = []
    for _ in range(num_samples):
        with opt.sampled_params():
            probs.append(torch.softmax(model(x), -1))
    return torch.stack(probs).mean(0)


def _scores(probs_of: Any, data: Any, ood: Dict[str, torch.Tensor], n_bins: int) -> Tuple[Dict[str, Any], Any]:
    """Metrics of ``probs_of(data.x_test)`` plus the mean predictive entropy on the test digits and on each
    out-of-distribution set (nats), and the reliability-diagram data of the same probabilities."""
    probs = probs_of(data.x_test)
    rel = metrics.reliability_diagram_data(probs, data.y_test, n_bins=n_bins)
    out = {**metrics.evaluate(probs, data.y_test, n_bins=n_bins),
           "entropy_test": float(metrics.predictive_entropy(probs).mean()),
           "entropy_ood": {k: float(metrics.predictive_entropy(probs_of(x)).mean()) for k, x in ood.items()}}
    return out, rel


def run_quality(args: argparse.Namespace, ivon_mod: Any) -> Dict[str, Any]:
    """Accuracy / NLL / ECE / Brier and predictive entropies (test digits vs ``bd.ood_sets``) per method;
    with ``args.plot`` also the reliability diagrams of the same predictions (one PNG: table and figure
    come from the same probabilities)."""
    from examples import bayesian_digits as bd
    from examples.common import load_digits_data

    data = load_digits_data()
    ood = bd.ood_sets(data.x_test, args.seed)
    bargs = bd.parse_args(["--epochs", str(args.epochs), "--seed", str(args.seed), "--no-progress",
                           "--mc-samples", str(args.mc_samples), "--threads", str(args.threads)])
    out: Dict[str, Any] = {}
    reliability: Dict[str, Any] = {}

    def record(name: str, probs_of: Any, seconds: float, plot: bool = True) -> None:
        out[name], rel = _scores(probs_of, data, ood, bargs.n_bins)
        out[name]["train_seconds"] = seconds
        if plot:
            reliability[name] = rel
        print(f"  {name:8s} {100 * out[name]['accuracy']:.2f}%  ({seconds:.1f} s)", flush=True)

    for method in bd.METHODS:
        model, opt, seconds = bd.train_method(method, data, bargs, show_progress=False)
        record(method, lambda x, m=model, o=opt: bd.predictive(m, o, x, args.mc_samples, args.seed), seconds)
    bargs.temperature = 1.0  # the untempered posterior, for reference (IVON below is untempered: ess = N)
    for method in ("vi-diag", "vi-kfac"):
        model, opt, seconds = bd.train_method(method, data, bargs, show_progress=False)
        record(f"{method} T=1", lambda x, m=model, o=opt: bd.predictive(m, o, x, args.mc_samples, args.seed),
               seconds, plot=False)
    if ivon_mod is not None:
        model, opt, seconds = train_ivon(ivon_mod, data, args)
        record("ivon", lambda x, m=model, o=opt: ivon_predict(m, o, x, args.mc_samples), seconds)
    if getattr(args, "plot", None) is not None:
        from torchsso2.plotting import save_reliability_diagram

        save_reliability_diagram(reliability, args.plot,
                                 title=f"digits MLP, {args.epochs} epochs (VI: T=0.1, {args.mc_samples} samples; "
                                 "ECE as in the README table)")
        print(f"wrote {args.plot}")
    return out


def format_tables(report: Dict[str, Any]) -> str:
    lines = [machine_line(report), ""]
    if report["timing"]:
        prior = report["config"].get("timing_prior_precision", 10.0)
        lines.append("Step time (ms per training step; min / median over repeated windows; x Adam = min/min in the "
                     f"same run; VI: 1 MC sample, prior precision {prior:g}; 'c/i' = curvature / decomposition "
                     "intervals, default 1/1; skipped = non-finite steps in the timed windows)")
        rows = [[r["model"], r["batch"], r["optimizer"], f"{1e3 * r['min_s']:.2f}", f"{1e3 * r['median_s']:.2f}",
                 fmt_ratio(r["ratio_adam_min"]), fmt_ratio(r["ratio_adam_median"]), fmt_ratio(r["ratio_sgd_min"]),
                 r.get("skipped_steps", 0)] for r in report["timing"]]
        lines.append(markdown_table(["model", "B", "optimizer", "min ms", "median ms", "x Adam", "x Adam (med)",
                                     "x SGD", "skipped"], rows, "lrlrrrrrr"))
    q = report.get("quality")
    if q:
        c = report["config"]
        lines += ["", f"Digits test set (MLP 64-64-10, {c['epochs']} epochs, batch 32; VI/IVON: Bayesian model "
                  f"average of {c['mc_samples']} samples; VI: prior precision 10, temperature 0.1 unless 'T=1'; IVON: ess = N (T=1), "
                  f"lr {c['ivon_settings']['lr']:g}, hess_init {c['ivon_settings']['hess_init']:g})"]
        sets = sorted({o for v in q.values() for o in v.get("entropy_ood", {})})
        rows = [[k, f"{100 * v['accuracy']:.2f}%", f"{v['nll']:.4f}", f"{100 * v['ece']:.2f}%", f"{v['brier']:.4f}",
                 f"{v['train_seconds']:.1f}",
                 *(f"{x:.3f}" if (x := v.get("entropy_test") if o is None else v.get("entropy_ood", {}).get(o))
                   is not None else "" for o in ([None, *sets] if sets else []))] for k, v in q.items()]
        ent_cols = ["entropy test", *(f"entropy {o}" for o in sets)] if sets else []
        lines.append(markdown_table(["method", "accuracy", "NLL", "ECE", "Brier", "train s", *ent_cols], rows,
                                    "lrrrrr" + "r" * len(ent_cols)))
    for what, why in report["skipped"].items():
        lines.append(f"\nskipped {what}: {why}")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/vi.py",
                                description="VIOptimizer step time vs Adam, and accuracy/NLL/ECE/Brier on digits "
                                "(with IVON when installed).")
    p.add_argument("--quick", action="store_true", help="small windows, 2 repeats, 2 epochs (smoke run)")
    p.add_argument("--repeats", type=int, default=None, help="timed windows per config (default 5; quick 2)")
    p.add_argument("--epochs", type=int, default=None, help="digits epochs (default 10; quick 2)")
    p.add_argument("--mc-samples", type=int, default=None, help="posterior samples for predictions (default 32; quick 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="also save the reliability diagrams of the quality run (the same predictions as its table)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help=f"write the JSON report here (default {DEFAULT_JSON.relative_to(ROOT)}; none with --quick)")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.epochs = args.epochs or (2 if args.quick else 10)
    args.mc_samples = args.mc_samples or (4 if args.quick else 32)
    if not args.quick:
        args.json = args.json or DEFAULT_JSON
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.getLogger("torchsso2").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(args.threads)
    ivon_mod, why = try_import("ivon")
    skipped: Dict[str, str] = {}
    if ivon_mod is None:
        skipped["ivon"] = f"`import ivon` failed ({why}); pip install ivon-opt"
        print(f"IVON comparison skipped: {skipped['ivon']}")
    load_before = load_average()
    start = time.perf_counter()
    timing = [] if args.skip_timing else run_timing(args, ivon_mod)
    quality = None if args.skip_quality else run_quality(args, ivon_mod)
    report = {"machine": machine_info(),
              "config": {"quick": args.quick, "repeats": args.repeats, "epochs": args.epochs,
                         "mc_samples": args.mc_samples, "threads": args.threads, "seed": args.seed,
                         "plot": str(args.plot) if args.plot is not None and quality is not None else None,
                         "ivon": getattr(ivon_mod, "__version__", "installed") if ivon_mod else None,
                         "ivon_settings": {"lr": IVON_LR, "hess_init": IVON_HESS_INIT, "ess": "N_train"},
                         "timing_prior_precision": TIMING_PRIOR_PRECISION,
                         "load_average_before": load_before, "load_average_after": load_average(),
                         "seconds": time.perf_counter() - start},
              "timing": timing, "quality": quality, "skipped": skipped}
    print()
    print(format_tables(report))
    if args.json is not None:
        write_json(args.json, report)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
