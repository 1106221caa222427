"""VI diag against IVON, one difference at a time (issue 27; validation split only, not timed).

On the tasks of :mod:`benchmarks.vi_quality`, ``VIOptimizer(approx="diag")`` and ``ivon.IVON`` at
their library defaults run the same step up to five differences (:data:`DIFFERENCES`):

1. ``debias``: IVON divides its momentum by ``1 − β₁^t``; VIOptimizer does not (``momentum_debias``);
2. ``weight_decay``: the prior per example, VI's ``δ/N`` (δ = 1) against IVON's ``weight_decay`` 1e-4;
3. ``prior_at_mean``: IVON adds the prior's gradient at the current mean, VI inside the momentum buffer;
4. ``kl_clip``: VI's KL clip of the mean's step (0.1), IVON none (``clip_radius`` ∞);
5. ``independent``: the benchmark predicts IVON with independent samples, VI with antithetic pairs.

:func:`train_variant` is one flat implementation of that shared step with a switch per difference
(:class:`StepSettings`); :data:`VI_SETTINGS` is VIOptimizer's step, :data:`IVON_SETTINGS` IVON's
(``tests/test_vi_differences.py`` checks both against the real optimizers, weight for weight, when fed
the same noise). Every variant of one seed draws the same weight noise and uses the same
initialisation and batches, so the paired differences between variants are precise. The lr is
IVON's ``lr`` (VI's ``lr/(1 − momentum)``: VI's momentum sums the gradients, IVON's averages them).

The run prints, per task, the validation NLL / ECE / accuracy of VI's settings, of each single swap
to IVON's and of all of them, paired against VI's settings (mean ± standard error over the seeds);
then VIOptimizer, ``VIOptimizer(momentum_debias=True)`` and ``ivon.IVON`` themselves, paired against
VIOptimizer, the last also per block of 20 seeds. The test split is never read.

Run (9 minutes on one thread for the digits CNN and 80 seeds, at a load average of 2–4 on 2 cores)::

    OMP_NUM_THREADS=1 python -m benchmarks.vi_differences --tasks digits-cnn --seeds 80
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks import vi_quality as vq  # noqa: E402
from torchsso2 import VIOptimizer, metrics  # noqa: E402

#: the lr of each digits task as IVON's lr, one for every variant: VI diag's choice in ``benchmarks/vi.py``
#: (CNN: VI 0.01 = 0.1·(1 − 0.9), where IVON also chooses 0.1; MLP: VI 0.32, where IVON chooses 0.32 itself,
#: a 10× shorter step, so ``ivon.IVON`` at 3.2 is not IVON at its own choice there: pass ``--lr``)
DEFAULT_LR: Dict[str, float] = {"digits-cnn": 0.1, "digits-mlp": 3.2}
MOMENTUM = 0.9


@dataclass(frozen=True)
class StepSettings:
    """One variant of the shared step (see the module docstring for each switch).

    ``weight_decay``: the prior precision per example; None: VI's ``prior_precision/N`` (δ = 1).
    ``lr_scale``: IVON's ``rescale_lr`` factor ``hess_init + weight_decay`` (1 for VI).
    """

    debias: bool = False
    weight_decay: Optional[float] = None
    prior_at_mean: bool = False
    kl_clip: Optional[float] = 0.1
    antithetic: bool = True
    lr_scale: float = 1.0
    curvature_init: float = 1.0
    ema_decay: float = 0.99999
    prior_precision: float = 1.0


#: VIOptimizer(approx="diag")'s step at its defaults
VI_SETTINGS = StepSettings()
#: ivon.IVON's step at its defaults (``rescale_lr``: lr·(hess_init + weight_decay))
IVON_SETTINGS = StepSettings(debias=True, weight_decay=1e-4, prior_at_mean=True, kl_clip=None, antithetic=False,
                             lr_scale=1.0 + 1e-4)
#: the single swaps from VI's settings to IVON's
DIFFERENCES: Dict[str, Dict[str, Any]] = {
    "debias": {"debias": True},
    "weight_decay": {"weight_decay": 1e-4},
    "prior_at_mean": {"prior_at_mean": True},
    "kl_clip": {"kl_clip": None},
    "independent": {"antithetic": False},
}


def variants() -> Dict[str, StepSettings]:
    """``{"vi": VI's settings, "swap <name>": one difference swapped to IVON's, "ivon": all of them}``."""
    out = {"vi": VI_SETTINGS}
    out.update({f"swap {k}": replace(VI_SETTINGS, **v) for k, v in DIFFERENCES.items()})
    out["ivon"] = IVON_SETTINGS
    return out


Draw = Callable[[int, int], Tensor]  # (step t = 1, 2, …, numel P) -> a standard normal [P]


def seeded_draw(seed: int) -> Draw:
    """The weight noise of every variant of seed ``seed``: one generator, one ``randn(P)`` per step."""
    gen = torch.Generator().manual_seed(777 + seed)
    return lambda t, numel: torch.randn(numel, generator=gen)


def _load(params: Sequence[nn.Parameter], vec: Tensor) -> None:
    offset = 0
    for p in params:
        p.data = vec[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


@dataclass
class Posterior:
    """A trained variant: the model (at its mean), its parameters, the mean ``μ [P]``, the running
    curvature ``C [P]``, the prior per example ``s`` and N."""

    model: nn.Module
    params: List[nn.Parameter]
    mean: Tensor
    curvature: Tensor
    prior: float
    n: int

    def std(self) -> Tensor:
        """``[P]`` posterior std ``1/√(N·(C + s))``."""
        return (self.n * (self.curvature + self.prior)).rsqrt()


def step_variant(post: Posterior, momentum: Tensor, t: int, lr: float, settings: StepSettings,
                 closure: Callable[[], Tensor], z: Tensor) -> Tensor:
    """One step of the shared algorithm at the weight sample ``μ + z/√(N(C + s))``; updates ``post`` and
    returns the new momentum (the average ``β·m + (1 − β)·g``).

    ``closure`` computes the loss at the parameters now loaded and runs its backward."""
    s, n, beta1, beta2 = post.prior, post.n, MOMENTUM, settings.ema_decay
    mu, c = post.mean, post.curvature
    precision = n * (c + s)
    eps = z / precision.sqrt()
    _load(post.params, mu + eps)
    for p in post.params:
        p.grad = None
    closure()
    g = torch.cat([p.grad.reshape(-1) for p in post.params])
    hat = g * eps * precision  # the reparameterisation estimate ĥ = g·ε/σ²
    c = beta2 * c + (1 - beta2) * hat + 0.5 * (1 - beta2) ** 2 * (c - hat) ** 2 / (c + s)
    grad = g if settings.prior_at_mean else g + s * mu
    momentum = beta1 * momentum + (1 - beta1) * grad
    direction = momentum / (1 - beta1 ** t) if settings.debias else momentum
    if settings.prior_at_mean:
        direction = direction + s * mu
    step = lr * settings.lr_scale
    if settings.kl_clip is not None:  # VI's clip: ν = min(1, √(kl_clip / (lr_VI²·uᵀm))), m VI's summed buffer
        summed = direction / (1 - beta1)
        vg = (step * (1 - beta1)) ** 2 * float((summed / (c + s) * summed).sum())
        if vg > 0:
            step *= min(1.0, math.sqrt(settings.kl_clip / vg))
    post.mean = mu - step * direction / (c + s)
    post.curvature = c
    _load(post.params, post.mean)
    return momentum


def train_variant(task: str, split: vq.Split, lr: float, seed: int, epochs: int, batch_size: int,
                  settings: StepSettings, draw: Optional[Draw] = None) -> Posterior:
    """Train one variant from seed ``seed``: the initialisation and batch order of
    :func:`benchmarks.vi_quality.train`, the weight noise of ``draw`` (default :func:`seeded_draw`)."""
    torch.manual_seed(seed)
    model = vq.make_model(task)
    params = list(model.parameters())
    n = len(split.y_train)
    prior = settings.weight_decay if settings.weight_decay is not None else settings.prior_precision / n
    mean = torch.cat([p.detach().reshape(-1) for p in params])
    post = Posterior(model, params, mean, torch.full_like(mean, settings.curvature_init), prior, n)
    momentum = torch.zeros_like(mean)
    draw = draw if draw is not None else seeded_draw(seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    t = 0
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n - batch_size + 1, batch_size):
            idx = perm[i:i + batch_size]
            x, y = split.x_train[idx], split.y_train[idx]

            def closure() -> Tensor:
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                return loss
            t += 1
            momentum = step_variant(post, momentum, t, lr, settings, closure, draw(t, mean.numel()))
    return post


@torch.no_grad()
def predict_variant(post: Posterior, x: Tensor, seed: int, settings: StepSettings, num_samples: int = 32) -> Tensor:
    """``[B, C]`` Bayesian model average of ``num_samples`` weight samples (antithetic pairs or independent)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    std = post.std()
    probs = []
    eps = torch.zeros_like(post.mean)
    post.model.eval()
    for i in range(num_samples):
        eps = -eps if settings.antithetic and i % 2 == 1 else torch.randn(post.mean.numel(), generator=gen) * std
        _load(post.params, post.mean + eps)
        probs.append(torch.softmax(post.model(x), -1))
    _load(post.params, post.mean)
    return torch.stack(probs).mean(0)


