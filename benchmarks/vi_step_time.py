"""Step time of VIOptimizer beside Adam, SGD and IVON, measured round-robin in one process.

A *step* is what a training loop pays per batch: ``zero_grad`` + forward + backward + the
optimizer's update (for the sampling methods also drawing the weight noise and evaluating the
closure at the sampled weights). Every variant trains its own copy of the model on the same
batches; the variants take turns step by step (the order rotates every round), so a change in
the machine's load hits all of them alike. Reported: min and median over the timed steps, and
the ratio to Adam (AdamW on the transformer) of both; also the ratio of the means, the cost per step
of a variant whose curvature or decompositions run every k-th step only (min and median show its
plain steps).

Models (1 thread by default, as the targets of issues 27 and 31 are stated):

* ``digits``: MLP 64-128-10 on scikit-learn's digits (1149 training images, standardized on
  them), batch 64. Variants: ``adam`` (lr 1e-3), ``sgd`` (lr 0.1, momentum 0.9), ``ivon``
  (``ivon.IVON(lr=0.1, ess=1149)``, skipped if ``import ivon`` fails), ``vi-diag-reparam``
  (``VIOptimizer(model, dataset_size=1149, curvature="reparam")``, every other argument at its
  default: IVON's estimator from the step's own backward), ``vi-diag-reparam-general`` (the
  same with the flat-buffer step switched off: the block-by-block step it replaces),
  ``vi-diag-fisher_mc`` (a second backward for the Monte-Carlo Fisher every step) and
  ``vi-kfac`` (``approx="kfac", curvature="fisher_mc"``: noisy K-FAC at its default intervals, curvature
  and eigendecompositions every 10 steps) and ``vi-kfac-1/1`` (the same with both at every
  step; ``benchmarks/vi_kfac_intervals.py`` measures their quality).
* ``transformer``: ``examples/train_transformer.py``'s model (2 layers, d=64, 4 heads) on its
  generated text, batch 32 × 128 tokens. Variants: ``adamw`` (the example's lr 3e-3, weight
  decay 0.01), ``vi-diag-reparam`` (the example's VI settings with ``curvature="reparam"``) and
  ``vi-diag-fisher_mc`` (the example's VI settings as they are).

Targets: the default VI diag step ≤ 1.3× Adam on the digits MLP (issue 27), ≤ 1.3× AdamW on the
transformer (issue 31).

Example (the lead's command; about 2 minutes on an idle core)::

    OMP_NUM_THREADS=1 python benchmarks/vi_step_time.py --out /tmp/vi_step_time.json

The JSON goes to ``--out`` (default: ``<tmp>/torchsso2-bench/vi_step_time.json``), never into
``benchmarks/results`` unless asked for.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks.common import fill_unset, load_average, machine_info, markdown_table, try_import, write_json  # noqa: E402
from examples.common import nonnegative_int, positive_int  # noqa: E402
from torchsso2 import VIOptimizer  # noqa: E402

DEFAULT_OUT = Path(tempfile.gettempdir()) / "torchsso2-bench" / "vi_step_time.json"

#: one step of a variant on one batch ``(x, y)``; returns the loss
Step = Callable[[Tensor, Tensor], Any]
#: ``(name, factory)``: the factory builds its own model copy and optimizer and returns its step
Variant = Tuple[str, Callable[[], Step]]


# ------------------------------------------------------------------------------------------------
# steps of each kind of optimizer
# ------------------------------------------------------------------------------------------------
def torch_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Step:
    def step(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


def ivon_step(model: nn.Module, opt: Any, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Step:
    def step(x: Tensor, y: Tensor) -> Tensor:
        with opt.sampled_params(train=True):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
        opt.step()
        return loss
    return step


def vi_step(model: nn.Module, opt: VIOptimizer, loss_fn: Callable[[Tensor, Tensor], Tensor],
            general: bool = False) -> Step:
    if general:  # the block-by-block step: the flat-buffer path answers "not here" at every step
        opt._flat.step = lambda *args: None  # type: ignore[method-assign]

    def step(x: Tensor, y: Tensor) -> Tensor:
        def closure() -> Tuple[Tensor, Tensor]:
            opt.zero_grad()
            out = model(x)
            loss = loss_fn(out, y)
            loss.backward()
            return loss, out
        loss, _ = opt.step(closure)
        return loss
    step.optimizer = opt  # type: ignore[attr-defined]
    return step


# ------------------------------------------------------------------------------------------------
# models and data
# ------------------------------------------------------------------------------------------------
def digits_data(batch_size: int) -> Tuple[List[Tuple[Tensor, Tensor]], int]:
    """Batches of the digits training split (1149 images: the issue's 1149/288/360 split's first
    part, seeded permutation), standardized on it; and its size."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))[:1149]
    xt = torch.tensor(x, dtype=torch.float32)[perm]
    yt = torch.tensor(y)[perm]
    xt = (xt - xt.mean(0)) / xt.std(0).clamp_min(1e-6)
    starts = range(0, len(yt) - batch_size + 1, batch_size)
    return [(xt[i:i + batch_size], yt[i:i + batch_size]) for i in starts], len(yt)


