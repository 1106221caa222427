"""Curvature from torchsso2's engine vs the peers users would pick instead (BackPACK,
curvlinops, laplace-torch, ASDL), on the same model and batch: do the numbers agree, and who is faster?

Examples::

    python -m benchmarks.peers_curvature --quick
    python -m benchmarks.peers_curvature --full --json benchmarks/results/peers_curvature.json
    python -m benchmarks.peers_curvature --models mlp-m cnn-s --budget 2

Quantities (``curvature.compute(model, x, y, loss="cross_entropy", kind=..., approx=...)``,
curvature of the MEAN loss) and how each peer's output is mapped onto our convention:

* ``diag_ggn``  (kind=fisher, diag) — BackPACK ``DiagGGNExact`` (mean loss: identical);
  curvlinops ``GGNLinearOperator @ I`` diagonal (small models only); laplace-torch
  ``BackPackGGN.diag`` (curvature of the SUM loss: divided by N).
* ``diag_ggn_mc`` (kind=fisher_mc, diag, 1 sample) — BackPACK ``DiagGGNMC``. Stochastic: the
  row reports each estimator's relative error to the exact diagonal (same order = same estimator).
* ``ef_diag``   (kind=empirical_fisher, diag) — BackPACK ``BatchGrad``: ``grad_batch`` holds
  ∇ℓ_n/N, so EF = N·Σ_n grad_batch²; BackPACK ``SumGradSquared``: EF = N·sum_grad_squared.
* ``kfac_exact`` (kind=fisher, kfac; ``G ⊗ A``, bias as A's last row/column) — curvlinops
  ``KFACLinearOperator(fisher_type="type-2", kfac_approx="expand",
  separate_weight_and_bias=False)`` with a mean-reduction loss has exactly our factors.
  BackPACK ``KFLR`` (mean loss): Linear weight ``[G, A]`` with A without the bias entry;
  a Kronecker product is only defined up to ``(cG) ⊗ (A/c)``, so factors are compared after
  moving the trace ratio from one factor to the other. For Conv2d BackPACK documents a
  different convention: its A is Σ over the T output positions (= T·our A) and its G is the
  exact GGN of the bias (gradients summed over positions before the outer product), not the
  K-FAC-expand G. The conv rows check A = T·ours and G = the bias block of our exact
  ``approx="full"`` GGN (when that block is small enough to build).
* ``kfac_mc`` (kind=fisher_mc, kfac, 1 sample) — BackPACK ``KFAC``, curvlinops
  ``fisher_type="mc"``. Stochastic: relative error of G to the exact G, per estimator.
* ``kfac_ef`` (kind=empirical_fisher, kfac) — curvlinops ``fisher_type="empirical"``.
* ``full_ggn`` / ``full_hessian`` (approx=full, small models) — curvlinops
  ``GGNLinearOperator`` / ``HessianLinearOperator`` with ``block_sizes`` = our per-layer
  blocks, densified by multiplying with the identity.

ASDL (``import asdl``; on PyPI as ``asdfghjkl`` — the PyPI package named ``asdl`` is an
unrelated CPython grammar parser, and is treated as "not installed") computes every quantity
above with ``asdl.get_fisher_maker(model, asdl.FisherConfig(fisher_type, fisher_shapes,
loss_type="cross_entropy", data_size=N))``, ``setup_model_call`` / ``setup_loss_call`` and
``forward_and_backward()``; results land on each module (``module.fisher.diag.weight/.bias``,
``module.fisher.kron.A/.B``, ``module.fisher.data``). ASDL always backpropagates the SUM loss
and multiplies its covariances by ``1/data_size``; with ``data_size=N`` that is exactly the
mean-loss quantity, so nothing is rescaled. Per quantity: ``diag_ggn`` = ``FISHER_EXACT`` +
``SHAPE_DIAG``; ``diag_ggn_mc`` / ``kfac_mc`` = ``FISHER_MC`` (1 sample; reported like the other
MC rows, as each estimator's error to the exact value); ``ef_diag`` / ``kfac_ef`` =
``FISHER_EMP``; ``kfac_exact`` = ``FISHER_EXACT`` + ``SHAPE_KRON``: ASDL's A has no bias
row/column (its bias block is B alone, our ``G·A[-1,-1]`` with ``A[-1,-1] = 1``), so A is compared
with our ``A[:-1, :-1]`` and B with our G directly (same normalisation, Conv2d included: A =
(1/(N·T)) Σ ããᵀ, B = (1/N) Σ ggᵀ); the weight–bias cross terms of our A have no ASDL counterpart;
``full_ggn`` = ``SHAPE_LAYER_WISE`` (per-layer blocks: compared with our blocks directly);
``full_hessian`` = ``asdl.HessianMaker`` with ``SHAPE_LAYER_WISE`` (mean loss, one
double-backward per parameter). Not comparable: ASDL's Conv2d ``SHAPE_DIAG`` switches, to
save memory, to Σ_{n,t} g²a² (dropping the cross-position terms: not the exact diagonal) when
``T·(c_out + c_in·k²) < c_out·c_in·k²``; such layers' weight entries are left out of the diagonal
rows (the method column says which; none of the models here is in that regime).

Time ratio = peer time / torchsso2 time for the same quantity (> 1: torchsso2 is faster),
from the min and the median over the timed calls (one warm-up, then as many calls as fit
in ``--budget`` seconds, 3 to 30; dense P×P computations: one timed call). Ours and the peer
are called alternately (ours–peer, peer–ours, ...), so a slow spell of a shared machine hits
both sides of a ratio; the "ours" column of a row is its own interleaved timing. Everything runs
in float32. curvlinops operators are built with ``check_deterministic=False`` (its default
check runs extra passes) and built inside the timed call (they compute lazily).
"""
from __future__ import annotations

