"""Run every benchmark in ``benchmarks/`` and regenerate ``docs/results.md`` and README's results section.

Examples::

    python -m benchmarks.run --quick                       # smoke run of everything (minutes), into a temp dir
    python -m benchmarks.run --quick --out /tmp/smoke      # the same, into /tmp/smoke/{results,docs}
    python -m benchmarks.run --full                        # the numbers of docs/results.md (long)
    python -m benchmarks.run --full --only peers_curvature peers_training
    python -m benchmarks.run --report-only                 # rebuild docs/results.md and README from the JSONs
    python -m benchmarks.run --report-only --no-readme     # docs/results.md only
    python -m benchmarks.run --quick --results-dir /tmp/r --docs-dir /tmp/d \\
        --extra "memory=--optimizers sgd sso-kfac"         # per-module extra arguments (README untouched)

A benchmark is any module ``benchmarks/<name>.py`` with a ``main(argv)`` (helpers such as
``common``, ``_peer_utils`` and this runner are not). Each is called in this process as
``main(["--quick" | "--full", "--json", <results-dir>/<name>.json, ...])`` — ``--full`` only
where the module has that flag (its default is then the full run), ``--plot <docs-dir>/<name>.png``
where it has ``--plot`` — and a module that raises is recorded as failed; the others still run.
Peers that are not installed are skipped by the modules themselves, with a message.

``docs/results.md`` gets the machine (CPU, cores, torch, GPU, load average), each module's
table (its ``format_table`` / ``format_tables`` applied to its JSON) and links to the plots.

README.md (or ``--readme PATH``) gets a compact summary — step overhead vs SGD / Adam /
kfac_pytorch with the FLOP floor, time to 97 % on digits, VI vs Adam / IVON, curvature
agreement and speed vs the peers, data-parallel scaling — rendered from the same JSONs by
:mod:`benchmarks._readme_summary`. Only the text between the lines ``<!-- results:begin -->``
and ``<!-- results:end -->`` is replaced; everything outside them stays byte for byte, and a
README without both markers is an error (ValueError naming the marker), raised before any
benchmark runs. The README is written only when ``--readme`` is given or the results
directory is the default ``benchmarks/results`` (a run into a scratch ``--results-dir``, such
as the tests' ``--quick`` runs, never touches the repository's README); ``--no-readme``
turns it off.

Published results (``benchmarks/results/*.json``, ``docs/results.md``, ``docs/*.png`` and the README
block) are written only by a full run or ``--report-only``. A ``--quick`` run writes into a scratch
directory — ``--out DIR`` (``DIR/results``, ``DIR/docs``), explicit ``--results-dir``/``--docs-dir``, or
else a fresh temporary directory whose path it prints — and refuses the published directories unless
``--publish`` is given (see :func:`resolve_dirs`).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _peer_utils as pu  # noqa: E402
from benchmarks.common import progress  # noqa: E402
from benchmarks import _readme_summary  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
DEFAULT_RESULTS = BENCH_DIR / "results"
DEFAULT_README = ROOT / "README.md"
NOT_BENCHMARKS = {"__init__", "common", "_peer_utils", "run", "vi_quality"}  # vi_quality: part of vi
#: studies run on their own (their own CLIs, no ``--json`` report of the suite's shape): not part of a suite run
STANDALONE = {"sequence_curvature", "vi_differences", "vi_kfac_intervals", "vi_step_time"}
#: run order (modules not listed run after these, alphabetically)
ORDER = ("linalg", "step_overhead", "vi", "scaling", "peers_curvature", "peers_training", "memory", "width_scaling")
#: a module's ``--plot`` file name where it is not ``<name>.png``
PLOTS = {"vi": "reliability_digits.png"}
TITLES = {
    "linalg": "Linear-algebra backends (eigh / inverse / Cholesky)",
    "step_overhead": "Step overhead vs SGD / Adam / kfac_pytorch",
    "vi": "Variational inference (VIOptimizer vs IVON)",
    "scaling": "Data-parallel scaling",
    "peers_curvature": "Curvature vs BackPACK / curvlinops / laplace-torch / ASDL (agreement and speed)",
    "peers_training": "Training on digits: time to 97 % test accuracy",
    "memory": "Peak memory per optimizer",
    "width_scaling": "Step time vs layer width (with the FLOP model)",
    "kaisa": "KAISA strategies of KFACPreconditioner (time, memory, traffic)",
}


#: conventions and caveats printed under the tables (numbers live in the tables, not here)
NOTES = """## How to read the peer comparisons