def digits_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def digits_variants(n: int, ivon_mod: Any, skipped: Dict[str, str]) -> List[Variant]:
    ce = F.cross_entropy

    def vi(general: bool = False, **kwargs: Any) -> Callable[[], Step]:
        def make() -> Step:
            model = digits_mlp()
            return vi_step(model, VIOptimizer(model, dataset_size=n, seed=0, **kwargs), ce, general)
        return make

    def adam() -> Step:
        model = digits_mlp()
        return torch_step(model, torch.optim.Adam(model.parameters(), lr=1e-3), ce)

    def sgd() -> Step:
        model = digits_mlp()
        return torch_step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ce)

    variants: List[Variant] = [("adam", adam), ("sgd", sgd)]
    if ivon_mod is not None:
        def ivon() -> Step:
            model = digits_mlp()
            return ivon_step(model, ivon_mod.IVON(model.parameters(), lr=0.1, ess=n), ce)
        variants.append(("ivon", ivon))
    else:
        skipped["ivon"] = "`import ivon` failed; pip install ivon-opt"
    variants += [("vi-diag-reparam", vi(curvature="reparam")),
                 ("vi-diag-reparam-general", vi(general=True, curvature="reparam")),
                 ("vi-diag-fisher_mc", vi(curvature="fisher_mc")),
                 ("vi-kfac", vi(approx="kfac", curvature="fisher_mc")),
                 ("vi-kfac-1/1", vi(approx="kfac", curvature="fisher_mc", curv_update_interval=1,
                                    inv_update_interval=1))]
    return variants


def transformer_data(batch_size: int, seq_len: int) -> Tuple[List[Tuple[Tensor, Tensor]], int]:
    from examples import train_transformer as tt

    data = tt.load_text_data(train_chars=batch_size * seq_len * 8 + 1, val_chars=seq_len + 1, seq_len=seq_len)
    x, y = data.x_train, data.y_train
    return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x) - batch_size + 1, batch_size)], \
        data.train_tokens


def transformer_variants(train_tokens: int) -> List[Variant]:
    from examples import train_transformer as tt

    def model() -> nn.Module:
        torch.manual_seed(0)
        return tt.CharTransformer(len(tt.ALPHABET))

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(tt.flat_logits(out), y.reshape(-1))

    def adamw() -> Step:
        m = model()
        return torch_step(m, torch.optim.AdamW(m.parameters(), lr=tt.DEFAULT_LR["adamw"], weight_decay=0.01), loss_fn)

    def vi(curvature: str) -> Callable[[], Step]:
        def make() -> Step:
            m = model()
            settings = dict(tt.VI_SETTINGS, curvature=curvature)
            return vi_step(m, VIOptimizer(m, dataset_size=train_tokens, lr=tt.DEFAULT_LR["vi-diag"], seed=0,
                                          output_selector=tt.flat_logits, **settings), loss_fn)
        return make
    return [("adamw", adamw), ("vi-diag-reparam", vi("reparam")), ("vi-diag-fisher_mc", vi("fisher_mc"))]


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
def round_robin(variants: Sequence[Variant], batches: Sequence[Tuple[Tensor, Tensor]], steps: int,
                warmup: int) -> Dict[str, Dict[str, Any]]:
    """Build every variant, run ``warmup`` untimed steps each, then ``steps`` timed rounds in which
    each variant takes one step (the order rotates every round)."""
    built = [(name, make()) for name, make in variants]
    times: Dict[str, List[float]] = {name: [] for name, _ in built}
    losses: Dict[str, float] = {}
    for i in range(warmup):
        for _, step in built:
            step(*batches[i % len(batches)])
    for r in range(steps):
        x, y = batches[(warmup + r) % len(batches)]
        k = r % len(built)
        for name, step in built[k:] + built[:k]:
            start = time.perf_counter()
            loss = step(x, y)
            times[name].append(time.perf_counter() - start)
            losses[name] = float(loss.detach())
    out: Dict[str, Dict[str, Any]] = {}
    for name, step in built:
        opt = getattr(step, "optimizer", None)
        out[name] = {"min_ms": 1e3 * min(times[name]), "median_ms": 1e3 * statistics.median(times[name]),
                     "mean_ms": 1e3 * statistics.fmean(times[name]),
                     "steps": len(times[name]), "last_loss": losses.get(name),
                     "skipped": None if opt is None else opt.num_skipped}
    return out


