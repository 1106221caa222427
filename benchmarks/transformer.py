"""Transformer benchmark: step time of K-FAC and VI diag vs AdamW, and K-FAC's steps to AdamW's loss.

The model and data are ``examples/train_transformer.py``'s (2 layers, d=64, 4 heads, generated
character text, tied embedding/head when the library supports tying), batch 32 × 128 tokens.

1. **Step time** (one thread; min and median over repeated windows, the optimizers timed
   round-robin so drifts of a shared machine hit all alike): AdamW; ``SecondOrderOptimizer``
   K-FAC with curvature every 10 steps and inverses every 100 (a window of 100 steps holds one
   inversion and ten curvature estimates); ``VIOptimizer`` diag with curvature every 10 steps
   (10/100) and at its defaults (every step). Ratios are to AdamW in the same run. Targets
   (issue 31): K-FAC ≤ 1.5× AdamW, VI diag ≤ 1.3× AdamW.
2. **Quality** (per seed of ``--seeds``: text, init and batch order): AdamW at every lr of
   ``--adamw-lrs`` and K-FAC (the example's settings) train from the same init on the same batches
   for the longest of ``--budgets``, evaluated every ``--eval-every`` steps. For each budget B the
   target is the best AdamW's validation loss after B steps (constant lr, so a B-step run is the
   first B steps of the longer one); reported: steps and training wall time (evaluation excluded)
   to the target of K-FAC and of that AdamW (its first evaluation at or below it).

The K-FAC settings (examples/train_transformer.py ``KFAC_SETTINGS``, docs/guide.md "Transformers"):
lr 0.1 with the default KL clip 1e-3 setting the step, damping 1e-3, momentum 0.8, curvature and
eigendecompositions every 10 steps, ema_decay 0.7 (eigendecompositions every 30 steps were cheaper but
reached the target later on seeds 1 and 2), and curvature and eigendecomposition at each of the first
10 steps (``curv_warmup_steps=10``; without it the target was missed on seed 2). The timing part's
K-FAC row is the steady-state step (no warm-up); the warm-up's cost is in the quality part's wall
times. With the library's default damping 0.1 the
model sat on a 1.5-1.8 plateau for 200 steps.

Examples::

    python benchmarks/transformer.py            # writes benchmarks/results/transformer.json (~10 min)
    python benchmarks/transformer.py --quick    # smoke run (no file unless --json)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (fill_unset, fmt_ratio, load_average, machine_info, machine_line,  # noqa: E402
                               markdown_table, summarize, time_call, write_json)
from examples import train_transformer as tt  # noqa: E402
from examples.common import nonnegative_int, positive_float, positive_int  # noqa: E402
from torchsso2 import SecondOrderOptimizer, VIOptimizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "transformer.json"
TARGETS = {"sso-kfac 10/100": 1.5, "vi-diag 10/100": 1.3, "vi-diag (defaults)": 1.3}


def build_model(args: argparse.Namespace, tie: bool) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    return tt.CharTransformer(len(tt.ALPHABET), args.d_model, args.heads, args.layers, args.seq_len, tie)


def timing_specs(train_tokens: int) -> List[tuple]:
    """``(name, window, make(model))``; the VI rows use the example's settings."""
    def vi(model: torch.nn.Module, curv: int, inv: int) -> VIOptimizer:
        kw = dict(tt.VI_SETTINGS, curv_update_interval=curv, inv_update_interval=inv)
        return VIOptimizer(model, dataset_size=train_tokens, lr=tt.DEFAULT_LR["vi-diag"], seed=0,
                           output_selector=tt.flat_logits, **kw)

    return [
        ("adamw", 20, lambda m: torch.optim.AdamW(m.parameters(), lr=tt.DEFAULT_LR["adamw"], weight_decay=0.01)),
        ("sso-kfac 10/100", 100, lambda m: SecondOrderOptimizer(m, lr=tt.DEFAULT_LR["sso-kfac"], seed=0,
                                                                output_selector=tt.flat_logits,
                                                                **dict(tt.KFAC_SETTINGS, curv_update_interval=10,
                                                                       inv_update_interval=100,
                                                                       curv_warmup_steps=0))),
        ("vi-diag 10/100", 100, lambda m: vi(m, 10, 100)),
        ("vi-diag (defaults)", 20, lambda m: vi(m, 1, 1)),
    ]