def paired(rows: Dict[int, Dict[str, float]], base: Dict[int, Dict[str, float]], key: str) -> Tuple[float, float, int]:
    """``(mean, standard error, n)`` of ``rows[s][key] − base[s][key]`` over the seeds both have."""
    seeds = sorted(set(rows) & set(base))
    if not seeds:
        raise ValueError("the two result sets share no seed")
    d = [rows[s][key] - base[s][key] for s in seeds]
    return statistics.fmean(d), (statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0), len(d)


def _real(task: str, split: vq.Split, name: str, lr_ivon: float, seed: int, epochs: int, batch: int,
          ivon_mod: Any) -> Dict[str, float]:
    """Validation metrics of the real optimizers: ``vi``, ``vi-debias`` (``momentum_debias=True``), ``ivon``."""
    if name == "ivon":
        run = vq.train(task, "ivon", split, lr_ivon, seed, epochs, batch, ivon_mod)
    else:
        debias = name == "vi-debias"
        original = vq.make_optimizer

        def make(method: str, model: nn.Module, lr: float, n: int, regression: bool, s: int, mod: Any) -> Any:
            return VIOptimizer(model, dataset_size=n, lr=lr, seed=s, momentum_debias=debias)
        vq.make_optimizer = make
        try:
            run = vq.train(task, "vi-diag", split, lr_ivon * (1 - MOMENTUM), seed, epochs, batch, ivon_mod)
        finally:
            vq.make_optimizer = original
    return vq.evaluate(run, split, "val", 32)