def with_ratios(results: Dict[str, Dict[str, Any]], reference: str) -> Dict[str, Dict[str, Any]]:
    ref = results[reference]
    for row in results.values():
        row["ratio_min"] = row["min_ms"] / ref["min_ms"]
        row["ratio_median"] = row["median_ms"] / ref["median_ms"]
        row["ratio_mean"] = row["mean_ms"] / ref["mean_ms"]
    return results


def table(results: Dict[str, Dict[str, Any]], reference: str) -> str:
    rows = [[name, f"{r['min_ms']:.3f}", f"{r['median_ms']:.3f}", f"{r['ratio_min']:.2f}×",
             f"{r['ratio_median']:.2f}×", f"{r['ratio_mean']:.2f}×", "-" if r["skipped"] is None else r["skipped"]]
            for name, r in results.items()]
    return markdown_table(["variant", "min ms", "median ms", f"min / {reference}", f"median / {reference}",
                           f"mean / {reference}", "skipped"], rows)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/vi_step_time.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Writes one JSON report to --out and prints a table per model.")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON report (default {DEFAULT_OUT})")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="timed steps per variant on the digits MLP (default 400; --quick 10)")
    p.add_argument("--transformer-steps", type=nonnegative_int, default=None,
                   help="timed steps per variant on the transformer (default 200; --quick 4; 0: skip the transformer)")
    p.add_argument("--warmup", type=nonnegative_int, default=None,
                   help="untimed steps per variant first (default 20; --quick 2)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--quick", action="store_true", help="smoke run: the smaller counts above (a given one wins)")
    args = p.parse_args(argv)
    fill_unset(args, {"steps": 10 if args.quick else 400, "transformer_steps": 4 if args.quick else 200,
                      "warmup": 2 if args.quick else 20})
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ivon_mod, _ = try_import("ivon")
    skipped: Dict[str, str] = {}
    load_before = load_average()
    batches, n = digits_data(64)
    digits = with_ratios(round_robin(digits_variants(n, ivon_mod, skipped), batches, args.steps, args.warmup), "adam")
    report: Dict[str, Any] = {"machine": machine_info(), "load_average_before": load_before,
                              "config": {"threads": args.threads, "steps": args.steps, "warmup": args.warmup,
                                         "transformer_steps": args.transformer_steps, "digits_batch": 64,
                                         "transformer_batch": [32, 128]},
                              "digits_mlp": digits, "skipped": skipped}
    print(f"Digits MLP 64-128-10, batch 64, {args.threads} thread(s), {args.steps} timed steps per variant "
          f"(load average before {load_before})")
    print(table(digits, "adam"))
    if args.transformer_steps:
        tb, tokens = transformer_data(32, 128)
        tr = with_ratios(round_robin(transformer_variants(tokens), tb, args.transformer_steps, min(args.warmup, 5)),
                         "adamw")
        report["transformer"] = tr
        print(f"\nTransformer (examples/train_transformer.py, 2 layers, d=64), batch 32 × 128 tokens, "
              f"{args.transformer_steps} timed steps per variant")
        print(table(tr, "adamw"))
    report["load_average_after"] = load_average()
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    print(f"\nload average after: {report['load_average_after']}")
    write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
