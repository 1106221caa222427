"""Helpers shared by the benchmark scripts: timing, machine info, JSON and Markdown tables.

Every benchmark reports min and median over repeats (the min is the more robust number on a
shared machine), records the machine and the load average next to its numbers, and writes
one JSON report ``{"machine": ..., "config": ..., ...}``.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy
import torch

__all__ = ["machine_info", "time_call", "summarize", "load_average", "write_json", "markdown_table",
           "fmt_ratio", "try_import", "progress"]


def machine_info() -> Dict[str, Any]:
    """CPU model, core count, library versions and the GPU name (if any)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: Dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception:  # not installed or broken: recorded as absent
        info["cupy"] = None
    return info


def load_average() -> Optional[List[float]]:
    """``os.getloadavg()`` (1, 5, 15 min) where available: how busy the shared machine was."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _sync(device: Optional[torch.device]) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: Optional[torch.device] = None, repeats: int = 5,
              warmup: int = 1) -> List[float]:
    """Seconds per call of ``fn`` over ``repeats`` timed calls after ``warmup`` untimed ones (CUDA synchronized)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def machine_line(report: Dict[str, Any]) -> str:
    """One line naming the machine and the load averages before/after a run (``report["machine"]``,
    ``report["config"]["load_average_before" / "_after"]``)."""
    m, c = report["machine"], report["config"]
    return (f"machine: {m['cpu']} ({m['cores']} cores, torch threads {m['torch_threads']}), torch {m['torch']}; "
            f"load average before/after: {c['load_average_before']} / {c['load_average_after']}")


def time_training_steps(model: torch.nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, window: int,
                        repeats: int, step: Optional[Callable[[Any, Callable[[], Any]], Any]] = None,
                        warmup: int = 3) -> List[float]:
    """Mean seconds per training step over ``window`` consecutive steps, ``repeats`` times (``warmup`` steps first).

    A step is ``step(opt, closure)`` with the examples' cross-entropy closure; the default
    (:func:`examples.common.optimizer_step`) calls ``opt.step(closure)`` for torchsso2
    optimizers and ``closure(); opt.step()`` for the others.
    """
    from examples.common import make_closure, optimizer_step

    closure = make_closure(opt, model, x, y)
    one_step = step if step is not None else optimizer_step

    def run_window() -> None:
        for _ in range(window):
            one_step(opt, closure)

    for _ in range(warmup):
        one_step(opt, closure)
    return [t / window for t in time_call(run_window, None, repeats, warmup=0)]


def summarize(times: Sequence[float]) -> Dict[str, Any]:
    """``{"min_s", "median_s", "times_s"}`` of a list of timings."""
    return {"min_s": min(times), "median_s": statistics.median(times), "times_s": list(times)}


def epochs_per_seed_text(run: Dict[str, Any], missed: str = "-") -> str:
    """A time-to-accuracy run's epochs to the target per seed, space-separated (``missed`` for a
    seed that did not reach it)."""
    return " ".join(str(e) if e else missed for e in run["epochs_per_seed"])


def fill_unset(args: Any, values: Dict[str, Any]) -> None:
    """Set each option of ``values`` that the command line left None (a given value wins, as ``--quick``
    promises: it fills in the rest); a list is copied."""
    for name, value in values.items():
        if getattr(args, name) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)


def write_json(path: Path, report: Dict[str, Any]) -> None:
    """Write ``report`` as indented JSON (creating the parent directory), stamped with the time
    it was written (``measured_at_unix``, unless the report has one): the README's dates come
    from it, not from file times or commits."""
    from examples.common import write_results  # (a bad path keeps the results in a temporary file)
    report = {"measured_at_unix": time.time(), **report}
    write_results(Path(path), json.dumps(report, indent=2, default=_json_default) + "\n")


def read_report(path: Path, keys: Sequence[str], writer: str) -> Dict[str, Any]:
    """The JSON report at ``path`` written by ``writer`` (a benchmark's name), with its top-level ``keys``; a
    missing file, one that is not JSON or another benchmark's report exits with an error naming the path."""
    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SystemExit(f"error: cannot read {path} ({exc}); run {writer} without it first to measure") from None
    except ValueError as exc:
        raise SystemExit(f"error: {path} is not JSON ({exc})") from None
    missing = [k for k in keys if not isinstance(report, dict) or k not in report]
    if missing:
        raise SystemExit(f"error: {path} is not a report of {writer} (no {', '.join(map(repr, missing))} entry)")
    return report


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (torch.Tensor, numpy.ndarray)):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (numpy.floating, numpy.integer)):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: Optional[str] = None) -> str:
    """A Markdown table; ``align`` is one character per column, ``l`` or ``r`` (default: first left, rest right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    sep = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "|".join(sep) + "|"]
    for row in rows:
        lines.append("| " + " | ".join("" if v is None else str(v) for v in row) + " |")
    return "\n".join(lines)


def fmt_ratio(x: Optional[float], digits: int = 2) -> str:
    """``1.23x`` (or an empty cell for None)."""
    return "" if x is None else f"{x:.{digits}f}x"


def try_import(name: str) -> tuple[Optional[Any], Optional[str]]:
    """``(module, None)`` or ``(None, why)`` — for optional comparisons (kfac_pytorch, ivon)."""
    import importlib
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name), None
    except Exception as exc:  # ImportError, or a broken install
        return None, f"{type(exc).__name__}: {exc}"


def progress(items: Iterable[Any], desc: str, total: Optional[int] = None, position: Optional[int] = None) -> Any:
    """A tqdm bar over ``items`` (on stderr, left on screen only at ``position=0``); ``items`` itself
    when tqdm is not installed (it comes with the ``[bench]`` extra)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the [bench], [examples] and [test] extras
        return items
    return tqdm(items, desc=desc, total=total, position=position, leave=position == 0, dynamic_ncols=True)
