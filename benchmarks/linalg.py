"""Benchmark the curvature.linalg backends: eigh, inverse and Cholesky per size.

Examples::

    python benchmarks/linalg.py --quick                      # small sizes, few repeats
    python benchmarks/linalg.py --sizes 64 256 1024 2048 --json results/linalg_cpu.json
    python benchmarks/linalg.py --backends torch cupy        # on a GPU machine
    python benchmarks/linalg.py --backends torch cupy --batch 256 --sizes 16 32 64

Every backend is timed through the public :class:`curvature.linalg.Backend` API (so
input validation and the DLPack exchange are included), on float32 SPD matrices by
default. The table reports min and median over ``--repeats`` timed calls (after one
warm-up call) and ``x torch`` = this backend's time / the torch backend's time for the
same op and size, measured in the same run, for both the min and the median (< 1 means
faster than torch; the min ratio is the more robust one on a busy machine).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import machine_info, time_call  # noqa: E402,F401  (shared helpers, re-exported)
from curvature.linalg import BACKEND_NAMES, Backend, get_backend  # noqa: E402

logger = logging.getLogger("benchmarks.linalg")

OPS: tuple[str, ...] = ("eigh", "inv", "cholesky")
DEFAULT_SIZES: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)
QUICK_SIZES: tuple[int, ...] = (64, 128, 256)
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (``argv`` defaults to ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(
        prog="python benchmarks/linalg.py",
        description="Time eigh / inv (via Cholesky) / cholesky of the curvature.linalg "
        "backends for SPD matrices of each size; print a table and optionally write JSON.",
    )
    p.add_argument("--sizes", type=int, nargs="+", default=None, metavar="N",
                   help=f"matrix sizes n (default {' '.join(map(str, DEFAULT_SIZES))}; "
                   f"--quick: {' '.join(map(str, QUICK_SIZES))})")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per (op, size, backend) after one warm-up (default 5; --quick: 3)")
    p.add_argument("--backends", nargs="+", default=None, choices=BACKEND_NAMES,
                   help="backends to time (default: every backend usable here); "
                   "torch is always added as the reference for the ratio")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS, help="operations to time")
    p.add_argument("--batch", type=int, default=0,
                   help="time a batch of this many n×n matrices per call (0 = one unbatched matrix)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="device of the torch backend's tensors (auto: cuda if available). "
                   "cupy always runs on cuda, numpy on cpu")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write results as JSON here")
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke run)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for the run (default: torch's choice); "
                   "NumPy's BLAS threads follow OPENBLAS_NUM_THREADS / OMP_NUM_THREADS")
    p.add_argument("--seed", type=int, default=0, help="seed for the random test matrices")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    args = p.parse_args(argv)
    if args.sizes is None:
        args.sizes = list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.repeats < 1 or min(args.sizes) < 1 or args.batch < 0:
        p.error("--repeats and --sizes must be >= 1 and --batch >= 0")
    return args


def make_spd(n: int, batch: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Well-conditioned SPD test matrices ``[batch, n, n]`` (or ``[n, n]`` when batch == 0)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, n, n) if batch else (n, n)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) / n**0.5
    a = x @ x.mT + torch.eye(n, dtype=torch.float64)
    return a.to(dtype=dtype, device=device)


def _device_for(name: str, requested: str) -> torch.device:
    if name == "cupy":
        return torch.device("cuda")
    if name == "numpy":
        return torch.device("cpu")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def _load_backends(names: Optional[Sequence[str]]) -> tuple[dict[str, Backend], dict[str, str]]:
    wanted = list(dict.fromkeys(["torch", *(names or BACKEND_NAMES)]))
    backends: dict[str, Backend] = {}
    skipped: dict[str, str] = {}
    for name in wanted:
        try:
            backends[name] = get_backend(name)
        except (ImportError, RuntimeError) as exc:
            skipped[name] = str(exc)
            if names and name in names:
                logger.warning("backend %s skipped: %s", name, exc)
    return backends, skipped


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every (op, size, backend) and return the JSON-ready report."""
    dtype = DTYPES[args.dtype]
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    backends, skipped = _load_backends(args.backends)
    results: list[dict[str, Any]] = []
    for n in args.sizes:
        for op in args.ops:
            torch_min: Optional[float] = None
            torch_median: Optional[float] = None
            for name, b in backends.items():
                device = _device_for(name, args.device)
                a = make_spd(n, args.batch, dtype, device, args.seed)
                fn: Callable[[], object] = {
                    "eigh": lambda: b.eigh(a),
                    "inv": lambda: b.inv(a),
                    "cholesky": lambda: b.cholesky(a),
                }[op]
                logger.info("timing %s n=%d batch=%d on %s (%s)", op, n, args.batch, name, device)
                times = time_call(fn, device, args.repeats)
                median = statistics.median(times)
                if name == "torch":
                    torch_min, torch_median = min(times), median
                results.append({
                    "op": op, "n": n, "batch": args.batch, "backend": name,
                    "device": str(device), "dtype": args.dtype, "times_s": times,
                    "min_s": min(times), "median_s": median,
                    "ratio_to_torch": median / torch_median if torch_median else None,
                    "ratio_min_to_torch": min(times) / torch_min if torch_min else None,
                })
    return {
        "machine": machine_info(),
        "config": {"sizes": args.sizes, "repeats": args.repeats, "ops": args.ops,
                   "batch": args.batch, "dtype": args.dtype, "device": args.device,
                   "threads": torch.get_num_threads(), "seed": args.seed,
                   "load_average_before": load_before,
                   "load_average_after": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "results": results,
        "skipped": skipped,
    }


def format_table(report: dict[str, Any]) -> str:
    """Render the results as a Markdown table."""
    m = report["machine"]
    lines = [
        f"machine: {m['cpu']} ({m['cores']} cores, torch threads {m['torch_threads']}), "
        f"GPU: {m['gpu'] or 'none'}; torch {m['torch']}, numpy {m['numpy']}, cupy {m['cupy'] or 'absent'}",
        f"dtype {report['config']['dtype']}, batch {report['config']['batch'] or 'none'}, "
        f"{report['config']['repeats']} repeats after 1 warm-up; x torch = this backend's time / the torch backend's time (same op, size, run)",
        "",
        "| op | n | backend | device | min ms | median ms | x torch (min) | x torch (median) |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        ratios = [
            "" if r[key] is None else f"{r[key]:.2f}"
            for key in ("ratio_min_to_torch", "ratio_to_torch")
        ]
        lines.append(
            f"| {r['op']} | {r['n']} | {r['backend']} | {r['device']} | "
            f"{1e3 * r['min_s']:.3f} | {1e3 * r['median_s']:.3f} | {ratios[0]} | {ratios[1]} |"
        )
    for name, why in report["skipped"].items():
        lines.append(f"\nskipped {name}: {why}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    report = run(args)
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
