"""A task over several random splits: the part of ``benchmarks/vi.py`` that tells a method's NLL
(and, on digits, ECE and accuracy) apart from the one fixed split's luck.

The main tables (``benchmarks/vi_quality.py``) train 5 seeds on **one** split per task, so their
seeds vary the initialization and batch order but never the data: their mean ± std says nothing
about how much of a difference between methods belongs to those test examples. On diabetes the
ranking of VI diag and Adam flips between validation and test on that split (paired over the same
5 seeds: VI − Adam = −0.017 ± 0.006 on validation, +0.015 ± 0.004 on test; docs/defaults.md); on
the digits CNN the main split's test NLL is about twice what other splits give every method, so a
few of its 360 test digits weigh on every NLL there.

Here every split ``k = 0 … K−1`` is ``load_task(task, seed=k)`` (``k = 0`` is the main table's
split). On each split and for each method the protocol is the main table's, with one seed: the lr
is chosen from the method's grid by the validation NLL of a seed-0 run (never by test data) and
that run is evaluated on the split's test examples. The result per method is the mean test NLL
(digits: also ECE and accuracy) over splits, and per reference method the **paired** difference
``VI diag − reference`` over the same splits: mean, standard error (``std / √K``) and the number of
splits where VI diag is at least as good. The NLL's paired numbers are also given on validation
(at each method's chosen lr).
"""
from __future__ import annotations

import argparse
import sys
import math
import statistics
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence

if __package__ in (None, ""):  # run as a script (its --help): make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import vi_quality as vq  # noqa: E402
from benchmarks.common import markdown_table  # noqa: E402

#: the task of ``benchmarks/vi.py``'s ``regression_splits``
TASK = "diabetes"
#: the reference methods the paired differences are taken against (when they were run)
REFERENCES = ("ivon", "adam", "sgd")
#: test metrics besides the NLL kept per split: regression, classification
EXTRA_METRICS = {True: ("rmse",), False: ("accuracy", "ece")}


def paired(diffs: Sequence[float]) -> Dict[str, float]:
    """Mean, standard error (``std / √n``; 0 for one value) and count of ``diffs ≤ 0`` of paired differences."""
    vals = list(diffs)
    if not vals:
        raise ValueError("paired() needs at least one difference")
    se = statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else 0.0
    return {"mean": statistics.fmean(vals), "se": se, "vi_at_least_as_good": sum(v <= 0 for v in vals),
            "n": len(vals)}


def run_splits(args: argparse.Namespace, ivon_mod: Any, methods: Sequence[str], num_splits: int,
               task: str = TASK) -> Dict[str, Any]:
    """``{"task", "num_splits", "epochs", "splits": [{"split", "methods": {m: {"lr", "val_nll", "test_nll",
    ...}}}], "splits_used", "summary", "paired"}``.

    Args:
        args: :func:`benchmarks.vi.parse_args`'s namespace (``epochs``, ``grids``, ``mc_samples``).
        methods: the methods to run; ``"vi-diag"`` must be among them for the paired differences.
        num_splits: ``K >= 1`` random splits (split seeds ``0 … K−1``).
        task: one of :data:`benchmarks.vi_quality.TASKS` (default diabetes).
    """
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if task not in vq.TASKS:
        raise ValueError(f"task={task!r}; expected one of {', '.join(vq.TASKS)}")
    one_seed = argparse.Namespace(**{**vars(args), "seeds": 1, "select_seeds": 1, "entropy_tasks": ()})
    rows: List[Dict[str, Any]] = []
    for k in range(num_splits):
        split = vq.load_task(task, seed=k)
        res: Dict[str, Any] = {}
        for m in methods:
            r = vq.run_method(task, m, split, one_seed, ivon_mod)
            if "summary" not in r:
                res[m] = {"lr": None, "error": r.get("error", "no result")}
                continue
            val = next(g["val_nll"] for g in r["grid"] if g["lr"] == r["chosen_lr"])
            res[m] = {"lr": r["chosen_lr"], "val_nll": val, "test_nll": r["summary"]["nll"]["mean"],
                      **{key: r["summary"][key]["mean"] for key in EXTRA_METRICS[split.regression]}}
        rows.append({"split": k, "methods": res})
        print(f"  {task} split {k}: " + ", ".join(f"{m} {v.get('test_nll', math.nan):.4f}" for m, v in res.items()),
              flush=True)
    return {"task": task, "num_splits": num_splits, "epochs": args.epochs[task], "splits": rows,
            **summarize_splits(rows)}