def run_timing(args: argparse.Namespace, data: tt.TextData, tie: bool) -> List[Dict[str, Any]]:
    gen = torch.Generator().manual_seed(1)
    idx = torch.randperm(len(data.x_train), generator=gen)[:args.batch_size]
    x, y = data.x_train[idx], data.y_train[idx]
    runs = []
    for name, window, make in timing_specs(data.train_tokens):
        model = build_model(args, tie)
        opt = make(model)
        closure = tt.make_closure(opt, model, x, y)
        window = min(window, args.window_cap) if args.window_cap else window
        for _ in range(3):  # warm-up (the first K-FAC / VI step also decomposes)
            tt.optimizer_step(opt, closure)
        runs.append((name, window, opt, closure))
    times: Dict[str, List[float]] = {name: [] for name, *_ in runs}
    for _ in range(args.repeats):
        for name, window, opt, closure in runs:
            def run_window(opt: Any = opt, closure: Any = closure, window: int = window) -> None:
                for _ in range(window):
                    tt.optimizer_step(opt, closure)
            times[name] += [t / window for t in time_call(run_window, None, 1, warmup=0)]
    rows = []
    base = summarize(times["adamw"])
    for name, window, opt, _ in runs:
        s = summarize(times[name])
        rows.append({"optimizer": name, "window_steps": window, **s,
                     "ratio_adamw_min": s["min_s"] / base["min_s"],
                     "ratio_adamw_median": s["median_s"] / base["median_s"],
                     "target_ratio": TARGETS.get(name), "skipped_steps": getattr(opt, "num_skipped", 0)})
        print(f"  {name:20s} {1e3 * s['min_s']:8.1f} ms  ({fmt_ratio(rows[-1]['ratio_adamw_min'])} AdamW)", flush=True)
    return rows


def train_until(name: str, args: argparse.Namespace, data: tt.TextData, tie: bool, budget: int,
                target: Optional[float], seed: int, lr: Optional[float] = None) -> Dict[str, Any]:
    """Train ``name`` (the example's settings; ``lr`` None: its default) from seed ``seed``'s init and
    batch order for up to ``budget`` steps, evaluating every ``--eval-every`` steps; stop at the first
    evaluation with validation loss <= ``target`` (None: run the budget). ``wall_s`` counts the
    optimizer steps only (evaluation excluded)."""
    torch.manual_seed(seed)
    model = tt.CharTransformer(len(tt.ALPHABET), args.d_model, args.heads, args.layers, args.seq_len, tie)
    opt = tt.make_optimizer(name, model, lr, data.train_tokens, seed)
    gen = torch.Generator().manual_seed(seed)
    curve: List[Dict[str, float]] = []
    wall, step, reached = 0.0, 0, None
    while step < budget and reached is None:
        for idx in tt.batches(len(data.x_train), args.batch_size, gen):
            start = time.perf_counter()
            tt.optimizer_step(opt, tt.make_closure(opt, model, data.x_train[idx], data.y_train[idx]))
            wall += time.perf_counter() - start
            step += 1
            if step % args.eval_every == 0 or step == budget:
                val = tt.evaluate(model, data.x_val, data.y_val)
                curve.append({"step": step, "wall_s": wall, "val_loss": val})
                if target is not None and val <= target:
                    reached = step
                    break
            if step >= budget:
                break
    return {"optimizer": name, "lr": opt.param_groups[0]["lr"], "steps": step, "wall_s": wall,
            "final_val_loss": curve[-1]["val_loss"], "reached_target_at_step": reached, "curve": curve,
            "skipped_steps": getattr(opt, "num_skipped", 0)}


def first_reach(curve: List[Dict[str, float]], target: float) -> Optional[Dict[str, float]]:
    """The first evaluation of ``curve`` at or below ``target`` (None: never)."""
    return next((c for c in curve if c["val_loss"] <= target), None)


def at_step(curve: List[Dict[str, float]], step: int) -> Dict[str, float]:
    """The evaluation of ``curve`` at ``step``."""
    return next(c for c in curve if c["step"] == step)