import argparse
import copy
import logging
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import curvature  # noqa: E402
from benchmarks import _peer_utils as pu  # noqa: E402
from benchmarks.common import progress  # noqa: E402
from examples.common import positive_float, positive_int  # noqa: E402

logger = logging.getLogger("benchmarks.peers_curvature")

#: below this many parameters the dense (full-block / matvec-diagonal) comparisons run
DENSE_MAX_PARAMS = 4000
#: agreement threshold in float32
AGREE_TOL = 1e-4


def _mlp(d_in: int, h: int, c: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, c))


def _cnn(c_in: int, hw: int, ch: int, c: int = 10) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c_in, ch, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(ch, 2 * ch, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(2 * ch * ((hw + 1) // 2) ** 2, c))


#: name -> (builder, input shape without batch)
MODELS: Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...]]] = {
    "mlp-xs": (lambda: _mlp(64, 16), (64,)),
    "mlp-s": (lambda: _mlp(64, 32), (64,)),
    "mlp-m": (lambda: _mlp(64, 256), (64,)),
    "mlp-l": (lambda: _mlp(784, 1024), (784,)),
    "cnn-xs": (lambda: _cnn(1, 8, 4), (1, 8, 8)),
    "cnn-s": (lambda: _cnn(1, 8, 8), (1, 8, 8)),
    "cnn-m": (lambda: _cnn(3, 16, 16), (3, 16, 16)),
}
QUICK_MODELS = ("mlp-xs", "cnn-xs")
FULL_MODELS = ("mlp-s", "mlp-m", "mlp-l", "cnn-s", "cnn-m")
QUANTITIES = ("diag_ggn", "diag_ggn_mc", "ef_diag", "kfac_exact", "kfac_mc", "kfac_ef",
              "full_ggn", "full_hessian")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers_curvature",
                                description="Compare curvature values and timings with BackPACK, "
                                "curvlinops, laplace-torch and ASDL.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help=f"models {' '.join(QUICK_MODELS)}, batch 32, short timing budget")
    mode.add_argument("--full", action="store_true", help=f"models {' '.join(FULL_MODELS)}, batch 128 (the default)")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None, help='models (default: the --full set; --quick a smaller one)')
    p.add_argument("--quantities", nargs="+", choices=QUANTITIES, default=list(QUANTITIES), help='curvature quantities to compare (default: all)')
    p.add_argument("--batch", type=positive_int, default=None, help="batch size N (default 128; --quick 32)")
    p.add_argument("--budget", type=positive_float, default=None,
                   help="seconds of timed calls per measurement after one warm-up (3 to 30 calls; "
                   "default 1.0, --quick 0.3); dense P×P computations get one timed call")
    p.add_argument("--dense-max-params", type=positive_int, default=None,
                   help="largest model (parameters) for the dense comparisons (default 4000; --quick 2000)")
    p.add_argument("--seed", type=int, default=0, help='seed of the models and data (default 0)')
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch.set_num_threads for the run (default: torch's choice, one per core); the "
                   "ratios depend on it: BackPACK's few large batched ops gain more from a second thread "
                   "than our many smaller ones on the small CNNs (docs/benchmarks.md)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="write the JSON report here (default benchmarks/results/peers_curvature.json when all "
                   "default models and quantities run with the default threads; none with --quick, --models, "
                   "--quantities or --threads)")
    p.add_argument("-v", "--verbose", action="store_true", help='log progress (INFO)')
    a = p.parse_args(argv)
    if a.threads is not None and a.threads < 1:
        p.error(f"--threads {a.threads}: expected an int >= 1")
    if a.json is None and not a.quick and not a.models and a.quantities == list(QUANTITIES) and a.threads is None:
        a.json = Path(__file__).resolve().parent / "results" / "peers_curvature.json"
    a.models = a.models or list(QUICK_MODELS if a.quick else FULL_MODELS)
    a.batch = a.batch if a.batch is not None else (32 if a.quick else 128)
    a.budget = a.budget if a.budget is not None else (0.3 if a.quick else 1.0)
    a.dense_max_params = a.dense_max_params if a.dense_max_params is not None else (2000 if a.quick else DENSE_MAX_PARAMS)
    return a


# ---------------------------------------------------------------------------------------------
# our side
# ---------------------------------------------------------------------------------------------
def _ours(model: nn.Module, x: Tensor, y: Tensor, kind: str, approx: str, seed: int = 0) -> curvature.Curvature:
    gen = torch.Generator().manual_seed(seed) if kind == "fisher_mc" else None
    return curvature.compute(model, x, y, loss="cross_entropy", kind=kind, approx=approx, generator=gen)


def _flat_diag(c: curvature.Curvature) -> Tensor:
    return torch.cat([c.blocks[n].diagonal.flatten() for n in c.layouts])


def _layers(model: nn.Module) -> List[str]:
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def _positions(model: nn.Module, x: Tensor) -> Dict[str, int]:
    """Output positions T per Linear/Conv2d layer (1 for Linear on [N, d])."""
    t: Dict[str, int] = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: t.__setitem__(n, o[0, 0].numel() if o.dim() > 2 else 1))
             for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return t