def summarize_splits(rows: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Per-method mean ± std over the splits where every method has a result (test NLL, validation NLL,
    and test ECE / accuracy where recorded), and the paired ``vi-diag − reference`` differences of the
    NLL on validation and test (:func:`paired`) and of the test ECE where recorded."""
    methods = list(rows[0]["methods"]) if rows else []
    ok = [r for r in rows if all("test_nll" in r["methods"][m] for m in methods)]
    out: Dict[str, Any] = {"splits_used": [r["split"] for r in ok], "summary": {}, "paired": {}}
    if not ok:
        return out
    extra = [k for k in ("ece", "accuracy") if all(k in r["methods"][m] for r in ok for m in methods)]
    for m in methods:
        out["summary"][m] = {"test_nll": vq.mean_std([r["methods"][m]["test_nll"] for r in ok]),
                             "val_nll": vq.mean_std([r["methods"][m]["val_nll"] for r in ok]),
                             **{f"test_{k}": vq.mean_std([r["methods"][m][k] for r in ok]) for k in extra}}
    if "vi-diag" in methods:
        for ref in (m for m in REFERENCES if m in methods):
            pairs = {w: paired([r["methods"]["vi-diag"][f"{w}_nll"] - r["methods"][ref][f"{w}_nll"] for r in ok])
                     for w in ("val", "test")}
            if "ece" in extra:
                pairs["test_ece"] = paired([r["methods"]["vi-diag"]["ece"] - r["methods"][ref]["ece"] for r in ok])
            out["paired"][ref] = pairs
    return out


def format_splits(res: Mapping[str, Any]) -> str:
    """The per-method table and the paired differences as text (``benchmarks/vi.py``'s printout)."""
    n = len(res.get("splits_used", []))
    task = res.get("task", TASK)
    ece = any("test_ece" in s for s in res.get("summary", {}).values())
    lines = ["", f"{task} over {n} random splits (split seeds {res['splits_used'][0] if n else '-'}…"
             f"{res['splits_used'][-1] if n else '-'}, {res['epochs']} epochs, lr chosen per split by validation NLL, "
             "seed 0): test metrics mean ± std over splits"]
    rows = [[m, f"{s['val_nll']['mean']:.4f}", f"{s['test_nll']['mean']:.4f} ± {s['test_nll']['std']:.4f}",
             *([f"{100 * s['test_ece']['mean']:.2f} ± {100 * s['test_ece']['std']:.2f}",
                f"{100 * s['test_accuracy']['mean']:.2f}"] if ece else [])]
            for m, s in res.get("summary", {}).items()]
    lines.append(markdown_table(["method", "val NLL", "test NLL", *(["test ECE %", "test acc %"] if ece else [])], rows))
    for ref, p in res.get("paired", {}).items():
        parts = [f"{w} NLL {p[w]['mean']:+.4f} ± {p[w]['se']:.4f} (se), vi-diag ≤ {ref} on "
                 f"{p[w]['vi_at_least_as_good']}/{p[w]['n']}" for w in ("val", "test")]
        if "test_ece" in p:
            e = p["test_ece"]
            parts.append(f"test ECE {100 * e['mean']:+.2f} ± {100 * e['se']:.2f} pp, vi-diag ≤ {ref} on "
                         f"{e['vi_at_least_as_good']}/{e['n']}")
        lines.append(f"vi-diag − {ref} (paired over splits): " + "; ".join(parts))
    return "\n".join(lines)


if __name__ == "__main__":  # a part of benchmarks/vi.py, not a benchmark of its own
    argparse.ArgumentParser(prog="python benchmarks/vi_splits.py", description=(
        "A part of benchmarks/vi.py (see this module's docstring), run by it: "
        "python benchmarks/vi.py --help lists its options; this module has none of its own.")).parse_args()
    sys.exit("benchmarks/vi_splits.py is run by benchmarks/vi.py: python benchmarks/vi.py --help")