- **Agreement** (`max rel diff` = max|ours − peer| / max|peer|, float32): every deterministic
  quantity is expected at the 1e-6 level; a value above 1e-4 is flagged **DISAGREE**.
- **Conventions mapped** (all curvature is of the *mean* loss, as in torchsso2):
  BackPACK extensions on a `reduction="mean"` loss give mean-loss quantities directly;
  `BatchGrad` holds ∇ℓ_n/N, so the empirical-Fisher diagonal is N·Σ grad_batch² (and
  N·`sum_grad_squared`); laplace-torch works with the *sum* loss, so its curvature is divided
  by N; curvlinops `KFACLinearOperator(fisher_type="type-2", kfac_approx="expand",
  separate_weight_and_bias=False)` with a mean loss has exactly torchsso2's factors
  (A = (1/(N·T)) Σ ããᵀ with the bias as A's last row/column, G = (1/N) Σ ggᵀ).
  ASDL (`asdfghjkl` on PyPI) backpropagates the *sum* loss and scales by 1/`data_size`; with
  `data_size=N` its quantities are mean-loss ones as they are. Its Kronecker A has no bias
  row/column (the bias block is B alone), so it is compared with our A without the bias entry.
- **BackPACK K-FAC for Conv2d** uses a different (documented) convention: its A sums over the
  T output positions (= T · our A) and its G is the exact bias GGN (gradients summed over
  positions before the outer product) rather than the K-FAC-expand G. The table checks both
  relations separately; for Linear layers the Kronecker product is compared directly (factors
  up to the usual c·G ⊗ A/c exchange).
- **Monte-Carlo quantities** (`diag_ggn_mc`, `kfac_mc`) cannot agree elementwise; the column
  `MC err ours/peer` is each estimator's relative error to the exact value on the same batch
  (one sample): the same order of magnitude means the same estimator.
- **Time ratio** = peer time / torchsso2 time (> 1: torchsso2 faster), min over adaptive repeats
  and median. curvlinops dense rows build the P×P matrix from P matrix-vector products (that is
  its design: a linear-operator library), so they are slow by construction.
- **Training**: the target is 97 % test accuracy on sklearn digits (450 test images); runs that
  never reach it report their best accuracy. VI/IVON are evaluated at the posterior mean, with a
  tempered posterior (dataset size ×10) as in `examples/bayesian_digits.py`.
- **Known gap (measured above)**: torchsso2's `diag` shapes on Linear layers build per-example
  gradients `[K·N, d_out, d_in]` (K = classes for the exact Fisher) and square them, where
  BackPACK contracts `(g²)ᵀ(a²)` without materialising them; on wide MLPs that makes our exact
  diagonal GGN / MC diagonal / empirical-Fisher diagonal one to three orders of magnitude
  slower (and the `sso-diag` step memory-hungry). K-FAC, full blocks and conv layers are on par
  or faster. Values agree everywhere.
- **Memory** on CPU is the peak RSS growth of a fresh process (tracemalloc does not see torch's
  CPU allocator; its column is shown only to make that visible); on CUDA it is
  `torch.cuda.max_memory_allocated()` growth.
"""


def discover() -> List[str]:
    """Names of the benchmark modules in ``benchmarks/`` in run order."""
    names = [p.stem for p in BENCH_DIR.glob("*.py")
             if p.stem not in NOT_BENCHMARKS | STANDALONE and not p.stem.startswith("_")]
    names = [n for n in names if "def main(" in (BENCH_DIR / f"{n}.py").read_text(encoding="utf-8")]
    return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="each module's --quick (smoke run)")
    mode.add_argument("--full", action="store_true", help="each module's full run (the default)")
    mode.add_argument("--report-only", action="store_true",
                      help="only rebuild results.md and the README block from existing JSONs")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these modules")
    p.add_argument("--skip", nargs="+", default=[], metavar="NAME", help="do not run these modules")
    p.add_argument("--results-dir", type=Path, default=None,
                   help=f"where the JSONs go (default {DEFAULT_RESULTS.relative_to(ROOT)}; --quick: a scratch dir)")
    p.add_argument("--docs-dir", type=Path, default=None,
                   help="where results.md and the plots go (default docs/ with the default results dir, else "
                   "the results dir; --quick: a scratch dir)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="scratch root: results in DIR/results, docs in DIR/docs (README untouched)")
    p.add_argument("--publish", action="store_true",
                   help="let a --quick run overwrite the published results (JSONs, docs, README block)")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=ARGS",
                   help="extra command-line arguments for one module (repeatable)")
    p.add_argument("--no-report", action="store_true", help="do not write results.md")
    readme = p.add_mutually_exclusive_group()
    readme.add_argument("--readme", type=Path, default=None, metavar="PATH",
                        help="README whose results block (between the results:begin/end markers) is regenerated "
                        "(default: README.md at the repository root, and only when --results-dir is the default)")
    readme.add_argument("--no-readme", action="store_true", help="do not touch any README")
    args = p.parse_args(argv)
    names = discover()
    unknown = [n for n in (args.only or []) + args.skip if n not in names]
    if unknown:  # before resolve_dirs makes a scratch directory for a run that will not happen
        p.error(f"unknown benchmark(s): {', '.join(unknown)}; available: {', '.join(names)}")
    return resolve_dirs(args)


DEFAULT_DOCS = ROOT / "docs"


def resolve_dirs(args: argparse.Namespace) -> argparse.Namespace:
    """Fill ``args.results_dir`` / ``args.docs_dir`` (in place; returns ``args``).

    Full and ``--report-only`` runs default to the published ``benchmarks/results`` and ``docs``. A
    ``--quick`` run defaults to ``--out DIR`` or a new temporary directory, and raises ``ValueError``
    if it would write into the published directories without ``--publish``. An explicit scratch
    ``--results-dir`` without ``--docs-dir`` puts the docs next to the JSONs, never into ``docs/``.
    """
    scratch: Optional[Path] = args.out
    if scratch is None and args.quick and not args.publish and args.results_dir is None and args.docs_dir is None:
        scratch = Path(tempfile.mkdtemp(prefix="torchsso2-bench-quick-"))
    if args.results_dir is None:
        args.results_dir = scratch / "results" if scratch is not None else DEFAULT_RESULTS
    if args.docs_dir is None:
        if scratch is not None:
            args.docs_dir = scratch / "docs"
        elif args.results_dir.resolve() == DEFAULT_RESULTS.resolve():
            args.docs_dir = DEFAULT_DOCS
        else:
            args.docs_dir = args.results_dir
    if args.quick and not args.publish:
        published = {DEFAULT_RESULTS.resolve(), DEFAULT_DOCS.resolve()}
        hit = [str(d) for d in (args.results_dir, args.docs_dir) if d.resolve() in published]
        if hit or (args.readme is not None and args.readme.resolve() == DEFAULT_README.resolve()):
            raise ValueError(f"--quick would overwrite published results ({', '.join(hit) or DEFAULT_README}); "
                             "choose a scratch --out DIR or add --publish")
    return args


def readme_target(args: argparse.Namespace) -> Optional[Path]:
    """The README to regenerate, or None: ``--readme`` if given; else the repository's README.md, but
    only for the default results directory (a scratch ``--results-dir`` must not rewrite it)."""
    if args.no_readme:
        return None
    if args.readme is not None:
        return args.readme
    if args.results_dir.resolve() == DEFAULT_RESULTS.resolve():
        return DEFAULT_README
    return None


def module_argv(name: str, source: str, args: argparse.Namespace) -> List[str]:
    """The argv a module is called with."""
    argv: List[str] = []
    if args.quick:
        argv.append("--quick")
    elif '"--full"' in source:
        argv.append("--full")
    argv += ["--json", str(args.results_dir / f"{name}.json")]
    if '"--plot"' in source:
        argv += ["--plot", str(args.docs_dir / PLOTS.get(name, f"{name}.png"))]
    for e in args.extra:
        key, _, val = e.partition("=")
        if key == name:
            argv += shlex.split(val)
    return argv


def run_modules(names: Sequence[str], args: argparse.Namespace) -> Dict[str, Dict[str, Any]]:
    status: Dict[str, Dict[str, Any]] = {}
    it: Any = progress(names, "benchmarks", position=0)
    for name in it:
        if hasattr(it, "set_postfix_str"):
            it.set_postfix_str(name)
        source = (BENCH_DIR / f"{name}.py").read_text(encoding="utf-8")
        if args.quick and '"--quick"' not in source:  # no smoke mode: a quick run leaves it out
            print(f"\n===== {name}: skipped (no --quick mode; run it in full on its own)", flush=True)
            status[name] = {"ok": True, "skipped": "no --quick mode", "argv": [], "wall_s": 0.0}
            continue
        argv = module_argv(name, source, args)
        print(f"\n===== {name}: {' '.join(argv)}", flush=True)
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(f"benchmarks.{name}")
            rc = mod.main(argv)
            # a module's main returns an exit code, None, or its report (a dict): only a non-zero code fails
            ok = rc in (0, None) or not isinstance(rc, int)
            status[name] = {"ok": ok, "rc": rc if isinstance(rc, int) or rc is None else "report", "argv": argv}
        except SystemExit as exc:  # a module's argparse error or explicit exit
            status[name] = {"ok": exc.code in (0, None), "rc": exc.code, "argv": argv}
        except Exception as exc:  # noqa: BLE001 - record and go on with the next module
            traceback.print_exc()
            status[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "argv": argv}
        status[name]["wall_s"] = time.perf_counter() - t0
    return status


def _section(name: str, path: Path, docs_dir: Path) -> str:
    title = TITLES.get(name, name)
    out = [f"## {title}", ""]
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return "\n".join(out + [f"_no results ({exc})_", ""])
    mod = None
    try:
        mod = importlib.import_module(f"benchmarks.{name}")
    except Exception:  # noqa: BLE001
        pass
    table = None
    for fn_name in ("format_tables", "format_table"):  # a whole report's tables, else one table of it
        fn = getattr(mod, fn_name, None)
        if fn is not None:
            try:
                table = fn(report)
                break
            except Exception as exc:  # noqa: BLE001 - a JSON from an older version
                table = f"_could not format {path.name}: {type(exc).__name__}: {exc}_"
    if table is None and mod is not None and callable(getattr(mod, "table", None)):
        rows = report.get("results") or report.get("rows") or []
        try:
            table = mod.table(rows)
        except Exception as exc:  # noqa: BLE001
            table = f"_could not format {path.name}: {type(exc).__name__}: {exc}_"
    m = report.get("machine", {}) if isinstance(report, dict) else {}
    cfg = report.get("config", {}) if isinstance(report, dict) else {}
    load = m.get("load_average") or cfg.get("load_average_before")
    out.append(f"`benchmarks/{name}.py` → `{path.name}`; torch {m.get('torch', '?')}, "
               f"{m.get('torch_threads', '?')} threads" + (f", load average {load}" if load else ""))
    out += ["", table or f"_see `{path.name}`_", ""]
    pngs = set(docs_dir.glob(f"{name}*.png")) | ({docs_dir / PLOTS[name]} if name in PLOTS else set())
    for png in sorted(p for p in pngs if p.exists()):
        out += [f"![{name}]({png.name})", ""]
    return "\n".join(out)


def recorded_peers(paths: Sequence[Path]) -> Tuple[Dict[str, List[str]], List[str]]:
    """The peer versions the results JSONs recorded when they were measured (``machine.peers``):
    ``({peer: sorted versions}, peers none of them had)``; a JSON that cannot be read is left out."""
    versions: Dict[str, set] = {}
    for path in paths:
        try:
            rec = json.loads(path.read_text(encoding="utf-8")).get("machine", {}).get("peers", {})
        except (OSError, ValueError, AttributeError):
            continue
        for name, version in (rec or {}).items():
            versions.setdefault(name, set())
            if version:
                versions[name].add(str(version))
    return ({k: sorted(v) for k, v in versions.items() if v}, sorted(k for k, v in versions.items() if not v))


def write_report(args: argparse.Namespace, names: Sequence[str], status: Dict[str, Dict[str, Any]]) -> Path:
    m = pu.machine_info()
    found, missing_all = recorded_peers([args.results_dir / f"{n}.json" for n in names])
    peers = ", ".join(f"{k} {' / '.join(v)}" for k, v in found.items()) or "none"
    missing = ", ".join(missing_all)
    lines = [
        "# Benchmark results",
        "",
        f"Generated by `python -m benchmarks.run` on {datetime.date.today().isoformat()}. "
        "Every number is measured, on a **shared, noisy machine** (other jobs ran at the same "
        "time: read ratios and the *min* columns, not absolute medians).",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores, GPU: {m['gpu'] or 'none'} (each section gives the torch "
        "threads of its own measurement)",
        f"- software: Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}",
        f"- peers, as the results JSONs recorded them when measured: {peers}"
        + (f" (absent from every run: {missing})" if missing else ""),
        f"- load average when the page was written: {m['load_average']}",
        "",
        "Raw data: `benchmarks/results/*.json` (each with its own machine and config record).",
        "",
    ]
    failed = [n for n, s in status.items() if not s.get("ok")]
    if failed:
        lines += [f"**Failed in this run:** {', '.join(failed)} (see the runner's output).", ""]
    for name in names:
        path = args.results_dir / f"{name}.json"
        if path.exists():
            lines.append(_section(name, path, args.docs_dir))
    lines += ["", NOTES]
    args.docs_dir.mkdir(parents=True, exist_ok=True)
    out = args.docs_dir / "results.md"
    out.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.quick:
        print(f"quick run: results in {args.results_dir}, docs in {args.docs_dir}", flush=True)
    names = discover()
    selected = [n for n in names if (args.only is None or n in args.only) and n not in args.skip]
    readme = readme_target(args)
    if readme is not None:
        _readme_summary.check_markers(readme)  # fail now, not after hours of benchmarks
    else:
        why = "--no-readme" if args.no_readme else "scratch --results-dir; pass --readme PATH"
        print(f"README not written ({why})")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    status: Dict[str, Dict[str, Any]] = {}
    if not args.report_only:
        status = run_modules(selected, args)
        for name, st in status.items():
            print(f"{name:16s} {'ok' if st.get('ok') else 'FAILED'}  {st['wall_s']:.1f} s  {st.get('error', st.get('skipped', ''))}")
    if not args.no_report:
        write_report(args, names, status)
    if readme is not None:
        print(f"wrote {_readme_summary.update_readme(readme, args.results_dir)} (results block)")
    return 0 if all(s.get("ok") for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