def _kron_match(g1: Tensor, a1: Tensor, g2: Tensor, a2: Tensor) -> float:
    """Max rel diff of ``g1 ⊗ a1`` vs ``g2 ⊗ a2`` factor-wise, after moving the trace ratio."""
    s = (a1.trace() / a2.trace()).item()
    return max(pu.max_rel_diff(a1, s * a2), pu.max_rel_diff(g1, g2 / s))


def _rel_fro(est: Tensor, ref: Tensor) -> float:
    return float((est.double() - ref.double()).norm() / ref.double().norm())


# ---------------------------------------------------------------------------------------------
# peers
# ---------------------------------------------------------------------------------------------
def _backpack_run(bp: Any, mb: nn.Module, lossf: nn.Module, x: Tensor, y: Tensor, *exts: Any) -> None:
    mb.zero_grad(set_to_none=True)
    with bp.backpack(*exts):
        lossf(mb(x), y).backward()


def _bp_params(mb: nn.Module) -> List[nn.Parameter]:
    return [p for _, p in mb.named_parameters()]


def _curvlinops_kfac(cl: Any, model: nn.Module, x: Tensor, y: Tensor, fisher_type: str) -> Any:
    op = cl.KFACLinearOperator(model, nn.CrossEntropyLoss(), list(model.parameters()), [(x, y)],
                               fisher_type=fisher_type, kfac_approx="expand",
                               separate_weight_and_bias=False, check_deterministic=False,
                               num_data=x.shape[0], num_per_example_loss_terms=1)
    op.compute_kronecker_factors()
    return op


def _block_sizes(c: curvature.Curvature) -> List[int]:
    return [sum(p.numel() for p in lay.params) for lay in c.layouts.values()]


def _dense(op: Any, n: int) -> Tensor:
    return op @ torch.eye(n)


def _asdl_peer() -> Optional[Any]:
    """ASDL, or None when it is missing/disabled or ``import asdl`` finds PyPI's unrelated ``asdl`` parser."""
    mod = pu.peer("asdl")
    return mod if mod is not None and hasattr(mod, "get_fisher_maker") else None


def _asdl_fisher(asdl: Any, model: nn.Module, x: Tensor, y: Tensor, fisher_type: str, shape: str,
                 seed: Optional[int] = None) -> Dict[str, nn.Module]:
    """One ASDL ``forward_and_backward`` (``data_size = N``: mean-loss normalisation); the named
    modules of ``model``, which now carry the result in ``.fisher``."""
    cfg = asdl.FisherConfig(fisher_type=fisher_type, fisher_shapes=[shape], loss_type=asdl.LOSS_CROSS_ENTROPY,
                            data_size=x.shape[0], seed=seed, n_mc_samples=1)
    maker = asdl.get_fisher_maker(model, cfg)
    maker.setup_loss_call(F.cross_entropy, maker.setup_model_call(model, x), y)
    maker.forward_and_backward()
    return dict(model.named_modules())


def _asdl_hessian(asdl: Any, model: nn.Module, x: Tensor, y: Tensor) -> Dict[str, nn.Module]:
    """ASDL's per-layer Hessian blocks of the mean loss (in each module's ``.hessian``)."""
    maker = asdl.HessianMaker(model, asdl.HessianConfig(hessian_shapes=[asdl.SHAPE_LAYER_WISE]))
    maker.setup_loss_call(F.cross_entropy, maker.setup_model_call(model, x), y)
    maker.forward_and_backward()
    return dict(model.named_modules())


