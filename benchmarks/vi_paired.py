"""The paired extra of ``benchmarks/vi.py``: VI diag against IVON and Adam over more seeds.

The issue-27 verdicts come from ``--seeds`` (5) seeds per method. On the digits tasks the ECE of one
seed varies by ~0.5 pp (360 test images, 15 bins), so a difference of a few hundredths of a
percentage point between two 5-seed means says nothing about which method is better calibrated.
This extra does not replace those numbers: for the classification tasks it trains VI diag, IVON and
Adam at the learning rates the protocol already chose (by validation NLL, unchanged) on seeds
``--seeds … --paired-seeds − 1`` as well, and reports, over all ``--paired-seeds`` seeds,

* each method's mean ± std of accuracy, NLL and ECE on the test split, and
* the paired differences ``VI diag − reference`` per seed (same initialization, batch order and
  prediction-sample seed for every method), as mean ± standard error of the mean.

The first ``--seeds`` seeds are the protocol's own runs (their test metrics are reused, not retrained).
"""
from __future__ import annotations

import argparse
import sys
import math
import statistics
from typing import Any, Dict, List, Mapping, Sequence

#: the methods of the paired extra: VI diag and the references of issue 27's targets
PAIRED_METHODS = ("vi-diag", "ivon", "adam")
#: the metrics compared (classification)
PAIRED_KEYS = ("accuracy", "nll", "ece")
#: the methods' names in prose
LABELS = {"vi-diag": "VI diag", "ivon": "IVON", "adam": "Adam"}


def paired_differences(per_seed: Mapping[str, Sequence[Mapping[str, float]]], base: str = "vi-diag",
                       keys: Sequence[str] = PAIRED_KEYS) -> Dict[str, Dict[str, Dict[str, float]]]:
    """``{ref: {key: {"mean", "stderr", "n"}}}``: the per-seed differences ``base − ref`` of each metric.

    Args:
        per_seed: ``{method: [{"seed": s, key: value, ...}, ...]}``; seeds are matched by their ``"seed"``.
        base: the method the others are subtracted from.
        keys: the metrics compared.

    ``stderr`` is the sample standard deviation of the differences over ``√n`` (0 when ``n`` < 2).
    Raises ``ValueError`` when ``base`` is missing or shares no seed with a reference.
    """
    if base not in per_seed:
        raise ValueError(f"base={base!r} is not one of the methods {sorted(per_seed)}")
    mine = {r["seed"]: r for r in per_seed[base]}
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    for ref, rows in per_seed.items():
        if ref == base:
            continue
        pairs = [(mine[r["seed"]], r) for r in rows if r["seed"] in mine]
        if not pairs:
            raise ValueError(f"{base!r} and {ref!r} share no seed")
        out[ref] = {}
        for k in keys:
            d = [a[k] - b[k] for a, b in pairs]
            se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0
            out[ref][k] = {"mean": statistics.fmean(d), "stderr": se, "n": len(d)}
    return out


def run_paired(task: str, res: Mapping[str, Any], args: argparse.Namespace, ivon_mod: Any,
               seeds: int) -> Dict[str, Any]:
    """The paired extra of one classification task's result ``res`` (``vi_quality.run_tasks``'s record).

    Trains the methods of :data:`PAIRED_METHODS` that ``res`` has results for at their ``chosen_lr``
    on the seeds after their own ``len(seeds)``, up to ``seeds`` in all, with ``args.epochs[task]``
    epochs and ``args.mc_samples`` prediction samples. Returns ``{}`` when VI diag has no result or
    ``seeds`` is not above the protocol's seeds; otherwise ``{"seeds", "methods": {method: {"lr",
    "seeds": [...], "summary"}}, "differences": paired_differences(...)}``.
    """
    from benchmarks import vi_quality as vq  # here, so that paired_text (README rendering) needs no torch

    have = {m: r for m, r in res["methods"].items() if m in PAIRED_METHODS and "summary" in r}
    if "vi-diag" not in have or seeds <= min(len(r["seeds"]) for r in have.values()):
        return {}
    split = vq.load_task(task)
    if split.regression:
        raise ValueError(f"the paired extra is for the classification tasks; {task!r} is a regression")
    epochs, batch = args.epochs[task], vq.BATCH_SIZE[task]
    methods: Dict[str, Any] = {}
    for m, r in have.items():
        rows: List[Dict[str, Any]] = [dict(p) for p in r["seeds"]]
        for s in range(len(rows), seeds):
            run = vq.train(task, m, split, r["chosen_lr"], s, epochs, batch, ivon_mod)
            rows.append({"seed": s, "skipped_steps": run.skipped, **vq.evaluate(run, split, "test", args.mc_samples)})
        methods[m] = {"lr": r["chosen_lr"], "seeds": rows,
                      "summary": {k: vq.mean_std([p[k] for p in rows]) for k in PAIRED_KEYS}}
    return {"seeds": seeds, "methods": methods,
            "differences": paired_differences({m: v["seeds"] for m, v in methods.items()})}


def paired_text(paired: Mapping[str, Any]) -> str:
    """One line of prose: the means over the paired seeds and the paired differences (ECE in pp)."""
    if not paired:
        return ""
    means = ", ".join(f"{LABELS.get(m, m)} ECE {100 * v['summary']['ece']['mean']:.2f}% / NLL {v['summary']['nll']['mean']:.3f}"
                      for m, v in paired["methods"].items())
    diffs = "; ".join(f"VI diag − {LABELS.get(ref, ref)}: ECE {100 * d['ece']['mean']:+.2f} ± {100 * d['ece']['stderr']:.2f} pp, "
                      f"NLL {d['nll']['mean']:+.3f} ± {d['nll']['stderr']:.3f}"
                      for ref, d in paired["differences"].items())
    return (f"Paired extra over {paired['seeds']} seeds at the same lrs (mean; differences per seed, "
            f"mean ± standard error): {means}; {diffs}.")


if __name__ == "__main__":  # a part of benchmarks/vi.py, not a benchmark of its own
    argparse.ArgumentParser(prog="python benchmarks/vi_paired.py", description=(
        "A part of benchmarks/vi.py (see this module's docstring), run by it: "
        "python benchmarks/vi.py --help lists its options; this module has none of its own.")).parse_args()
    sys.exit("benchmarks/vi_paired.py is run by benchmarks/vi.py: python benchmarks/vi.py --help")