def compare_at_budget(adamw: List[Dict[str, Any]], kfac: Dict[str, Any], budget: int) -> Dict[str, Any]:
    """AdamW with a budget of ``budget`` steps (constant lr: the first ``budget`` steps of the longer
    runs): the best lr's validation loss there is the target; steps and wall time to it of the best
    AdamW (its first evaluation at or below it) and of K-FAC."""
    best = min(adamw, key=lambda r: at_step(r["curve"], budget)["val_loss"])
    target = at_step(best["curve"], budget)["val_loss"]
    a = first_reach(best["curve"], target)
    k = first_reach(kfac["curve"], target)
    assert a is not None
    return {"budget_steps": budget, "target_val_loss": target, "adamw_best_lr": best["lr"],
            "adamw_val_loss_by_lr": {f"{r['lr']:g}": at_step(r["curve"], budget)["val_loss"] for r in adamw},
            "adamw_steps_to_target": int(a["step"]), "adamw_wall_s_to_target": a["wall_s"],
            "kfac_steps_to_target": None if k is None else int(k["step"]),
            "kfac_wall_s_to_target": None if k is None else k["wall_s"],
            "kfac_fewer_steps": k is not None and k["step"] < a["step"],
            "kfac_less_wall_time": k is not None and k["wall_s"] < a["wall_s"]}


def run_quality_seed(args: argparse.Namespace, data: tt.TextData, tie: bool, seed: int) -> Dict[str, Any]:
    """AdamW at every lr of ``--adamw-lrs`` and K-FAC (the example's settings) for the longest budget;
    one comparison per budget of ``--budgets``."""
    longest = max(args.budgets)
    adamw = [train_until("adamw", args, data, tie, longest, None, seed, lr) for lr in args.adamw_lrs]
    kfac = train_until("sso-kfac", args, data, tie, longest, None, seed)
    budgets = [compare_at_budget(adamw, kfac, b) for b in args.budgets]
    for b in budgets:
        k = b["kfac_steps_to_target"]
        print(f"  seed {seed}, budget {b['budget_steps']}: best AdamW lr {b['adamw_best_lr']:g} val "
              f"{b['target_val_loss']:.4f} (step {b['adamw_steps_to_target']}, {b['adamw_wall_s_to_target']:.1f} s); "
              + (f"K-FAC step {k}, {b['kfac_wall_s_to_target']:.1f} s" if k else "K-FAC: not reached"), flush=True)
    return {"seed": seed, "adamw": adamw, "sso-kfac": kfac, "budgets": budgets}


def run_quality(args: argparse.Namespace, data_by_seed: Dict[int, tt.TextData], tie: bool) -> Dict[str, Any]:
    seeds = [run_quality_seed(args, data_by_seed[s], tie, s) for s in args.seeds]
    return {"budgets": args.budgets, "eval_every": args.eval_every, "adamw_lrs": args.adamw_lrs,
            "kfac_settings": {"lr": tt.DEFAULT_LR["sso-kfac"], **tt.KFAC_SETTINGS}, "seeds": seeds,
            "kfac_fewer_steps": {str(b): all(r["budgets"][i]["kfac_fewer_steps"] for r in seeds)
                                 for i, b in enumerate(args.budgets)},
            "kfac_less_wall_time": {str(b): all(r["budgets"][i]["kfac_less_wall_time"] for r in seeds)
                                    for i, b in enumerate(args.budgets)}}


