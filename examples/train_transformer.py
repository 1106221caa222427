"""Train a small decoder-only transformer on generated character-level text with K-FAC, VI or AdamW.

The text ships with the example: a seeded generator writes simple grammar sentences and
arithmetic strings (``"the old man sees a red ball. 17+25=42. "``), so nothing is downloaded
and the train and validation texts (different seeds) are reproducible. The model is a GPT-style
decoder (learned positional embeddings, pre-LayerNorm blocks with causal self-attention written
as ``nn.Linear`` q/k/v/out projections + ``F.scaled_dot_product_attention(is_causal=True)``,
GELU MLP), 2 layers of width 64 with 4 heads by default.

Examples::

    python examples/train_transformer.py                                   # sso-kfac, 4 epochs
    python examples/train_transformer.py --optimizer adamw sso-kfac vi-diag --plot loss.png
    torchrun --nproc_per_node=2 examples/train_transformer.py              # data-parallel
    mpiexec -n 2 python examples/train_transformer.py --optimizer vi-diag

The model returns logits ``[N, T, V]``; the loss and the torchsso2 curvature see them as
``[N·T, V]`` rows (``output_selector=flat_logits``, the README's recipe for sequence outputs):
the Monte-Carlo Fisher over the N·T rows, K-FAC in the K-FAC-expand convention.

The output head shares the token embedding's weight (``head.weight = tok.weight``, a module use:
torchsso2 gives the shared parameter one curvature block with both uses' contributions) unless
``--untie-weights`` is given. Tying is the default when the installed torchsso2 accepts a parameter
shared between two modules (checked at start-up on a tiny tied model); otherwise it is off and
``--tie-weights`` is an error for the torchsso2 optimizers.
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from examples.common import (batches, data_shard, launch_note, mean_over_processes, nonnegative_float,  # noqa: E402
                             nonnegative_int, num_batches, positive_float, positive_int, process_rank, progress_bar,
                             reject_unused_option, world_size, write_json)
from torchsso2 import SecondOrderOptimizer, VIOptimizer  # noqa: E402
from torchsso2.distributed import shutdown  # noqa: E402

OPTIMIZERS: Tuple[str, ...] = ("sso-kfac", "vi-diag", "adamw")

#: default learning rate per optimizer. sso-kfac: large enough that the KL clip (kl_clip=1e-3) sets the step length at every step, so the lr itself hardly matters (0.1 and 0.3 gave the
#: same run); vi-diag: the library's default; adamw: the best of 3e-3, 5e-3, 1e-2, 2e-2 (benchmarks/transformer.py)
DEFAULT_LR: Dict[str, float] = {"sso-kfac": 0.1,
                                 "vi-diag": float(inspect.signature(VIOptimizer.__init__).parameters["lr"].default),
                                 "adamw": 1e-2}

#: K-FAC on this transformer (docs/guide.md, "Transformers"): the library's defaults (eigen method,
#: fisher_mc) except a KL clip of 1e-3 (the library's default at 1/1 intervals; with a decomposition every
#: 10 steps its default would be 1e-3/√10), a small damping, momentum 0.8, and a fresh curvature every 10 steps
#: that the running average forgets quickly (its decay is per estimate: 0.95 every 10 steps would remember
#: ~200 steps), decomposed as often. 200 steps, untied, 10/10 intervals, val loss: damping 0.1 (the
#: default) 1.52, 1e-2 0.52, 1e-3 0.43; momentum 0.9 0.43, 0.8 0.42, 0.6 0.45; ema_decay 0.95 0.45, 0.7 0.43;
#: kl_clip 3e-3 at damping 1e-3 0.70. Tied, seed 0: decompositions every 10 / 30 / 100 steps 0.43 / 0.42 /
#: 0.48, but over seeds 0-2 every 30 reached the best AdamW's loss later than every 10 (benchmarks/transformer.py).
#: The first 10 steps (one interval) estimate and decompose every step (curv_warmup_steps): the curvature of
#: the initial weights, reused for 10 steps, barely moved the loss (3.12 -> 3.09 in 20 steps on seed 2). Mean
#: val loss over seeds 0-2 at steps 50 / 100 / 200: no warm-up 1.83 / 1.11 / 0.446, warm-up 5 steps 1.42 /
#: 0.447 / 0.420, 10 steps 1.09 / 0.430 / 0.418, 20 steps 0.83 / 0.429 / 0.416 (a warm-up step costs ~2.8
#: AdamW steps, a 10/10 step ~1.2; 20 gained <= 0.002 after step 100 for 10 more such steps)
KFAC_SETTINGS: Dict[str, Any] = dict(damping=1e-3, momentum=0.8, ema_decay=0.7, kl_clip=1e-3,
                                     curv_update_interval=10, inv_update_interval=10, curv_warmup_steps=10)

#: VI diag: the library's defaults (one weight sample per step, curvature every step)
VI_SETTINGS: Dict[str, Any] = dict()

#: AdamW's decoupled weight decay unless --weight-decay says otherwise (the only optimizer that takes one)
DEFAULT_WEIGHT_DECAY = 0.01


# --------------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------------
_SUBJECTS = ("the cat", "a dog", "the old man", "my sister", "a small bird", "the teacher", "our friend")
_VERBS = ("sees", "likes", "finds", "follows", "helps", "paints")
_OBJECTS = ("a red ball", "the green house", "an old book", "the river", "a tall tree", "the moon")
_ENDINGS = ("", " today", " at night", " again")

#: every character the generator can write (fixed order: the vocabulary does not depend on the seed)
ALPHABET: str = " +.=0123456789" + "".join(sorted(set("".join(_SUBJECTS + _VERBS + _OBJECTS + _ENDINGS)) - {" "}))


def generate_text(num_chars: int, seed: int) -> str:
    """``num_chars`` characters of seeded text: grammar sentences and ``a+b=c.`` sums (a, b < 50)."""
    if num_chars < 1:
        raise ValueError(f"num_chars={num_chars}; expected >= 1")
    rng = random.Random(seed)
    parts: List[str] = []
    size = 0
    while size < num_chars:
        if rng.random() < 0.35:
            a, b = rng.randrange(50), rng.randrange(50)
            s = f"{a}+{b}={a + b}. "
        else:
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}. "
        parts.append(s)
        size += len(s)
    return "".join(parts)[:num_chars]


def encode(text: str) -> Tensor:
    """Character ids (``ALPHABET`` order), long ``[len(text)]``."""
    index = {c: i for i, c in enumerate(ALPHABET)}
    try:
        return torch.tensor([index[c] for c in text], dtype=torch.long)
    except KeyError as exc:
        raise ValueError(f"character {exc.args[0]!r} is not in the example's alphabet {ALPHABET!r}") from None


@dataclass
class TextData:
    """Non-overlapping windows of the encoded text: ``x_*`` / ``y_*`` long ``[S, T]`` (``y`` = ``x`` shifted by one)."""

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor

    @property
    def vocab_size(self) -> int:
        return len(ALPHABET)

    @property
    def train_tokens(self) -> int:
        return self.y_train.numel()


def _windows(ids: Tensor, seq_len: int) -> Tuple[Tensor, Tensor]:
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise ValueError(f"text of {len(ids)} characters is shorter than one window of seq_len + 1 = {seq_len + 1}")
    x = ids[:n * seq_len].view(n, seq_len)
    y = ids[1:n * seq_len + 1].view(n, seq_len)
    return x, y


def load_text_data(train_chars: int, val_chars: int, seq_len: int, seed: int = 0) -> TextData:
    """Train text from ``seed``, validation text from ``seed + 1000``, cut into ``seq_len`` windows."""
    x_tr, y_tr = _windows(encode(generate_text(train_chars, seed)), seq_len)
    x_va, y_va = _windows(encode(generate_text(val_chars, seed + 1000)), seq_len)
    return TextData(x_tr, y_tr, x_va, y_va)


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention from four ``nn.Linear`` (q, k, v, out) and SDPA; ``[N, T, d] -> [N, T, d]``."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        n, t, d = x.shape

        def heads(z: Tensor) -> Tensor:  # [N, T, d] -> [N, H, T, d/H]
            return z.view(n, t, self.num_heads, d // self.num_heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.out(a.transpose(1, 2).reshape(n, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` (GELU, 4× width)."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, num_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharTransformer(nn.Module):
    """Decoder-only transformer: ids ``[N, T]`` -> logits ``[N, T, V]``.

    ``tie_weights``: the output head reuses the token embedding's ``[V, d]`` weight.
    """

    def __init__(self, vocab_size: int, d_model: int = 64, num_heads: int = 4, num_layers: int = 2,
                 max_len: int = 128, tie_weights: bool = True) -> None:
        super().__init__()
        self.max_len = max_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList([Block(d_model, num_heads) for _ in range(num_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            # the shared weight at the head's scale (U(±1/√d), nn.Linear's): N(0, 1) logits would be huge.
            # The positional table at the same scale: left at N(0, 1) it is 8x the token signal at d=64,
            # and the tied model trained much more slowly (AdamW lr 1e-2, 200 steps: val loss 1.78 vs 0.49)
            for emb in (self.tok, self.pos):
                nn.init.uniform_(emb.weight, -d_model ** -0.5, d_model ** -0.5)
            self.head.weight = self.tok.weight

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence of {t} tokens is longer than max_len={self.max_len}")
        z = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            z = block(z)
        return self.head(self.ln_f(z))


def flat_logits(out: Tensor) -> Tensor:
    """``[N, T, V] -> [N·T, V]``: the rows the loss and the curvature see (torchsso2's ``output_selector``)."""
    return out.reshape(-1, out.shape[-1])


def tying_supported() -> bool:
    """Whether this torchsso2 builds and steps K-FAC and VI diag optimizers on a tiny tied model.

    Only the library's refusal of shared parameters (a ``ValueError`` naming them) counts as
    "not supported"; any other error propagates.
    """
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (2, 4), generator=gen)
    for make in (lambda m: SecondOrderOptimizer(m, lr=0.01, output_selector=flat_logits, **KFAC_SETTINGS),
                 lambda m: VIOptimizer(m, dataset_size=8, lr=0.01, output_selector=flat_logits, seed=0,
                                       **VI_SETTINGS)):
        model = CharTransformer(5, d_model=8, num_heads=2, num_layers=1, max_len=4, tie_weights=True)
        try:
            opt = make(model)
            opt.step(make_closure(opt, model, ids[:, :-1], ids[:, 1:]))
        except ValueError as exc:
            if "shared" in str(exc):
                return False
            raise
    return True


