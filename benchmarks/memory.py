"""Peak memory of a training step per optimizer (torch.optim, IVON, torchsso2, kfac_pytorch).

Examples::

    python -m benchmarks.memory --quick
    python -m benchmarks.memory --full --json benchmarks/results/memory.json
    python -m benchmarks.memory --optimizers sgd sso-kfac --width 2048

Each optimizer runs in a fresh Python process (so one optimizer's caches and allocator
high-water mark cannot leak into the next), on an MLP ``d -> w -> w -> 10`` with a fixed
batch, for a few steps (curvature estimated and decomposed every step).

* On CUDA: ``torch.cuda.max_memory_allocated()`` minus the memory allocated before the first
  step (model, batch, one warm forward/backward already resident) — the extra memory the
  optimizer needs (state + curvature + transient buffers).
* On CPU: the same difference measured as the process's peak resident set size
  (``ru_maxrss``) minus its RSS before the first step. ``tracemalloc`` is also reported, but
  it only sees the Python heap: torch's CPU allocator bypasses it, so for tensors its number is
  near zero — the RSS figure is the one to read. RSS is page-granular and includes
  allocator slack, so differences below ~1 MiB are noise.

``state MiB`` is the bytes of tensors held in ``optimizer.state`` (plus, for torchsso2, the
curvature blocks and decompositions it keeps) after the last step — the persistent part.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import _peer_utils as pu  # noqa: E402
from benchmarks.common import progress  # noqa: E402
from examples.common import positive_int  # noqa: E402
from benchmarks.peers_training import OPTIMIZERS, make_stepper  # noqa: E402

MIB = 2.0 ** 20


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory",
                                description="Peak extra memory of a training step, per optimizer.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="width 256, 2 steps")
    mode.add_argument("--full", action="store_true", help="width 1024, 5 steps (the default)")
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS), help='optimizers to measure (default: all)')
    p.add_argument("--width", type=positive_int, default=None, help="hidden width w (default 1024; --quick 256)")
    p.add_argument("--in-features", type=positive_int, default=784, help='input width of the MLP (default 784)')
    p.add_argument("--batch", type=positive_int, default=128, help='batch size (default 128)')
    p.add_argument("--steps", type=positive_int, default=None, help='training steps measured (default 5; --quick 2)')
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help='auto: cuda when available, else cpu (default auto)')
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help='write the JSON report here (default: none)')
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.width = a.width if a.width is not None else (256 if a.quick else 1024)
    a.steps = a.steps if a.steps is not None else (2 if a.quick else 5)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    return a


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reachable_tensor_bytes(obj: Any, seen: set, visited: set, depth: int = 6) -> int:
    """Bytes of the tensor storages reachable from ``obj`` through attributes, dicts, lists and
    tuples (each storage once; ``nn.Module``s are not entered: they are the model)."""
    if isinstance(obj, torch.Tensor):
        key = (obj.untyped_storage().data_ptr(), str(obj.device))
        if key in seen or obj.untyped_storage().data_ptr() == 0:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if depth == 0 or isinstance(obj, (nn.Module, str, bytes, int, float, bool, type)) or obj is None:
        return 0
    if id(obj) in visited:
        return 0
    visited.add(id(obj))
    if isinstance(obj, dict):
        items: Any = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return 0
    return sum(_reachable_tensor_bytes(v, seen, visited, depth - 1) for v in items)


def _state_bytes(stepper: Any, model: nn.Module) -> int:
    """Tensors reachable from the optimizer / preconditioner objects the stepper closes over,
    parameters and their gradients excluded."""
    seen = {(t.untyped_storage().data_ptr(), str(t.device))
            for p in model.parameters() for t in (p, p.grad) if t is not None}
    visited: set = set()
    total = 0
    for cell in stepper.__closure__ or ():
        obj = cell.cell_contents
        if isinstance(obj, (torch.optim.Optimizer,)) or hasattr(obj, "step") and not isinstance(obj, nn.Module):
            total += _reachable_tensor_bytes(obj, seen, visited)
    return total


def child(args: argparse.Namespace) -> Dict[str, Any]:
    """Run one optimizer in this process and return its measurements."""
    import warnings

    warnings.simplefilter("ignore")
    name = args.child
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.in_features, args.width), nn.ReLU(), nn.Linear(args.width, args.width),
                          nn.ReLU(), nn.Linear(args.width, 10)).to(dev)
    x = torch.randn(args.batch, args.in_features, device=dev)
    y = torch.randint(0, 10, (args.batch,), device=dev)
    if name in ("sso-kfac", "sso-diag", "vi-diag", "vi-kfac", "kaisa", "kfac_pytorch"):
        from benchmarks import peers_training as pt

        s = pt.SETTINGS[name]  # decompose every step: the peak includes the decompositions
        for key in ("inv_update_interval", "inv_update_steps"):
            if key in s:
                s[key] = 1
    step = make_stepper(name, model, 1000, 0)
    if step is None:
        return {"optimizer": name, "skipped": True}
    nn.functional.cross_entropy(model(x), y).backward()  # warm autograd buffers
    model.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    rss0 = _rss_bytes()
    tracemalloc.start()
    for _ in range(args.steps):
        step(x, y)
    _, tm_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out: Dict[str, Any] = {"optimizer": name, "skipped": False,
                           "param_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / MIB,
                           "tracemalloc_peak_mib": tm_peak / MIB,
                           "state_mib": _state_bytes(step, model) / MIB}
    if dev.type == "cuda":
        torch.cuda.synchronize()
        out["cuda_peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    out["rss_peak_extra_mib"] = max(0, peak_rss - rss0) / MIB
    return out


def run(args: argparse.Namespace) -> Dict[str, Any]:
    rows: List[Dict[str, Any]] = []
    skipped: Dict[str, str] = {}
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    it: Any = progress(args.optimizers, "memory")
    for name in it:
        cmd = [sys.executable, "-m", "benchmarks.memory", "--child", name, "--width", str(args.width),
               "--in-features", str(args.in_features), "--batch", str(args.batch), "--steps", str(args.steps),
               "--device", args.device]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"memory child for {name} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        if r.pop("skipped"):
            skipped[name] = pu.skip_message({"ivon": "ivon", "kfac_pytorch": "kfac_pytorch"}[name])
            print(f"skipping {name}: {skipped[name]}")
            continue
        rows.append(r)
    return pu.report("memory", {"optimizers": args.optimizers, "width": args.width, "in_features": args.in_features,
                                "batch": args.batch, "steps": args.steps, "device": args.device,
                                "model": f"MLP {args.in_features}-{args.width}-{args.width}-10",
                                "decompositions": "every step"}, rows, skipped)


def format_table(rep: Dict[str, Any]) -> str:
    cuda = rep["config"]["device"] == "cuda"
    hdr = ["optimizer", "params MiB", "state MiB", "peak extra RSS MiB", "tracemalloc peak MiB"]
    if cuda:
        hdr.insert(3, "peak extra CUDA MiB")
    rows = []
    for r in rep["results"]:
        row = [r["optimizer"], pu.fmt(r["param_mib"], ".1f"), pu.fmt(r["state_mib"], ".1f"),
               pu.fmt(r["rss_peak_extra_mib"], ".1f"), pu.fmt(r["tracemalloc_peak_mib"], ".2f")]
        if cuda:
            row.insert(3, pu.fmt(r.get("cuda_peak_extra_mib"), ".1f"))
        rows.append(row)
    out = f"model {rep['config']['model']}, batch {rep['config']['batch']}, {rep['config']['steps']} steps, " \
          f"device {rep['config']['device']}\n\n" + pu.markdown_table(hdr, rows, "l" + "r" * (len(hdr) - 1))
    return pu.with_skips(out, rep)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    return pu.print_and_save(run(args), format_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