def _asdl_flat_diag(mods: Dict[str, nn.Module], layers: Sequence[str]) -> Tensor:
    """ASDL's diagonal in our order: per layer, weight then bias."""
    return torch.cat([torch.cat([mods[l].fisher.diag.weight.flatten(), mods[l].fisher.diag.bias.flatten()])
                      for l in layers])


def _asdl_diag_keep(model: nn.Module, layers: Sequence[str], positions: Dict[str, int]) -> Tuple[Tensor, List[str]]:
    """(mask over the flat diagonal, layers left out): the weight entries of the Conv2d layers for which
    ASDL's ``SHAPE_DIAG`` takes its Σ_{n,t} g²a² shortcut (``T·(c_out + c_in·k²) < weight.numel()``)."""
    mods = dict(model.named_modules())
    keep, inexact = [], []
    for l in layers:
        w, b = mods[l].weight, mods[l].bias
        shortcut = isinstance(mods[l], nn.Conv2d) and positions[l] * (w.shape[0] + w[0].numel()) < w.numel()
        if shortcut:
            inexact.append(l)
        keep.append(torch.full((w.numel(),), not shortcut))
        if b is not None:
            keep.append(torch.ones(b.numel(), dtype=torch.bool))
    return torch.cat(keep), inexact


def _asdl_method(base: str, inexact: Sequence[str]) -> str:
    return base + (f" (Conv2d weights of {', '.join(inexact)} left out: ASDL shortcut)" if inexact else "")


def _asdl_kron(asdl: Any, model: nn.Module, x: Tensor, y: Tensor, fisher_type: str, layers: Sequence[str],
               seed: Optional[int] = None) -> Dict[str, Tuple[Tensor, Tensor]]:
    """ASDL's Kronecker factors ``{layer: (A, B)}`` (A without the bias row/column)."""
    mods = _asdl_fisher(asdl, model, x, y, fisher_type, asdl.SHAPE_KRON, seed)
    return {l: (mods[l].fisher.kron.A, mods[l].fisher.kron.B) for l in layers}


def _asdl_kron_diff(c: curvature.Curvature, kron: Dict[str, Tuple[Tensor, Tensor]]) -> float:
    """Max rel diff of ASDL's (A, B) vs our (A without its bias row/column, G), over layers."""
    return max(max(pu.max_rel_diff(c.blocks[l].A[:-1, :-1], a), pu.max_rel_diff(c.blocks[l].G, b))
               for l, (a, b) in kron.items())


def _asdl_blocks(asdl: Any, model: nn.Module, x: Tensor, y: Tensor, kind: str, layers: Sequence[str]) -> Tensor:
    """ASDL's per-layer blocks (exact GGN, or Hessian for ``kind="hessian"``) as one block-diagonal matrix."""
    if kind == "hessian":
        mods = _asdl_hessian(asdl, model, x, y)
        return torch.block_diag(*[mods[l].hessian.data for l in layers])
    mods = _asdl_fisher(asdl, model, x, y, asdl.FISHER_EXACT, asdl.SHAPE_LAYER_WISE)
    return torch.block_diag(*[mods[l].fisher.data for l in layers])


# ---------------------------------------------------------------------------------------------
# the comparisons
# ---------------------------------------------------------------------------------------------
Row = Dict[str, Any]


def _row(quantity: str, model_name: str, n_params: int, batch: int, peer: str, method: str,
         ours_t: Dict[str, Any], peer_t: Optional[Dict[str, Any]], **kw: Any) -> Row:
    if peer_t is not None and "ours" in peer_t:  # timed interleaved with the peer: compare those
        ours_t = peer_t["ours"]
    r: Row = {"quantity": quantity, "model": model_name, "params": n_params, "batch": batch,
              "peer": peer, "method": method, "ours_min_s": ours_t["min_s"],
              "ours_median_s": ours_t["median_s"]}
    if peer_t is not None:
        r.update(peer_min_s=peer_t["min_s"], peer_median_s=peer_t["median_s"],
                 ratio_min=peer_t["min_s"] / ours_t["min_s"],
                 ratio_median=peer_t["median_s"] / ours_t["median_s"])
    r.update(kw)
    if r.get("max_rel_diff") is not None:
        r["agree"] = r["max_rel_diff"] <= AGREE_TOL
    return r


def _timed(fn: Callable[[], Any], budget_s: float, dense: bool = False) -> Tuple[Any, Dict[str, Any]]:
    """(result, timing); ``dense`` calls take seconds: one warm-up plus one timed call."""
    if dense:
        return pu.time_adaptive(fn, budget_s=0.0, min_repeats=1, max_repeats=1)
    return pu.time_adaptive(fn, budget_s=budget_s, min_repeats=3, max_repeats=30)