# --------------------------------------------------------------------------------------------
# optimizers and training
# --------------------------------------------------------------------------------------------
def make_optimizer(name: str, model: nn.Module, lr: Optional[float], train_tokens: int, seed: int,
                   weight_decay: Optional[float] = None) -> torch.optim.Optimizer:
    """``sso-kfac`` (SecondOrderOptimizer), ``vi-diag`` (VIOptimizer, N = training tokens) or ``adamw``
    (``weight_decay``: AdamW's, :data:`DEFAULT_WEIGHT_DECAY` when None)."""
    lr = DEFAULT_LR[name] if lr is None else lr
    weight_decay = DEFAULT_WEIGHT_DECAY if weight_decay is None else weight_decay
    if name == "sso-kfac":
        return SecondOrderOptimizer(model, lr=lr, seed=seed, output_selector=flat_logits, **KFAC_SETTINGS)
    if name == "vi-diag":
        # the loss is a mean over token rows, so the dataset size is the number of training tokens
        return VIOptimizer(model, dataset_size=train_tokens, lr=lr, seed=seed, output_selector=flat_logits,
                           **VI_SETTINGS)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer={name!r}; expected one of {', '.join(OPTIMIZERS)}")


def make_closure(opt: torch.optim.Optimizer, model: nn.Module, x: Tensor, y: Tensor
                 ) -> Callable[[], Tuple[Tensor, Tensor]]:
    """zero_grad / forward / token cross-entropy / backward; returns ``(loss, logits [N, T, V])``."""

    def closure() -> Tuple[Tensor, Tensor]:
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(flat_logits(out), y.reshape(-1))
        loss.backward()
        return loss, out

    return closure


