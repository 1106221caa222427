"""Exact diagonal GGN of sequence models (logits ``[N, T, C]``, cross-entropy over every position):
its cost against the Monte-Carlo Fisher, the empirical Fisher and BackPACK's ``DiagGGNExact``.

Models (float32, one thread unless ``--threads``):

* ``lm-mlp``: Embedding(V, d) → Linear(d, h) → Tanh → Linear(h, V) at every position: a model
  BackPACK supports (its Linear on ``[N, T, d]``, its CrossEntropyLoss on ``[N, C, T]``).
* ``lm-attn``: a small pre-LN decoder-only transformer: token + position Embedding, ``--layers``
  blocks of causal ``nn.MultiheadAttention`` and a 4·d MLP with LayerNorms, LayerNorm, Linear head
  (BackPACK has no nn.MultiheadAttention or LayerNorm support).

Timed (round-robin over the variants, min and median of ``--repeats``): ``curvature.compute`` with
``kind="fisher"`` (exact: ``T·(C−1)`` backpropagated vectors), ``"fisher_mc"`` (1 sample) and
``"empirical_fisher"``, all ``approx="diag"``, and BackPACK's ``DiagGGNExact`` (``T·C`` vectors)
where it applies and is installed (``pip install backpack-for-pytorch``); the BackPACK and exact
diagonals are compared (max relative difference).

Example (about 2 minutes on one core)::

    python benchmarks/sequence_curvature.py                   # prints the table
    python benchmarks/sequence_curvature.py --json out.json   # and writes the report
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import curvature  # noqa: E402
from benchmarks.common import fill_unset, load_average, markdown_table, write_json  # noqa: E402
from examples.common import positive_int  # noqa: E402
from benchmarks._peer_utils import peer, skip_message  # noqa: E402


class MLPLM(nn.Module):
    def __init__(self, vocab: int, d: int, hidden: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, hidden)
        self.act = nn.Tanh()
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.act(self.fc(self.emb(ids))))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, z: Tensor) -> Tensor:
        t = z.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=z.device).triu(1)
        h = self.ln1(z)
        z = z + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return z + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(z))))


class AttnLM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, max_len: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        # positions with the batch dimension: a module's output must carry the examples (curvature.sequence)
        z = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device).expand_as(ids))
        for blk in self.blocks:
            z = blk(z)
        return self.head(self.ln_f(z))


def rows(out: Tensor) -> Tensor:
    return out.reshape(-1, out.shape[-1])


def ours(model: nn.Module, x: Tensor, y: Tensor, kind: str) -> Callable[[], Tensor]:
    gen = torch.Generator().manual_seed(0)

    def run() -> Tensor:
        c = curvature.compute(model, x, y, kind=kind, approx="diag", output_selector=rows, generator=gen)
        return torch.cat([d.reshape(-1) for d in c.diagonal()])
    return run


def backpack_diag(model: nn.Module, x: Tensor, y: Tensor) -> Optional[Callable[[], Tensor]]:
    """BackPACK's exact diagonal GGN of the mean token cross-entropy, or None when not installed."""
    try:
        from backpack import backpack, extend
        from backpack.custom_module.permute import Permute
        from backpack.extensions import DiagGGNExact
    except ImportError:
        return None
    own = copy.deepcopy(model)  # BackPACK's hooks stay off the model the engine records
    net = extend(nn.Sequential(own.emb, own.fc, own.act, own.head, Permute(0, 2, 1)))
    lossf = extend(nn.CrossEntropyLoss())
    target = y.view(x.shape[0], x.shape[1])

    def run() -> Tensor:
        net.zero_grad()
        loss = lossf(net(x), target)
        with backpack(DiagGGNExact()):
            loss.backward()
        return torch.cat([p.diag_ggn_exact.reshape(-1) for p in net.parameters()])
    return run


def time_round_robin(fns: Dict[str, Callable[[], Tensor]], repeats: int) -> Dict[str, Dict[str, float]]:
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: {"min_ms": 1e3 * min(v), "median_ms": 1e3 * statistics.median(v)} for k, v in times.items()}