#: options --quick makes smaller, as (default, --quick): a value given on the command line wins
QUICK = {"d_model": (64, 32), "seq_len": (128, 32), "repeats": (3, 1), "window_cap": (0, 10),
         "budgets": ([100, 150, 200], [20, 30]), "adamw_lrs": ([3e-3, 5e-3, 1e-2, 2e-2], [3e-3, 5e-3]),
         "seeds": ([0, 1, 2], [0]), "train_chars": (200_000, 20_000), "val_chars": (16_384, 4_000)}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/transformer.py", description=__doc__.split("\n\n")[0])

    def sizes(key: str) -> str:
        default, quick = QUICK[key]
        show = (lambda v: " ".join(map(str, v))) if isinstance(default, list) else str
        return f" (default {show(default)}; --quick {show(quick)})"
    p.add_argument("--batch-size", type=positive_int, default=32, help="sequences per batch (default 32)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence" + sizes("seq_len"))
    p.add_argument("--d-model", type=positive_int, default=None, help="model width" + sizes("d_model"))
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads, dividing --d-model (default 4)")
    p.add_argument("--layers", type=positive_int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--repeats", type=positive_int, default=None, help="timed windows per optimizer" + sizes("repeats"))
    p.add_argument("--window-cap", type=nonnegative_int, default=None,
                   help="cap on the steps of a timed window (0: none)" + sizes("window_cap"))
    p.add_argument("--budgets", type=positive_int, nargs="+", default=None,
                   help="AdamW step budgets of the quality part (each a multiple of --eval-every)" + sizes("budgets"))
    p.add_argument("--adamw-lrs", type=positive_float, nargs="+", default=None,
                   help="AdamW learning rates of the quality part (the best final validation loss is the target)"
                        + sizes("adamw_lrs"))
    p.add_argument("--seeds", type=nonnegative_int, nargs="+", default=None,
                   help="seeds of the quality part (text, init and batch order)" + sizes("seeds"))
    p.add_argument("--eval-every", type=positive_int, default=10,
                   help="steps between validation losses of the quality part (default 10)")
    p.add_argument("--train-chars", type=positive_int, default=None, help="characters of training text" + sizes("train_chars"))
    p.add_argument("--val-chars", type=positive_int, default=None, help="characters of validation text" + sizes("val_chars"))
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the timing part's text and init (default 0)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--quick", action="store_true", help="smoke run: the smaller sizes above, short windows and budget")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help=f"where to write the report (default {DEFAULT_JSON.relative_to(ROOT)}; --quick: none)")
    args = p.parse_args(argv)
    fill_unset(args, {key: pair[args.quick] for key, pair in QUICK.items()})
    if any(b % args.eval_every for b in args.budgets):
        p.error(f"--budgets {args.budgets} must be positive multiples of --eval-every {args.eval_every}")
    if args.d_model % args.heads:
        p.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tie = tt.tying_supported()
    data = tt.load_text_data(args.train_chars, args.val_chars, args.seq_len, args.seed)
    load_before = load_average()
    start = time.perf_counter()
    print(f"step time, batch {args.batch_size}x{args.seq_len}, d={args.d_model}, {args.layers} layers, "
          f"{'tied' if tie else 'untied'} embedding/head, {args.threads} thread(s):", flush=True)
    timing = run_timing(args, data, tie)
    print("quality (steps to the best AdamW's final validation loss):", flush=True)
    data_by_seed = {s: data if s == args.seed else tt.load_text_data(args.train_chars, args.val_chars, args.seq_len, s)
                    for s in args.seeds}
    quality = run_quality(args, data_by_seed, tie)
    report = {"machine": machine_info(),
              "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                         "tie_weights": tie, "load_average_before": load_before,
                         "load_average_after": load_average(), "total_s": time.perf_counter() - start},
              "timing": timing, "quality": quality}
    print()
    print(markdown_table(["optimizer", "window", "min ms", "median ms", "× AdamW (min)", "× AdamW (median)", "target"],
                         [[r["optimizer"], r["window_steps"], f"{1e3 * r['min_s']:.1f}", f"{1e3 * r['median_s']:.1f}",
                           fmt_ratio(r["ratio_adamw_min"]), fmt_ratio(r["ratio_adamw_median"]),
                           "" if r["target_ratio"] is None else f"≤ {r['target_ratio']}x"] for r in timing]))
    q = quality
    print()
    print(markdown_table(["seed", "budget", "best AdamW lr", "target (its val loss)", "AdamW steps / s to target",
                          "K-FAC steps / s to target"],
                         [[r["seed"], b["budget_steps"], f"{b['adamw_best_lr']:g}", f"{b['target_val_loss']:.4f}",
                           f"{b['adamw_steps_to_target']} / {b['adamw_wall_s_to_target']:.1f}",
                           (f"{b['kfac_steps_to_target']} / {b['kfac_wall_s_to_target']:.1f}"
                            if b["kfac_steps_to_target"] else "not reached")]
                          for r in q["seeds"] for b in r["budgets"]]))
    print(machine_line(report))
    path = args.json if args.json is not None else (None if args.quick else DEFAULT_JSON)
    if path is not None:
        write_json(path, report)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
