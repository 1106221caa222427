"""``loss="binary_cross_entropy"`` against the peers that take ``nn.BCEWithLogitsLoss``: do the numbers agree?

torchsso2's Bernoulli likelihood sums ``F.binary_cross_entropy_with_logits`` over an example's outputs and
averages over the examples. The peers are given ``nn.BCEWithLogitsLoss(reduction="sum")`` and their result is
divided by ``N`` (for one output per example that is their ``reduction="mean"``). Compared, in float64 on
tiny models (a binary MLP ``[N, 1]``, a multi-label MLP ``[N, 3]``, a CNN with one logit), block by block:

* curvlinops ``GGNLinearOperator`` / ``HessianLinearOperator`` (densified, per-layer blocks) against
  ``kind="fisher"`` / ``"hessian"`` with ``approx="full"``;
* curvlinops ``KFACLinearOperator(fisher_type="type-2" | "empirical", kfac_approx="expand",
  separate_weight_and_bias=False)`` against ``kind="fisher"`` / ``"empirical_fisher"`` with ``approx="kfac"``;
* BackPACK ``DiagGGNExact`` against ``kind="fisher"``, ``approx="diag"`` (BackPACK takes one output per
  example here: the binary models only).

The labels are 0/1 (curvlinops' K-FAC refuses soft labels; ours take them, checked against the brute force in
``tests/``). The Monte-Carlo estimators are left out (different draws). A missing peer is skipped with a message.
Prints a table (the largest difference relative to the reference's largest entry) and writes JSON.

Usage::

    python benchmarks/peers_bce.py --help
    python benchmarks/peers_bce.py --json benchmarks/results/peers_bce.json
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import curvature  # noqa: E402
from benchmarks._peer_utils import max_rel_diff, peer, peer_versions, skip_message  # noqa: E402
from benchmarks.common import machine_info, markdown_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "peers_bce.json"
BATCH = 7
#: agreement expected in float64 (the same quantity summed in another order)
TOLERANCE = 1e-10


def make_models() -> Dict[str, Callable[[], nn.Module]]:
    """Tiny float64 models and the input shape each takes."""
    def mlp(labels: int) -> Callable[[], nn.Module]:
        return lambda: nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, labels))

    def cnn() -> nn.Module:
        return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 4 * 4, 1))
    return {"mlp-binary": mlp(1), "mlp-3-labels": mlp(3), "cnn-binary": cnn}


INPUTS = {"mlp-binary": (5,), "mlp-3-labels": (5,), "cnn-binary": (1, 4, 4)}


def batch(name: str, model: nn.Module, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((BATCH,) + INPUTS[name], generator=g, dtype=torch.float64)
    with torch.no_grad():
        labels = model(x).shape[1]
    return x, torch.randint(0, 2, (BATCH, labels), generator=g).double()  # 0/1: curvlinops' K-FAC takes no soft labels


def block_difference(ours: curvature.Curvature, ref: Tensor) -> float:
    """The largest entry of (our block − the reference's diagonal block), over the blocks, relative to the
    reference's largest entry (blocks in parameter order)."""
    worst, start = 0.0, 0
    for blk in ours.blocks.values():
        d = blk.dense()
        k = d.shape[0]
        worst = max(worst, float((d - ref[start:start + k, start:start + k]).abs().max()))
        start += k
    return worst / float(ref.abs().max())


def compare(model_name: str, build: Callable[[], nn.Module], seed: int, skipped: Dict[str, str]) -> List[Dict[str, Any]]:
    torch.manual_seed(seed)
    model = build().double()
    x, y = batch(model_name, model, seed)
    params = list(model.parameters())
    eye = torch.eye(sum(p.numel() for p in params), dtype=torch.float64)
    rows: List[Dict[str, Any]] = []

    def ours(kind: str, approx: str) -> curvature.Curvature:
        return curvature.compute(model, x, y, loss="binary_cross_entropy", kind=kind, approx=approx)

    cl = peer("curvlinops")
    if cl is None:
        skipped["curvlinops"] = skip_message("curvlinops")
    else:
        summed = nn.BCEWithLogitsLoss(reduction="sum")
        for quantity, kind, op in (("full GGN", "fisher", cl.GGNLinearOperator),
                                   ("full Hessian", "hessian", cl.HessianLinearOperator)):
            ref = (op(model, summed, params, [(x, y)], check_deterministic=False) @ eye) / BATCH
            rows.append(_row(quantity, model_name, "curvlinops", op.__name__, block_difference(ours(kind, "full"), ref)))
        for quantity, kind, fisher_type in (("K-FAC (exact Fisher)", "fisher", "type-2"),
                                            ("K-FAC (empirical Fisher)", "empirical_fisher", "empirical")):
            op = cl.KFACLinearOperator(model, summed, params, [(x, y)], check_deterministic=False,
                                       fisher_type=fisher_type, kfac_approx="expand", separate_weight_and_bias=False)
            rows.append(_row(quantity, model_name, "curvlinops", f"KFACLinearOperator({fisher_type})",
                             block_difference(ours(kind, "kfac"), (op @ eye) / BATCH)))
    bp = peer("backpack")
    if bp is None:
        skipped["backpack"] = skip_message("backpack")
    elif y.shape[1] == 1:
        from backpack.extensions import DiagGGNExact

        mine = torch.cat([t.reshape(-1) for t in ours("fisher", "diag").diagonal()])  # before BackPACK's hooks
        ext = bp.extend(model)
        loss = bp.extend(nn.BCEWithLogitsLoss())(ext(x), y)
        with warnings.catch_warnings(), bp.backpack(DiagGGNExact()):
            warnings.simplefilter("ignore")  # its hooks on the extended model (not ours)
            loss.backward()
        ref = torch.cat([p.diag_ggn_exact.reshape(-1) for p in ext.parameters()])
        rows.append(_row("diagonal GGN", model_name, "backpack", "DiagGGNExact", max_rel_diff(mine, ref)))
    return rows


def _row(quantity: str, model: str, peer_name: str, method: str, rel: float) -> Dict[str, Any]:
    return {"quantity": quantity, "model": model, "peer": peer_name, "method": method, "max_rel_diff": rel,
            "agrees": rel <= TOLERANCE}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/peers_bce.py",
        description="Compare torchsso2's loss='binary_cross_entropy' curvature (float64, tiny models) with "
        "curvlinops' and BackPACK's for nn.BCEWithLogitsLoss; prints the largest relative difference per "
        "quantity and writes JSON. Missing peers are skipped.")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"default {DEFAULT_JSON.relative_to(ROOT)}")
    p.add_argument("--seed", type=int, default=0, help="seed of the models and batches (default 0)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    skipped: Dict[str, str] = {}
    rows = [r for name, build in make_models().items() for r in compare(name, build, args.seed, skipped)]
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if rows:
        print(markdown_table(["quantity", "model", "peer", "method", "max rel. diff"],
                             [[r["quantity"], r["model"], r["peer"], r["method"], f"{r['max_rel_diff']:.1e}"]
                              for r in rows]))
    versions = {m: v for m, v in peer_versions().items() if m in ("curvlinops", "backpack")}
    report = {"machine": machine_info(), "peers": versions, "tolerance": TOLERANCE, "rows": rows, "skipped": skipped}
    write_json(args.json, report)
    print(f"results: {args.json}")
    bad = [r for r in rows if not r["agrees"]]
    if bad:
        raise SystemExit(f"{len(bad)} comparisons differ by more than {TOLERANCE:g}")
    return report


if __name__ == "__main__":
    main()
