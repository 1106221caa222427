"""Peer-specific helpers for the peer benchmarks (``peers_curvature``, ``peers_training``,
``memory``, ``width_scaling``) and the runner: optional peer imports (with a switch that tests
use to exercise the skip paths), adaptive timing, agreement metrics and the JSON envelope.

Timing, machine info, JSON writing and Markdown tables are :mod:`benchmarks.common`'s; this
module only adds what is specific to comparing with other libraries.
"""
from __future__ import annotations

import importlib
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

if __package__ in (None, ""):  # pragma: no cover - imported as a script helper
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.common import markdown_table, write_json  # noqa: E402,F401  (re-exported)

#: peer name -> (import name, pip name)
PEERS: Dict[str, tuple] = {
    "backpack": ("backpack", "backpack-for-pytorch"),
    "curvlinops": ("curvlinops", "curvlinops-for-pytorch"),
    "laplace": ("laplace", "laplace-torch"),
    "ivon": ("ivon", "ivon-opt"),
    # (the version the comparisons were made against; its dependencies are torch's)
    "kfac_pytorch": ("kfac.preconditioner", "--no-deps kfac-pytorch==0.4.2"),
    # ASDL's distribution is `asdfghjkl` (the PyPI package `asdl` is an unrelated grammar parser)
    "asdl": ("asdl", "asdfghjkl"),
}

#: set by tests (``BENCH_DISABLE_PEERS=all`` or a comma list) to exercise the skip paths
_DISABLED_ENV = "BENCH_DISABLE_PEERS"


def peer(name: str) -> Optional[Any]:
    """Import peer ``name`` (a key of :data:`PEERS`), or return None when it is missing/disabled."""
    disabled = {s.strip() for s in os.environ.get(_DISABLED_ENV, "").split(",") if s.strip()}
    if "all" in disabled or name in disabled:
        return None
    module, _ = PEERS[name]
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means "peer unavailable"
        return None


def skip_message(name: str) -> str:
    """One line saying why peer ``name`` is skipped and how to install it."""
    return (f"{name} not importable (or disabled via {_DISABLED_ENV}); "
            f"install with `pip install -c constraints.txt {PEERS[name][1]}` to include it")


def peer_versions() -> Dict[str, Optional[str]]:
    """Installed version of every peer distribution (None when absent)."""
    from importlib import metadata

    dists = {"backpack": "backpack-for-pytorch", "curvlinops": "curvlinops-for-pytorch",
             "laplace": "laplace-torch", "ivon": "ivon-opt", "kfac_pytorch": "kfac-pytorch", "asdl": "asdfghjkl"}
    out: Dict[str, Optional[str]] = {}
    for name, dist in dists.items():
        try:
            out[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine_info() -> Dict[str, Any]:
    """:func:`benchmarks.common.machine_info` plus the load average and the peer versions."""
    info = dict(common.machine_info())
    info["load_average"] = common.load_average()
    info["peers"] = peer_versions()
    return info


def time_adaptive(fn: Callable[[], Any], budget_s: float = 1.0, min_repeats: int = 3,
                  max_repeats: int = 30) -> Tuple[Any, Dict[str, Any]]:
    """Time ``fn``: one warm-up call (whose result is returned), then as many timed calls as fit
    in ``budget_s`` (clamped to ``[min_repeats, max_repeats]``); ``common.summarize`` of them.

    Fast calls get many repeats so the min is meaningful on a shared, noisy machine; calls that
    take seconds get ``min_repeats``.
    """
    import time

    box: List[Any] = [None]

    def call() -> None:
        box[0] = fn()

    t0 = time.perf_counter()
    call()
    first = max(time.perf_counter() - t0, 1e-6)
    repeats = int(min(max_repeats, max(min_repeats, math.floor(budget_s / first))))
    dev = torch.device("cuda") if torch.cuda.is_available() else None
    times = common.time_call(call, dev, repeats=repeats, warmup=0)
    return box[0], common.summarize(times)


def time_interleaved(ours: Callable[[], Any], peer: Callable[[], Any], budget_s: float = 1.0, min_repeats: int = 3,
                     max_repeats: int = 30) -> Tuple[Any, Dict[str, Any], Dict[str, Any]]:
    """Time ``ours`` and ``peer`` alternately (ours–peer, then peer–ours, ...) after one warm-up
    call each; returns ``(peer's result, summary of ours, summary of the peer)``.

    Timing one after the other let a slow minute of the shared machine hit one side only (the
    same model's numbers moved 50% between runs); alternating calls share every drift.
    """
    import time

    box: List[Any] = [None]

    def call_peer() -> None:
        box[0] = peer()

    t0 = time.perf_counter()
    ours()
    call_peer()
    first = max(time.perf_counter() - t0, 1e-6)
    repeats = int(min(max_repeats, max(min_repeats, math.floor(budget_s / first))))
    dev = torch.device("cuda") if torch.cuda.is_available() else None
    times: Dict[str, List[float]] = {"ours": [], "peer": []}
    for r in range(repeats):
        order = (("ours", ours), ("peer", call_peer)) if r % 2 == 0 else (("peer", call_peer), ("ours", ours))
        for key, fn in order:
            times[key] += common.time_call(fn, dev, repeats=1, warmup=0)
    return box[0], common.summarize(times["ours"]), common.summarize(times["peer"])


def max_rel_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|ours − ref| / max|ref|`` (elementwise max-norm, relative to the reference)."""
    ours = ours.detach().double().flatten()
    ref = ref.detach().double().flatten().to(ours.device)
    if ours.shape != ref.shape:
        raise ValueError(f"shape mismatch: ours {tuple(ours.shape)} vs reference {tuple(ref.shape)}")
    scale = ref.abs().max().clamp_min(1e-300)
    return float((ours - ref).abs().max() / scale)


def report(name: str, config: Dict[str, Any], results: List[Dict[str, Any]],
           skipped: Dict[str, str], **extra: Any) -> Dict[str, Any]:
    """The JSON envelope every peer benchmark writes."""
    return {"benchmark": name, "machine": machine_info(), "config": config,
            "results": results, "skipped": skipped, **extra}


def with_skips(table: str, rep: Dict[str, Any]) -> str:
    """``table`` followed by one ``skipped NAME: WHY`` paragraph per skipped peer/config of the report."""
    for name, why in rep["skipped"].items():
        table += f"\n\nskipped {name}: {why}"
    return table


def print_and_save(rep: Dict[str, Any], format_table: Callable[[Dict[str, Any]], str], path: Optional[Path]) -> int:
    """The tail of every peer benchmark's ``main``: print the table, write the JSON; exit code 0."""
    print(format_table(rep))
    save(path, rep)
    return 0


def save(path: Optional[Path], data: Dict[str, Any]) -> None:
    """:func:`benchmarks.common.write_json` when ``path`` is given, and say so."""
    if path is not None:
        common.write_json(Path(path), data)
        print(f"\nwrote {path}")


def fmt(x: Optional[float], spec: str = ".3g") -> str:
    """Format a number or ``—`` for None."""
    return "—" if x is None else format(x, spec)
