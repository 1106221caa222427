"""Helpers shared by the peer benchmarks (``peers_curvature``, ``peers_training``, ``memory``,
``width_scaling``) and the runner: optional peer imports, timing, agreement metrics, the JSON
report envelope and Markdown tables.

Timing and machine info come from :mod:`benchmarks.common` when it exists (the shared
benchmark helpers); until then they fall back to :mod:`benchmarks.linalg`, which has the same
``machine_info()`` / ``time_call()``. Nothing here is duplicated from those modules.
"""
from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # pragma: no cover - imported as a script helper
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

try:  # the shared helpers, once benchmarks/common.py lands
    from benchmarks.common import machine_info as _machine_info  # type: ignore[attr-defined]
except Exception:  # noqa: BLE001 - absent or not yet complete: use linalg's identical helper
    from benchmarks.linalg import machine_info as _machine_info

from benchmarks.linalg import time_call as _time_call  # noqa: E402

#: peer name -> (import name, pip name)
PEERS: Dict[str, tuple] = {
    "backpack": ("backpack", "backpack-for-pytorch"),
    "curvlinops": ("curvlinops", "curvlinops-for-pytorch"),
    "laplace": ("laplace", "laplace-torch"),
    "ivon": ("ivon", "ivon-opt"),
    "kfac_pytorch": ("kfac.preconditioner", "git+https://github.com/gpauloski/kfac-pytorch"),
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
             "laplace": "laplace-torch", "ivon": "ivon-opt", "kfac_pytorch": "kfac-pytorch"}
    out: Dict[str, Optional[str]] = {}
    for name, dist in dists.items():
        try:
            out[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine_info() -> Dict[str, Any]:
    """Machine description (CPU, cores, torch, GPU) plus the load average and peer versions."""
    info = dict(_machine_info())
    info["load_average"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    info["peers"] = peer_versions()
    return info


def time_call(fn: Callable[[], object], repeats: int, device: Optional[torch.device] = None) -> Dict[str, Any]:
    """``{"times_s", "min_s", "median_s"}`` of ``fn`` over ``repeats`` calls after one warm-up."""
    dev = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    times = _time_call(fn, dev, repeats)
    return {"times_s": times, "min_s": min(times), "median_s": statistics.median(times)}


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


def write_json(path: Optional[Path], data: Dict[str, Any]) -> None:
    """Write ``data`` as indented JSON to ``path`` (parents created); no-op for None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"\nwrote {path}")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: Optional[str] = None) -> str:
    """A Markdown table; ``align`` is one char per column (``l``/``r``), default left."""
    align = align or "l" * len(headers)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt(x: Optional[float], spec: str = ".3g") -> str:
    """Format a number or ``—`` for None."""
    return "—" if x is None else format(x, spec)