def optimizer_step(opt: torch.optim.Optimizer, closure: Callable[[], Tuple[Tensor, Tensor]]) -> Tensor:
    """One step of any optimizer with a ``(loss, output)`` closure; returns the loss."""
    if isinstance(opt, (SecondOrderOptimizer, VIOptimizer)):
        loss, _ = opt.step(closure)
        return loss
    loss, _ = closure()
    opt.step()
    return loss


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 64) -> float:
    """Mean token cross-entropy (nats) of ``model`` on ``(x, y)`` in eval mode (at the VI posterior mean)."""
    model.eval()
    total = 0.0
    for i in range(0, len(x), batch_size):
        out = model(x[i:i + batch_size])
        total += float(F.cross_entropy(flat_logits(out), y[i:i + batch_size].reshape(-1), reduction="sum"))
    model.train()
    return total / y.numel()


@dataclass
class EpochRecord:
    """One row of a history; ``wall_s`` counts training time only (evaluation excluded);
    ``train_loss`` is None before training (epoch 0)."""

    epoch: int
    step: int
    train_loss: Optional[float]
    val_loss: float
    wall_s: float


def train_one(name: str, args: argparse.Namespace, data: TextData, tie: bool) -> Dict[str, Any]:
    """Train a fresh model with optimizer ``name``; returns a JSON-ready summary with its history."""
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = CharTransformer(data.vocab_size, args.d_model, args.heads, args.layers, args.seq_len, tie)
    opt = make_optimizer(name, model, args.lr, data.train_tokens, args.seed, args.weight_decay)
    lr = opt.param_groups[0]["lr"]
    shards, shard = data_shard(opt)
    if args.batch_size % shards:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {shards} data-parallel processes")
    steps_per_epoch = num_batches(len(data.x_train), args.batch_size)
    if args.steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, args.steps_per_epoch)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{name}: lr={lr:g}, {n_params} parameters, {steps_per_epoch} steps/epoch", flush=True)
    bar = progress_bar(args.epochs * steps_per_epoch, name, args.no_progress)
    history: List[EpochRecord] = []
    step_log: List[Tuple[float, float]] = []  # (wall_s, train loss) per step, for the plot
    wall, step = 0.0, 0
    val0 = evaluate(model, data.x_val, data.y_val)
    bar.write(f"{name} epoch   0/{args.epochs}  val loss {val0:.4f}")
    history.append(EpochRecord(0, 0, None, val0, 0.0))
    for epoch in range(1, args.epochs + 1):
        bar.set_description(f"{name} epoch {epoch}/{args.epochs}")
        total, count = 0.0, 0
        start = time.perf_counter()
        for i, idx in enumerate(batches(len(data.x_train), args.batch_size, gen)):
            if i >= steps_per_epoch:
                break
            idx = idx.chunk(shards)[shard]
            loss = float(optimizer_step(opt, make_closure(opt, model, data.x_train[idx], data.y_train[idx])).detach())
            step += 1
            total += loss
            count += 1
            step_log.append((wall + time.perf_counter() - start, loss))
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        wall += time.perf_counter() - start
        # the mean over every process's shard: the same number of steps on each
        rec = EpochRecord(epoch, step, mean_over_processes(opt, total, count), evaluate(model, data.x_val, data.y_val),
                          wall)
        history.append(rec)
        bar.write(f"{name} epoch {epoch:3d}/{args.epochs}  train loss {rec.train_loss:.4f}  "
                  f"val loss {rec.val_loss:.4f}  ({rec.wall_s:.1f} s)")
        if not math.isfinite(rec.val_loss):
            bar.write(f"{name}: validation loss is not finite; stopping this run")
            break
    bar.close()
    skipped = getattr(opt, "num_skipped", 0)
    print(f"final val loss: {history[-1].val_loss:.4f} ({name}, {step} steps, {wall:.1f} s"
          f"{f', {skipped} skipped steps' if skipped else ''})", flush=True)
    return {"optimizer": name, "lr": lr, "parameters": n_params, "steps": step, "wall_s": wall,
            "final_val_loss": history[-1].val_loss, "skipped_steps": skipped,
            "history": [vars(r) for r in history], "steps_log": step_log}