def compare_model(name: str, args: argparse.Namespace, skipped: Dict[str, str]) -> List[Row]:
    build, shape = MODELS[name]
    torch.manual_seed(args.seed)
    model = build()
    gen = torch.Generator().manual_seed(args.seed + 1)
    n = args.batch
    x = torch.randn(n, *shape, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    n_params = sum(p.numel() for p in model.parameters())
    layers = _layers(model)
    positions = _positions(model, x)
    small = n_params <= args.dense_max_params
    bp, cl, la, asd = pu.peer("backpack"), pu.peer("curvlinops"), pu.peer("laplace"), _asdl_peer()
    for pname, mod in (("backpack", bp), ("curvlinops", cl), ("laplace", la), ("asdl", asd)):
        if mod is None:
            skipped[pname] = pu.skip_message(pname)
    ma = copy.deepcopy(model) if asd is not None else None  # ASDL stores its results on the modules
    keep, inexact = _asdl_diag_keep(model, layers, positions)
    rows: List[Row] = []
    rep = args.budget
    q = set(args.quantities)
    mb = lossf = None
    if bp is not None:
        mb = bp.extend(copy.deepcopy(model))
        lossf = bp.extend(nn.CrossEntropyLoss())
    common = dict(model_name=name, n_params=n_params, batch=n)
    current: Dict[str, Callable[[], Any]] = {}

    def ours_timed(fn: Callable[[], Any], dense: bool = False) -> Tuple[Any, Dict[str, Any]]:
        """Our computation of a quantity (result and a first timing); the peers of the quantity
        are then timed interleaved with it (:func:`peer_timed`)."""
        current["ours"] = fn
        return _timed(fn, rep, dense)

    def peer_timed(fn: Callable[[], Any], dense: bool = False) -> Tuple[Any, Dict[str, Any]]:
        """A peer's result and timing; non-dense peers alternate call by call with ours, and the
        ratio of that row uses the interleaved timing of ours (``peer_t["ours"]``)."""
        if dense:
            return _timed(fn, rep, dense=True)
        v, ours_pair, t = pu.time_interleaved(current["ours"], fn, budget_s=rep)
        t["ours"] = ours_pair
        return v, t

    def add(quantity: str, peer: str, method: str, ours_t: Dict[str, Any], peer_t: Optional[Dict[str, Any]],
            **kw: Any) -> None:
        rows.append(_row(quantity, peer=peer, method=method, ours_t=ours_t, peer_t=peer_t, **common, **kw))
        logger.info("%s %s %s %s", name, quantity, peer, {k: v for k, v in rows[-1].items() if "diff" in k})

    exact_diag = None
    # ---- diagonal GGN (exact) ----
    if q & {"diag_ggn", "diag_ggn_mc"}:
        c, ours_t = ours_timed(lambda: _ours(model, x, y, "fisher", "diag"))
        exact_diag = _flat_diag(c)
        if "diag_ggn" in q:
            ran = False
            if bp is not None:
                def bp_diag() -> Tensor:
                    _backpack_run(bp, mb, lossf, x, y, bp.extensions.DiagGGNExact())
                    return torch.cat([p.diag_ggn_exact.flatten() for p in _bp_params(mb)])
                v, t = peer_timed(bp_diag)
                add("diag_ggn", "backpack", "DiagGGNExact", ours_t, t, max_rel_diff=pu.max_rel_diff(exact_diag, v))
                ran = True
            if cl is not None and small:
                def cl_diag() -> Tensor:
                    op = cl.GGNLinearOperator(model, nn.CrossEntropyLoss(), list(model.parameters()), [(x, y)],
                                              check_deterministic=False, num_data=n)
                    return _dense(op, n_params).diagonal()
                v, t = peer_timed(cl_diag, dense=True)
                add("diag_ggn", "curvlinops", "GGNLinearOperator @ I (diagonal)", ours_t, t,
                    max_rel_diff=pu.max_rel_diff(exact_diag, v))
                ran = True
            if la is not None:
                from laplace.curvature import BackPackGGN  # type: ignore[import-not-found]

                lm = copy.deepcopy(model)
                backend = BackPackGGN(lm, "classification")

                def la_diag() -> Tensor:
                    _, h = backend.diag(x, y)
                    return h / n  # laplace-torch: curvature of the SUM loss
                v, t = peer_timed(la_diag)
                add("diag_ggn", "laplace", "BackPackGGN.diag / N", ours_t, t, max_rel_diff=pu.max_rel_diff(exact_diag, v))
                ran = True
            if asd is not None:
                v, t = peer_timed(lambda: _asdl_flat_diag(_asdl_fisher(asd, ma, x, y, asd.FISHER_EXACT, asd.SHAPE_DIAG),
                                                      layers))
                add("diag_ggn", "asdl", _asdl_method("FISHER_EXACT, SHAPE_DIAG", inexact), ours_t, t,
                    max_rel_diff=pu.max_rel_diff(exact_diag[keep], v[keep]))
                ran = True
            if not ran:
                add("diag_ggn", "—", "(no peer importable)", ours_t, None)
    # ---- diagonal GGN, Monte Carlo ----
    if "diag_ggn_mc" in q:
        c, ours_t = ours_timed(lambda: _ours(model, x, y, "fisher_mc", "diag", args.seed))
        ours_mc = _flat_diag(c)
        ours_err = _rel_fro(ours_mc, exact_diag)
        ran = False
        if bp is not None:
            def bp_mc() -> Tensor:
                _backpack_run(bp, mb, lossf, x, y, bp.extensions.DiagGGNMC(mc_samples=1))
                return torch.cat([p.diag_ggn_mc.flatten() for p in _bp_params(mb)])
            v, t = peer_timed(bp_mc)
            add("diag_ggn_mc", "backpack", "DiagGGNMC(1)", ours_t, t, mc_err_ours=ours_err,
                mc_err_peer=_rel_fro(v, exact_diag))
            ran = True
        if asd is not None:
            v, t = peer_timed(lambda: _asdl_flat_diag(_asdl_fisher(asd, ma, x, y, asd.FISHER_MC, asd.SHAPE_DIAG, args.seed),
                                                  layers))
            add("diag_ggn_mc", "asdl", _asdl_method("FISHER_MC(1), SHAPE_DIAG", inexact), ours_t, t,
                mc_err_ours=_rel_fro(ours_mc[keep], exact_diag[keep]), mc_err_peer=_rel_fro(v[keep], exact_diag[keep]))
            ran = True
        if not ran:
            add("diag_ggn_mc", "—", "(no peer importable)", ours_t, None, mc_err_ours=ours_err)
    # ---- empirical Fisher diagonal ----
    if "ef_diag" in q:
        c, ours_t = ours_timed(lambda: _ours(model, x, y, "empirical_fisher", "diag"))
        ef = _flat_diag(c)
        if bp is not None:
            def bp_bg() -> Tensor:
                _backpack_run(bp, mb, lossf, x, y, bp.extensions.BatchGrad())
                return torch.cat([(p.grad_batch ** 2).sum(0).flatten() for p in _bp_params(mb)]) * n
            v, t = peer_timed(bp_bg)
            add("ef_diag", "backpack", "BatchGrad: N·Σ grad_batch²", ours_t, t, max_rel_diff=pu.max_rel_diff(ef, v))

            def bp_sgs() -> Tensor:
                _backpack_run(bp, mb, lossf, x, y, bp.extensions.SumGradSquared())
                return torch.cat([p.sum_grad_squared.flatten() for p in _bp_params(mb)]) * n
            v, t = peer_timed(bp_sgs)
            add("ef_diag", "backpack", "SumGradSquared: N·sgs", ours_t, t, max_rel_diff=pu.max_rel_diff(ef, v))
        if asd is not None:
            v, t = peer_timed(lambda: _asdl_flat_diag(_asdl_fisher(asd, ma, x, y, asd.FISHER_EMP, asd.SHAPE_DIAG), layers))
            add("ef_diag", "asdl", _asdl_method("FISHER_EMP, SHAPE_DIAG", inexact), ours_t, t,
                max_rel_diff=pu.max_rel_diff(ef[keep], v[keep]))
        if bp is None and asd is None:
            add("ef_diag", "—", "(no peer importable)", ours_t, None)
    # ---- K-FAC, exact GGN ----
    exact_k = None
    if q & {"kfac_exact", "kfac_mc"}:
        exact_k, ours_t = ours_timed(lambda: _ours(model, x, y, "fisher", "kfac"))
    if "kfac_exact" in q:
        ran = False
        if cl is not None:
            op, t = peer_timed(lambda: _curvlinops_kfac(cl, model, x, y, "type-2"))
            d = max(max(pu.max_rel_diff(exact_k.blocks[l].A, op._input_covariances[l]),
                        pu.max_rel_diff(exact_k.blocks[l].G, op._gradient_covariances[l])) for l in layers)
            add("kfac_exact", "curvlinops", "KFACLinearOperator type-2 expand", ours_t, t, max_rel_diff=d,
                note="identical convention (mean loss, A=(1/NT)Σããᵀ with bias, G=(1/N)Σggᵀ)")
            ran = True
        if bp is not None:
            full_conv: Dict[str, Tensor] = {}
            for l in layers:
                m = dict(model.named_modules())[l]
                if isinstance(m, nn.Conv2d) and sum(p.numel() for p in m.parameters()) <= args.dense_max_params:
                    fc = curvature.compute(model, x, y, kind="fisher", approx={f"^{re.escape(l)}$": "full"},
                                          skip_modules=[f"^{re.escape(k)}$" for k in layers if k != l])
                    full_conv[l] = fc.blocks[l].matrix
            def bp_kflr() -> Dict[str, Tuple[Tensor, ...]]:
                _backpack_run(bp, mb, lossf, x, y, bp.extensions.KFLR())
                mods = dict(mb.named_modules())
                return {l: (*mods[l].weight.kflr, mods[l].bias.kflr[0]) for l in layers}
            v, t = peer_timed(bp_kflr)
            lin, conv_a, conv_g = [], [], []
            for l in layers:
                g_bp, a_bp, gb_bp = v[l]
                blk = exact_k.blocks[l]
                a_w = blk.A[:-1, :-1]
                if positions[l] == 1 and isinstance(dict(model.named_modules())[l], nn.Linear):
                    lin.append(max(_kron_match(blk.G, a_w, g_bp, a_bp), pu.max_rel_diff(blk.G * blk.A[-1, -1], gb_bp)))
                else:
                    conv_a.append(pu.max_rel_diff(positions[l] * a_w, a_bp))
                    if l in full_conv:
                        mat = full_conv[l]
                        cout = gb_bp.shape[0]
                        # the full block is ordered like cat([weight.flatten(), bias]): bias last
                        idx = torch.arange(mat.shape[0] - cout, mat.shape[0])
                        conv_g.append(pu.max_rel_diff(mat[idx][:, idx], g_bp))
            d = max(lin) if lin else None
            add("kfac_exact", "backpack", "KFLR (Linear layers)", ours_t, t, max_rel_diff=d,
                note="Kronecker factors compared up to (cG)⊗(A/c); bias block = G")
            if conv_a:
                add("kfac_exact", "backpack", "KFLR (Conv2d: A = T·ours)", ours_t, None, max_rel_diff=max(conv_a),
                    note="BackPACK conv A sums over the T output positions")
            if conv_g:
                add("kfac_exact", "backpack", "KFLR (Conv2d: G = bias GGN)", ours_t, None, max_rel_diff=max(conv_g),
                    note="BackPACK conv G is the exact bias GGN (position-summed g), checked against the "
                    "bias block of our approx='full' GGN; it is not K-FAC-expand G")
            ran = True
        if asd is not None:
            v, t = peer_timed(lambda: _asdl_kron(asd, ma, x, y, asd.FISHER_EXACT, layers))
            add("kfac_exact", "asdl", "FISHER_EXACT, SHAPE_KRON (A without bias)", ours_t, t,
                max_rel_diff=_asdl_kron_diff(exact_k, v),
                note="ASDL's A has no bias row/column (bias block = B): A vs our A[:-1, :-1], B vs our G")
            ran = True
        if not ran:
            add("kfac_exact", "—", "(no peer importable)", ours_t, None)
    # ---- K-FAC, Monte Carlo ----
    if "kfac_mc" in q:
        c, ours_t = ours_timed(lambda: _ours(model, x, y, "fisher_mc", "kfac", args.seed))
        ours_err = max(_rel_fro(c.blocks[l].G, exact_k.blocks[l].G) for l in layers)
        ran = False
        if bp is not None:
            def bp_kfac() -> Dict[str, Tensor]:
                _backpack_run(bp, mb, lossf, x, y, bp.extensions.KFAC(mc_samples=1))
                mods = dict(mb.named_modules())
                return {l: mods[l].weight.kfac[0] for l in layers}
            v, t = peer_timed(bp_kfac)
            lin = [l for l in layers if positions[l] == 1]
            # BackPACK's G: compare through the trace ratio fixed by its (deterministic) A
            errs = []
            for l in lin:
                g_ref = exact_k.blocks[l].G
                errs.append(_rel_fro(v[l], g_ref))
            add("kfac_mc", "backpack", "KFAC(mc_samples=1)", ours_t, t, mc_err_ours=ours_err,
                mc_err_peer=max(errs) if errs else None, note="MC error measured on Linear layers for BackPACK")
            ran = True
        if cl is not None:
            op, t = peer_timed(lambda: _curvlinops_kfac(cl, model, x, y, "mc"))
            err = max(_rel_fro(op._gradient_covariances[l], exact_k.blocks[l].G) for l in layers)
            add("kfac_mc", "curvlinops", "KFACLinearOperator mc (1 sample)", ours_t, t, mc_err_ours=ours_err,
                mc_err_peer=err)
            ran = True
        if asd is not None:
            v, t = peer_timed(lambda: _asdl_kron(asd, ma, x, y, asd.FISHER_MC, layers, args.seed))
            err = max(_rel_fro(b, exact_k.blocks[l].G) for l, (_, b) in v.items())
            add("kfac_mc", "asdl", "FISHER_MC(1), SHAPE_KRON", ours_t, t, mc_err_ours=ours_err, mc_err_peer=err)
            ran = True
        if not ran:
            add("kfac_mc", "—", "(no peer importable)", ours_t, None, mc_err_ours=ours_err)
    # ---- K-FAC, empirical Fisher ----
    if "kfac_ef" in q:
        c, ours_t = ours_timed(lambda: _ours(model, x, y, "empirical_fisher", "kfac"))
        if cl is not None:
            op, t = peer_timed(lambda: _curvlinops_kfac(cl, model, x, y, "empirical"))
            d = max(max(pu.max_rel_diff(c.blocks[l].A, op._input_covariances[l]),
                        pu.max_rel_diff(c.blocks[l].G, op._gradient_covariances[l])) for l in layers)
            add("kfac_ef", "curvlinops", "KFACLinearOperator empirical", ours_t, t, max_rel_diff=d)
        if asd is not None:
            v, t = peer_timed(lambda: _asdl_kron(asd, ma, x, y, asd.FISHER_EMP, layers))
            add("kfac_ef", "asdl", "FISHER_EMP, SHAPE_KRON (A without bias)", ours_t, t,
                max_rel_diff=_asdl_kron_diff(c, v))
        if cl is None and asd is None:
            add("kfac_ef", "—", "(no peer importable)", ours_t, None)
    # ---- full blocks (small models) ----
    for quantity, kind, opname in (("full_ggn", "fisher", "GGNLinearOperator"),
                                   ("full_hessian", "hessian", "HessianLinearOperator")):
        if quantity not in q or not small:
            continue
        c, ours_t = ours_timed(lambda: _ours(model, x, y, kind, "full"), dense=True)
        dense = c.dense()
        if cl is not None:
            sizes = _block_sizes(c)

            cls = getattr(cl, opname)
            blocked = bool(getattr(cls, "SUPPORTS_BLOCKS", False))
            mask = torch.block_diag(*[torch.ones(s, s) for s in sizes])

            def cl_full() -> Tensor:
                # curvlinops' block_sizes count parameter tensors, not entries
                kw = {"block_sizes": [len(lay.params) for lay in c.layouts.values()]} if blocked else {}
                op = cls(model, nn.CrossEntropyLoss(), list(model.parameters()), [(x, y)],
                         check_deterministic=False, num_data=n, **kw)
                return _dense(op, n_params)
            v, t = peer_timed(cl_full, dense=True)
            method = f"{opname}(block_sizes) @ I" if blocked else f"{opname} @ I, off-block part masked"
            add(quantity, "curvlinops", method, ours_t, t, max_rel_diff=pu.max_rel_diff(dense, v * mask),
                note=None if blocked else "curvlinops computes the whole P×P matrix (no block support)")
        if asd is not None:
            v, t = peer_timed(lambda kind=kind: _asdl_blocks(asd, ma, x, y, kind, layers), dense=True)
            method = "HessianMaker, SHAPE_LAYER_WISE" if kind == "hessian" else "FISHER_EXACT, SHAPE_LAYER_WISE"
            add(quantity, "asdl", method, ours_t, t, max_rel_diff=pu.max_rel_diff(dense, v))
        if cl is None and asd is None:
            add(quantity, "—", "(no peer importable)", ours_t, None)
    return rows


def run(args: argparse.Namespace) -> Dict[str, Any]:
    skipped: Dict[str, str] = {}
    rows: List[Row] = []
    it = progress(args.models, "peers_curvature")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in it:
            rows += compare_model(name, args, skipped)
    disagree = [r for r in rows if r.get("agree") is False]
    return pu.report("peers_curvature", {"models": args.models, "batch": args.batch, "budget_s": args.budget,
                                         "dense_max_params": args.dense_max_params,
                                         "quantities": args.quantities, "dtype": "float32",
                                         "agree_tol": AGREE_TOL, "seed": args.seed,
                                         "threads": torch.get_num_threads()},
                     rows, skipped, disagreements=len(disagree))


def format_table(rep: Dict[str, Any]) -> str:
    hdr = ["quantity", "model", "P", "peer", "method", "max rel diff", "MC err ours/peer",
           "ours ms (min)", "peer ms (min)", "peer/ours (min)", "peer/ours (median)"]
    rows = []
    for r in rep["results"]:
        mc = (f"{pu.fmt(r.get('mc_err_ours'), '.2f')} / {pu.fmt(r.get('mc_err_peer'), '.2f')}"
              if "mc_err_ours" in r else "")
        diff = pu.fmt(r.get("max_rel_diff"), ".1e") if "max_rel_diff" in r else ""
        if r.get("agree") is False:
            diff += " **DISAGREE**"
        rows.append([r["quantity"], r["model"], r["params"], r["peer"], r["method"], diff, mc,
                     pu.fmt(1e3 * r["ours_min_s"], ".2f"),
                     pu.fmt(1e3 * r["peer_min_s"], ".2f") if "peer_min_s" in r else "",
                     pu.fmt(r.get("ratio_min"), ".2f") if "ratio_min" in r else "",
                     pu.fmt(r.get("ratio_median"), ".2f") if "ratio_median" in r else ""])
    return pu.with_skips(pu.markdown_table(hdr, rows, "llrllllrrrr"), rep)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return pu.print_and_save(run(args), format_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