def run_model(name: str, args: argparse.Namespace) -> Dict[str, Any]:
    torch.manual_seed(args.seed)
    if name == "lm-mlp":
        model = MLPLM(args.vocab, args.d_model, 2 * args.d_model)
    else:
        model = AttnLM(args.vocab, args.d_model, args.heads, args.layers, args.seq_len)
    model.eval()
    x = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    y = torch.randint(0, args.vocab, (args.batch * args.seq_len,))
    fns: Dict[str, Callable[[], Tensor]] = {k: ours(model, x, y, k) for k in ("fisher", "fisher_mc", "empirical_fisher")}
    agree = None
    if name == "lm-mlp":
        bp = backpack_diag(model, x, y)
        if bp is not None:
            fns["backpack DiagGGNExact"] = bp
            a, b = fns["fisher"](), bp()
            agree = float((a - b).abs().max() / b.abs().max())
    timed = time_round_robin(fns, args.repeats)
    params = sum(p.numel() for p in model.parameters())
    return {"model": name, "params": params, "batch": args.batch, "seq_len": args.seq_len, "vocab": args.vocab,
            "vectors_exact": args.seq_len * (args.vocab - 1), "times": timed,
            "backpack_max_rel_diff": agree}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--models", nargs="+", default=["lm-mlp", "lm-attn"], choices=["lm-mlp", "lm-attn"], help='language models: an MLP LM and an attention LM (default: both)')
    p.add_argument("--batch", type=positive_int, default=None, help='sequences per batch (default 8; --quick 2)')
    p.add_argument("--seq-len", type=positive_int, default=None, help='tokens per sequence (default 32; --quick 6)')
    p.add_argument("--vocab", type=positive_int, default=None, help='vocabulary size = classes C >= 2 (default 40; --quick 7)')
    p.add_argument("--d-model", type=positive_int, default=None, help='model width (default 32; --quick 8)')
    p.add_argument("--heads", type=positive_int, default=None, help='attention heads, dividing --d-model (default 4; --quick 2)')
    p.add_argument("--layers", type=positive_int, default=2, help='layers (default 2)')
    p.add_argument("--repeats", type=positive_int, default=None, help='round-robin timing repeats (default 5; --quick 2)')
    p.add_argument("--threads", type=positive_int, default=1, help='torch.set_num_threads (default 1)')
    p.add_argument("--seed", type=int, default=0, help='seed of the model and data (default 0)')
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    p.add_argument("--json", type=Path, default=None, help='write the JSON report here (default: none)')
    args = p.parse_args(argv)
    sizes = {"batch": (8, 2), "seq_len": (32, 6), "vocab": (40, 7), "d_model": (32, 8), "repeats": (5, 2), "heads": (4, 2)}
    fill_unset(args, {key: pair[args.quick] for key, pair in sizes.items()})  # (default, --quick)
    if args.vocab < 2 or args.d_model % args.heads:
        p.error(f"--vocab must be >= 2 and --heads must divide --d-model (got vocab {args.vocab}, d-model "
                f"{args.d_model}, heads {args.heads})")
    torch.set_num_threads(args.threads)
    report: Dict[str, Any] = {"threads": args.threads, "load_average_before": load_average(),
                              "results": [run_model(m, args) for m in args.models],
                              "skipped": {} if peer("backpack") is not None or "lm-mlp" not in args.models
                              else {"backpack": skip_message("backpack")}}
    report["load_average_after"] = load_average()
    table = []
    for r in report["results"]:
        t = r["times"]
        for k, v in t.items():
            table.append([r["model"], k, f"{v['min_ms']:.1f}", f"{v['median_ms']:.1f}",
                          f"{v['min_ms'] / t['fisher_mc']['min_ms']:.1f}×"])
    print(markdown_table(["model", "diag of", "min ms", "median ms", "÷ fisher_mc (min)"], table))
    for r in report["results"]:
        if r["backpack_max_rel_diff"] is not None:
            print(f"{r['model']}: exact vs BackPACK diagonal max relative difference {r['backpack_max_rel_diff']:.1e}")
    for name, why in report["skipped"].items():
        print(f"skipped {name}: {why}")
    print(f"load average {report['load_average_before']} -> {report['load_average_after']}")
    if args.json is not None:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