def plot_losses(results: Sequence[Dict[str, Any]], path: Path) -> None:
    """Training loss per step (faint) and validation loss per epoch (markers) against training wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, res in enumerate(results):
        color = f"C{i}"
        if res["steps_log"]:
            t, loss = zip(*res["steps_log"])
            ax.plot(t, loss, color=color, alpha=0.3, lw=0.8)
        hist = res["history"]
        ax.plot([h["wall_s"] for h in hist], [h["val_loss"] for h in hist], "o-", color=color,
                label=f"{res['optimizer']} (val)")
    ax.set_xlabel("training time [s]")
    ax.set_ylabel("token cross-entropy [nats]")
    ax.set_title("char transformer: train (faint) and validation loss")
    ax.legend()
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None, tie_default: Optional[bool] = None) -> argparse.Namespace:
    """Parse the command line; ``tie_default``: whether tying is supported (default: :func:`tying_supported`)."""
    if tie_default is None:
        tie_default = tying_supported()
    lrs = ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items())
    tie_help = ("tie the output head to the token embedding (default: on; this torchsso2 gives a parameter "
                "shared between modules one curvature block)" if tie_default else
                "tie the output head to the token embedding (default: off, because this torchsso2 refuses a "
                "parameter shared between modules; tying with sso-kfac / vi-diag needs the library's "
                "tied-parameter support, adamw can tie anyway)")
    p = argparse.ArgumentParser(
        prog="python examples/train_transformer.py",
        description="Train a small decoder-only transformer on generated character-level text with "
        "torchsso2's SecondOrderOptimizer (K-FAC), VIOptimizer (diagonal) or AdamW; prints the validation "
        "loss after every epoch and can plot loss against time.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--optimizer", nargs="+", choices=OPTIMIZERS, default=["sso-kfac"],
                   help="one or more optimizers, trained one after the other on the same data")
    p.add_argument("--epochs", type=positive_int, default=4, help="passes over the training windows")
    p.add_argument("--steps-per-epoch", type=nonnegative_int, default=0,
                   help="cap on the steps of an epoch (0: a full pass)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="sequences per global batch")
    p.add_argument("--seq-len", type=positive_int, default=128,
                   help="tokens per sequence (also the positional table size)")
    p.add_argument("--train-chars", type=positive_int, default=200_000,
                   help="characters of generated training text (at least --seq-len + 1)")
    p.add_argument("--val-chars", type=positive_int, default=16_384,
                   help="characters of generated validation text (at least --seq-len + 1)")
    p.add_argument("--d-model", type=positive_int, default=64, help="model width")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    p.add_argument("--layers", type=positive_int, default=2, help="transformer blocks")
    p.add_argument("--tie-weights", action=argparse.BooleanOptionalAction, default=tie_default, help=tie_help)
    p.add_argument("--untie-weights", dest="tie_weights", action="store_false", default=argparse.SUPPRESS,
                   help="give the output head its own weight (same as --no-tie-weights)")
    p.add_argument("--lr", type=positive_float, default=None, help=f"learning rate (None: per optimizer, {lrs})")
    p.add_argument("--weight-decay", type=nonnegative_float, default=None,
                   help=f"adamw only: its decoupled weight decay (None: {DEFAULT_WEIGHT_DECAY:g}); an error "
                   "when adamw is not among --optimizer")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a loss-vs-time PNG here")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the histories as JSON here")
    p.add_argument("--seed", type=int, default=0, help="seed of the text, model init, batch order and sampling")
    p.add_argument("--threads", type=nonnegative_int, default=1,
                   help="torch.set_num_threads (the model is small; 0: leave torch's default)")
    p.add_argument("--no-progress", action="store_true", help="disable the tqdm progress bar")
    args = p.parse_args(argv)
    for option, chars in (("--train-chars", args.train_chars), ("--val-chars", args.val_chars)):
        if chars < args.seq_len + 1:
            p.error(f"{option} {chars} is shorter than one window of --seq-len + 1 = {args.seq_len + 1} characters")
    reject_unused_option(p, "--weight-decay", args.weight_decay is not None, args.optimizer, ("adamw",))
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if args.tie_weights and not tie_default and any(o != "adamw" for o in args.optimizer):
        p.error("--tie-weights: this torchsso2 refuses parameters shared between modules (ValueError); "
                "tying with sso-kfac / vi-diag needs the library's tied-parameter support")
    return args


def train(args: argparse.Namespace) -> Dict[str, Any]:
    """Run every optimizer of ``args.optimizer``; returns a JSON-ready summary."""
    if world_size() > 1 and "adamw" in args.optimizer:
        raise SystemExit("--optimizer adamw is single-process here; launch sso-kfac / vi-diag with "
                         "mpiexec/torchrun (they average gradients and curvature over ranks)")
    if process_rank() != 0:  # only rank 0 reports
        args.no_progress = True
        sys.stdout = open(os.devnull, "w")
    if args.threads:
        torch.set_num_threads(args.threads)
    data = load_text_data(args.train_chars, args.val_chars, args.seq_len, args.seed)
    print(f"text: {data.train_tokens} train / {data.y_val.numel()} validation tokens, vocabulary "
          f"{data.vocab_size}; transformer {args.layers}x(d={args.d_model}, {args.heads} heads), "
          f"{'tied' if args.tie_weights else 'untied'} embedding/head; batch {args.batch_size}x{args.seq_len}"
          + launch_note(), flush=True)
    results = [train_one(name, args, data, args.tie_weights) for name in args.optimizer]
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "results": results}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    summary = train(args)
    if process_rank() == 0:  # one writer under mpiexec/torchrun
        if args.plot is not None:
            plot_losses(summary["results"], args.plot)
            print(f"wrote {args.plot}")
        if args.json is not None:
            write_json(args.json, summary)  # strict JSON: a non-finite loss is written as null
            print(f"wrote {args.json}")
    shutdown()  # under torchrun: every rank finishes before the process group goes
    return 0


if __name__ == "__main__":
    sys.exit(main())
