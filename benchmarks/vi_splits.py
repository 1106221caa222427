"""Diabetes regression over several random splits: the part of ``benchmarks/vi.py`` that tells a
method's regression NLL apart from the one fixed split's luck.

The main diabetes table (``benchmarks/vi_quality.py``) trains 5 seeds on **one** 282 / 71 / 89 split,
so its seeds vary the initialization and batch order but never the data: its mean ± std says
nothing about how much of a difference between methods belongs to those 89 test examples. On that
split the ranking of VI diag and Adam flips between validation and test (paired over the same 5
seeds: VI − Adam = −0.017 ± 0.006 on validation, +0.015 ± 0.004 on test; docs/defaults.md).

Here every split ``k = 0 … K−1`` is ``load_diabetes_split(seed=k)`` (``k = 0`` is the main table's
split). On each split and for each method the protocol is the main table's, with one seed: the lr
is chosen from the method's grid by the validation NLL of a seed-0 run (never by test data) and
that run is evaluated on the split's test examples. The result per method is the mean test NLL over
splits, and per reference method the **paired** difference ``VI diag − reference`` over the same
splits: mean, standard error (``std / √K``) and the number of splits where VI diag is at least as
good. The same paired numbers are given on validation (at each method's chosen lr).
"""
from __future__ import annotations

import argparse
import math
import statistics
from typing import Any, Dict, List, Mapping, Sequence

from benchmarks import vi_quality as vq
from benchmarks.common import markdown_table

TASK = "diabetes"
#: the reference methods the paired differences are taken against (when they were run)
REFERENCES = ("ivon", "adam", "sgd")


def paired(diffs: Sequence[float]) -> Dict[str, float]:
    """Mean, standard error (``std / √n``; 0 for one value) and count of ``diffs ≤ 0`` of paired differences."""
    vals = list(diffs)
    if not vals:
        raise ValueError("paired() needs at least one difference")
    se = statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else 0.0
    return {"mean": statistics.fmean(vals), "se": se, "vi_at_least_as_good": sum(v <= 0 for v in vals),
            "n": len(vals)}


def run_splits(args: argparse.Namespace, ivon_mod: Any, methods: Sequence[str], num_splits: int) -> Dict[str, Any]:
    """``{"splits": [{"split", "methods": {m: {"lr", "val_nll", "test_nll", "rmse"}}}], "summary", "paired"}``.

    Args:
        args: :func:`benchmarks.vi.parse_args`'s namespace (``epochs``, ``grids``, ``mc_samples``).
        methods: the methods to run; ``"vi-diag"`` must be among them for the paired differences.
        num_splits: ``K >= 1`` random splits (split seeds ``0 … K−1``).
    """
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    one_seed = argparse.Namespace(**{**vars(args), "seeds": 1, "select_seeds": 1, "entropy_tasks": ()})
    rows: List[Dict[str, Any]] = []
    for k in range(num_splits):
        split = vq.load_diabetes_split(seed=k)
        res: Dict[str, Any] = {}
        for m in methods:
            r = vq.run_method(TASK, m, split, one_seed, ivon_mod)
            if "summary" not in r:
                res[m] = {"lr": None, "error": r.get("error", "no result")}
                continue
            val = next(g["val_nll"] for g in r["grid"] if g["lr"] == r["chosen_lr"])
            res[m] = {"lr": r["chosen_lr"], "val_nll": val, "test_nll": r["summary"]["nll"]["mean"],
                      "rmse": r["summary"]["rmse"]["mean"]}
        rows.append({"split": k, "methods": res})
        print(f"  diabetes split {k}: " + ", ".join(f"{m} {v.get('test_nll', math.nan):.4f}" for m, v in res.items()),
              flush=True)
    return {"num_splits": num_splits, "epochs": args.epochs[TASK], "splits": rows, **summarize_splits(rows)}


def summarize_splits(rows: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Per-method mean ± std of the test NLL over the splits where every method has a result, and the
    paired ``vi-diag − reference`` differences on validation and test (:func:`paired`)."""
    methods = list(rows[0]["methods"]) if rows else []
    ok = [r for r in rows if all("test_nll" in r["methods"][m] for m in methods)]
    out: Dict[str, Any] = {"splits_used": [r["split"] for r in ok], "summary": {}, "paired": {}}
    if not ok:
        return out
    for m in methods:
        out["summary"][m] = {"test_nll": vq.mean_std([r["methods"][m]["test_nll"] for r in ok]),
                             "val_nll": vq.mean_std([r["methods"][m]["val_nll"] for r in ok])}
    if "vi-diag" in methods:
        for ref in (m for m in REFERENCES if m in methods):
            out["paired"][ref] = {w: paired([r["methods"]["vi-diag"][f"{w}_nll"] - r["methods"][ref][f"{w}_nll"]
                                             for r in ok]) for w in ("val", "test")}
    return out


def format_splits(res: Mapping[str, Any]) -> str:
    """The per-method table and the paired differences as text (``benchmarks/vi.py``'s printout)."""
    n = len(res.get("splits_used", []))
    lines = ["", f"diabetes over {n} random splits (split seeds {res['splits_used'][0] if n else '-'}…"
             f"{res['splits_used'][-1] if n else '-'}, {res['epochs']} epochs, lr chosen per split by validation NLL, "
             "seed 0): test NLL mean ± std over splits"]
    rows = [[m, f"{s['val_nll']['mean']:.4f}", f"{s['test_nll']['mean']:.4f} ± {s['test_nll']['std']:.4f}"]
            for m, s in res.get("summary", {}).items()]
    lines.append(markdown_table(["method", "val NLL", "test NLL"], rows))
    for ref, p in res.get("paired", {}).items():
        lines.append(f"vi-diag − {ref} (paired over splits): " + "; ".join(
            f"{w} {p[w]['mean']:+.4f} ± {p[w]['se']:.4f} (se), vi-diag ≤ {ref} on {p[w]['vi_at_least_as_good']}/{p[w]['n']}"
            for w in ("val", "test")))
    return "\n".join(lines)