def _fmt(mean: float, se: float, scale: float, digits: int) -> str:
    return f"{mean * scale:+.{digits}f} ± {se * scale:.{digits}f}"


def run(task: str, seeds: int, lr: float, real: bool) -> None:
    split = vq.load_task(task)
    if split.regression:
        raise ValueError(f"{task!r}: the comparison is for the classification tasks")
    epochs, batch = vq.EPOCHS[task], vq.BATCH_SIZE[task]
    keys = (("nll", 1.0, 4), ("ece", 100.0, 2), ("accuracy", 100.0, 2))
    results: Dict[str, Dict[int, Dict[str, float]]] = {}
    t0 = time.perf_counter()
    for name, settings in variants().items():
        results[name] = {}
        for s in range(seeds):
            post = train_variant(task, split, lr, s, epochs, batch, settings)
            results[name][s] = metrics.evaluate(predict_variant(post, split.x_val, s, settings), split.y_val)
    print(f"\n{task}, {epochs} epochs, lr {lr} (IVON's; VI's {lr * (1 - MOMENTUM):.3g}), {seeds} seeds, validation "
          f"({time.perf_counter() - t0:.0f} s). Re-implementation, paired against VI's settings (same noise):")
    print("| variant | NLL | Δ NLL | Δ ECE (pp) | Δ accuracy (pp) |\n|---|---:|---:|---:|---:|")
    base = results["vi"]
    for name, rows in results.items():
        nll = statistics.fmean(r["nll"] for r in rows.values())
        cells = [_fmt(*paired(rows, base, k)[:2], sc, dg) for k, sc, dg in keys]
        print(f"| {name} | {nll:.4f} | " + " | ".join(cells) + " |")
    if not real:
        return
    try:
        import ivon as ivon_mod
    except ImportError:
        print("ivon is not installed (pip install ivon-opt): the real optimizers are not compared")
        return
    t0 = time.perf_counter()
    reals = {name: {s: _real(task, split, name, lr, s, epochs, batch, ivon_mod) for s in range(seeds)}
             for name in ("vi", "vi-debias", "ivon")}
    print(f"\nVIOptimizer (lr {lr * (1 - MOMENTUM):.3g}), VIOptimizer(momentum_debias=True), ivon.IVON (lr {lr}), "
          f"validation ({time.perf_counter() - t0:.0f} s), paired against VIOptimizer:")
    print("| optimizer | seeds | NLL | Δ NLL | Δ ECE (pp) | Δ accuracy (pp) |\n|---|---|---:|---:|---:|---:|")
    blocks = [(lo, min(lo + 20, seeds)) for lo in range(0, seeds, 20)] if seeds > 20 else []
    for name, rows in reals.items():
        for lo, hi in [(0, seeds)] + (blocks if name == "ivon" else []):
            part = {s: rows[s] for s in range(lo, hi)}
            nll = statistics.fmean(r["nll"] for r in part.values())
            cells = [_fmt(*paired(part, reals["vi"], k)[:2], sc, dg) for k, sc, dg in keys]
            print(f"| {name} | {lo}–{hi - 1} | {nll:.4f} | " + " | ".join(cells) + " |")


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=["digits-cnn"], choices=sorted(DEFAULT_LR), help='tasks (default: digits-cnn)')
    p.add_argument("--seeds", type=int, default=80, help='paired seeds (default 80)')
    p.add_argument("--lr", type=float, default=None,
                   help="IVON's lr (VI's is lr·(1 − 0.9)); default: the protocol's choice")
    p.add_argument("--no-real", action="store_true", help="only the re-implementation (not VIOptimizer / ivon.IVON)")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    torch.set_num_threads(1)
    for task in args.tasks:
        run(task, args.seeds, args.lr if args.lr is not None else DEFAULT_LR[task], not args.no_real)


if __name__ == "__main__":
    main()
