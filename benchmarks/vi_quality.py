"""The quality part of ``benchmarks/vi.py``: VIOptimizer at its library defaults against IVON, Adam and SGD.

This module holds the tasks, the training and the metrics; ``benchmarks/vi.py`` runs them (one
run, one JSON: ``benchmarks/results/vi.json``). ``python -m benchmarks.vi_quality ARGS`` is an
alias of ``python -m benchmarks.vi --skip-timing ARGS``.

Methods (every argument at its library default except the learning rate):

* ``vi-diag``: ``VIOptimizer(model, dataset_size=N, lr=lr)`` (VOGN),
* ``vi-kfac``: the same with ``approx="kfac"`` (noisy K-FAC),
* ``ivon``: ``ivon.IVON(model.parameters(), lr=lr, ess=N)`` (``pip install ivon-opt``; skipped with a
  message when ``import ivon`` fails),
* ``adam``: ``torch.optim.Adam(params, lr=lr)``,
* ``sgd``: ``torch.optim.SGD(params, lr=lr, momentum=0.9)``.

Tasks:

* ``digits-mlp``: scikit-learn's digits, MLP 64-128-10, 1149 train / 288 validation / 360 test
  (stratified, fixed split), pixels standardized with the training split's statistics, batch 64;
* ``digits-cnn``: the same split as 8×8 images, :class:`examples.common.DigitsCNN` with 8 and 16 channels;
* ``diabetes``: scikit-learn's diabetes regression (282 / 71 / 89), MLP 10-50-1, batch 32,
  features and target standardized on the training split.

Protocol. For each task and method the learning rate is chosen from a small grid (:data:`LR_GRIDS`,
5 values spanning 100× around the method's default) by the **mean validation NLL** over
``--select-seeds`` (3) runs, seeds 0, 1, 2, per value (:func:`select_lr`, :func:`choose_lr`; the test
split is not looked at; one seed's validation NLL is noisy enough to flip the choice between
neighbouring grid values); then 5 seeds (the chosen value's selection runs among them, not
retrained) are trained at the chosen lr and evaluated on the test split: accuracy, NLL, ECE (15 bins), Brier
(classification), Gaussian NLL and RMSE (regression, in the target's original units) — mean ± std
over seeds. Grid-edge rule (every method alike, validation only): while the chosen lr is the smallest
(largest) value tried, one more value a half-decade beyond that end is trained on the selection seeds
and the choice is made again, at most ``--edge-extensions`` (2) times per end; the JSON records every
value tried (``grid``, the added ones with ``"extension": true``; ``lr_grid`` sorted). A chosen lr
still at an end after the extensions is marked "(edge)" in the table (``chosen_at_grid_edge`` in the
JSON): a wider grid might have found a better one for that method. VI and IVON predict with the Bayesian model average of ``--mc-samples`` (32) weight
samples (``VIOptimizer.predict``, whose default draws them as antithetic pairs ``μ ± ε`` / independent
draws of ``IVON.sampled_params``); Adam and SGD with their point estimate.
Each run's prediction samples are seeded by its seed (VI: its own generator; IVON, which draws from
torch's global generator: a forked global generator), so no method's numbers depend on the order in
which runs are trained and evaluated.
The step time (median over all training steps of the 5 seeds, including the batch's forward and
backward) is reported as a ratio to Adam's in the same run.

Regression likelihood. VI uses ``VIOptimizer(loss="mse", noise_variance="learned")`` on the
standardized targets: ``σ²`` is learned from its own training residuals at the weight samples, and
``predict(x, return_variance=True)`` gives the predictive mean and variance (the samples' spread
plus ``σ²``). IVON has no noise model, so it gets a **given** ``σ²``: the residual variance of an
ordinary-least-squares fit on the training split (``RSS / (n − p − 1)``, standardized units); it
trains on ``½(y/σ − f)²`` (the Gaussian likelihood with variance ``σ²``, exactly) and predicts the
moment-matched Gaussian of its samples (mean ``σ·mean_s f_s``, variance ``σ² + σ²·var_s f_s``).
Adam and SGD train the same objective and predict ``N(σ·f, v)`` with ``v`` the residual variance
of their predictions on the validation split (a point estimate with its validation error as
variance).

Examples::

    OMP_NUM_THREADS=1 python -m benchmarks.vi --skip-timing --tasks digits-mlp --methods vi-diag adam --seeds 2
"""
from __future__ import annotations

import argparse
import inspect
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks.common import markdown_table, progress  # noqa: E402
from torchsso2 import VIOptimizer, metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"

TASKS: Tuple[str, ...] = ("digits-mlp", "digits-cnn", "diabetes")
#: the methods of a default run
METHODS: Tuple[str, ...] = ("vi-diag", "vi-kfac", "ivon", "adam", "sgd")
#: ``--methods`` also accepts ``vi-fisher-mc``: ``VIOptimizer(curvature="fisher_mc")``, the Monte-Carlo
#: Fisher from a second backward (the diag default is ``"reparam"``, so not in a default run)
ALL_METHODS: Tuple[str, ...] = METHODS + ("vi-fisher-mc",)

#: VIOptimizer's default lr (read from its signature, so the grid follows the library)
VI_DEFAULT_LR: float = float(inspect.signature(VIOptimizer.__init__).parameters["lr"].default)


def _around(center: float) -> Tuple[float, ...]:
    """``center·10^(k/2)`` for k = −2 … 2 rounded to 2 significant digits: 5 values spanning 100× around ``center``."""
    return tuple(float(f"{center * 10 ** (k / 2):.2g}") for k in range(-2, 3))


#: the learning-rate grid of each method: 5 values spanning 100× around its default (VIOptimizer's
#: signature default; IVON has none, 0.1 is its paper's and README's usual value; Adam's torch default
#: 1e-3; SGD with momentum 0.9: 0.03). With 3 values spanning 10× (the first full run), 12 of the
#: 15 chosen lrs were at an end of their grid. VI gets one more value above (0.32): its digits-MLP
#: choice was the top of the 100× grid (0.1)
LR_GRIDS: Dict[str, Tuple[float, ...]] = {
    "vi-diag": _around(VI_DEFAULT_LR) + (float(f"{VI_DEFAULT_LR * 10 ** 1.5:.2g}"),),
    "vi-kfac": _around(VI_DEFAULT_LR) + (float(f"{VI_DEFAULT_LR * 10 ** 1.5:.2g}"),),
    "vi-fisher-mc": _around(VI_DEFAULT_LR) + (float(f"{VI_DEFAULT_LR * 10 ** 1.5:.2g}"),),
    "ivon": _around(0.1),
    "adam": _around(1e-3),
    "sgd": _around(0.03),
}

#: grid-edge rule of :func:`select_lr`: at most this many half-decade values are added beyond each
#: end of a method's grid while the chosen lr is at that end (validation only; all methods alike)
EDGE_EXTENSIONS = 2

#: epochs per task (bounded so that the whole run stays near 10 minutes on one thread). Diabetes: with
#: 150 epochs every method chose the smallest lr of its grid by validation NLL (less training was
#: better: a 282-example regression overfits), so 50
EPOCHS: Dict[str, int] = {"digits-mlp": 40, "digits-cnn": 15, "diabetes": 50}
#: channels of the digits CNN (conv3×3(8) - conv3×3(16) - maxpool - linear: half of the examples' width, for time)
CNN_CHANNELS: Tuple[int, int] = (8, 16)
BATCH_SIZE: Dict[str, int] = {"digits-mlp": 64, "digits-cnn": 64, "diabetes": 32}


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
@dataclass
class Split:
    """A task's data. Classification: ``x`` float32 ``[N, 64]`` (MLP) or ``[N, 1, 8, 8]`` (CNN),
    ``y`` long ``[N]``. Regression: ``x`` ``[N, 10]``, ``y`` float32 ``[N, 1]`` standardized;
    ``noise_var`` the given noise variance (standardized units), ``y_scale`` the training target's std."""

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    x_test: Tensor
    y_test: Tensor
    regression: bool = False
    noise_var: float = 1.0
    y_scale: float = 1.0


def _three_way(n: int, n_val: int, n_test: int, stratify: Any, seed: int) -> Tuple[Any, Any, Any]:
    from sklearn.model_selection import train_test_split

    idx = list(range(n))
    rest, test = train_test_split(idx, test_size=n_test, random_state=seed,
                                  stratify=None if stratify is None else stratify)
    train, val = train_test_split(rest, test_size=n_val, random_state=seed,
                                  stratify=None if stratify is None else stratify[rest])
    return train, val, test


def load_digits_split(images: bool = False, seed: int = 0) -> Split:
    """Digits 1149 / 288 / 360 (stratified), standardized per pixel with the training split's mean/std."""
    from sklearn.datasets import load_digits

    ds = load_digits()
    train, val, test = _three_way(len(ds.target), 288, 360, ds.target, seed)
    x = torch.tensor(ds.data, dtype=torch.float32)
    y = torch.tensor(ds.target, dtype=torch.long)
    mean, std = x[train].mean(0), x[train].std(0)
    x = (x - mean) / torch.where(std > 0, std, torch.ones_like(std))
    if images:
        x = x.reshape(-1, 1, 8, 8)
    t = torch.as_tensor
    return Split(x[t(train)], y[t(train)], x[t(val)], y[t(val)], x[t(test)], y[t(test)])


def ols_noise_variance(x: Tensor, y: Tensor) -> float:
    """Residual variance ``RSS / (n − p − 1)`` of the least-squares fit of ``y [n, 1]`` on ``x [n, p]`` with intercept."""
    n, p = x.shape
    if n <= p + 1:
        raise ValueError(f"need more examples than features + 1 for the OLS noise estimate, got n={n}, p={p}")
    design = torch.cat([x, torch.ones(n, 1)], 1).double()
    coef = torch.linalg.lstsq(design, y.double()).solution
    rss = float((y.double() - design @ coef).pow(2).sum())
    return rss / (n - p - 1)


def load_diabetes_split(seed: int = 0) -> Split:
    """Diabetes 282 / 71 / 89; features and target standardized with the training split's statistics;
    ``noise_var`` = the OLS residual variance on the training split (see the module docstring)."""
    from sklearn.datasets import load_diabetes

    ds = load_diabetes()
    train, val, test = _three_way(len(ds.target), 71, 89, None, seed)
    x = torch.tensor(ds.data, dtype=torch.float32)
    y = torch.tensor(ds.target, dtype=torch.float32).unsqueeze(1)
    t = torch.as_tensor
    xm, xs = x[t(train)].mean(0), x[t(train)].std(0)
    ym, ys = float(y[t(train)].mean()), float(y[t(train)].std())
    x, y = (x - xm) / xs, (y - ym) / ys
    noise = ols_noise_variance(x[t(train)], y[t(train)])
    return Split(x[t(train)], y[t(train)], x[t(val)], y[t(val)], x[t(test)], y[t(test)],
                 regression=True, noise_var=noise, y_scale=ys)


def load_task(task: str, seed: int = 0) -> Split:
    """The task's split; ``seed`` 0 is the main tables' split, others are other random splits."""
    if task == "digits-mlp":
        return load_digits_split(images=False, seed=seed)
    if task == "digits-cnn":
        return load_digits_split(images=True, seed=seed)
    if task == "diabetes":
        return load_diabetes_split(seed=seed)
    raise ValueError(f"task={task!r}; expected one of {', '.join(TASKS)}")


def make_model(task: str) -> nn.Module:
    from examples.common import MLP, DigitsCNN

    if task == "digits-mlp":
        return MLP(64, (128,), 10)
    if task == "digits-cnn":
        return DigitsCNN(channels=CNN_CHANNELS)
    if task == "diabetes":
        return MLP(10, (50,), 1)
    raise ValueError(f"task={task!r}; expected one of {', '.join(TASKS)}")


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------
@dataclass
class Trained:
    """A trained run: model, optimizer, per-step seconds and the number of skipped (non-finite) steps."""

    method: str
    lr: float
    seed: int
    model: nn.Module
    opt: Any
    step_seconds: List[float]
    skipped: int
    final_loss: float


def make_optimizer(method: str, model: nn.Module, lr: float, n_train: int, regression: bool, seed: int,
                   ivon_mod: Any) -> Any:
    """The method's optimizer at its library defaults except ``lr`` (see the module docstring)."""
    if method in ("vi-diag", "vi-kfac", "vi-fisher-mc"):
        kw: Dict[str, Any] = {"approx": "kfac"} if method == "vi-kfac" else {}
        if method == "vi-fisher-mc":
            kw["curvature"] = "fisher_mc"
        if regression:  # the Gaussian likelihood needs a noise variance: learned from the residuals
            kw["loss"] = "mse"
            kw["noise_variance"] = "learned"
        return VIOptimizer(model, dataset_size=n_train, lr=lr, seed=seed, **kw)
    if method == "ivon":
        if ivon_mod is None:
            raise RuntimeError("ivon is not installed (pip install ivon-opt)")
        return ivon_mod.IVON(model.parameters(), lr=lr, ess=n_train)
    if method == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    if method == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    raise ValueError(f"method={method!r}; expected one of {', '.join(ALL_METHODS)}")


def _loss(out: Tensor, target: Tensor, regression: bool) -> Tensor:
    """Cross-entropy, or ``mean_n ½(t_n − f_n)²`` (the unit-variance Gaussian NLL that ``loss="mse"`` assumes)."""
    if regression:
        return 0.5 * (out - target).pow(2).sum(1).mean()
    return nn.functional.cross_entropy(out, target)


def train(task: str, method: str, split: Split, lr: float, seed: int, epochs: int, batch_size: int,
          ivon_mod: Any) -> Trained:
    """Train one run from seed ``seed`` (same initialization and batch order for every method)."""
    torch.manual_seed(seed)
    model = make_model(task)
    n = len(split.y_train)
    opt = make_optimizer(method, model, lr, n, split.regression, seed, ivon_mod)
    # regression: VI learns σ² itself; the others train on targets in units of the given noise std
    # (the Gaussian likelihood of variance σ², see the module docstring)
    scaled = split.regression and not isinstance(opt, VIOptimizer)
    y_train = split.y_train / math.sqrt(split.noise_var) if scaled else split.y_train
    gen = torch.Generator().manual_seed(1000 + seed)
    times: List[float] = []
    last = float("nan")
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n - batch_size + 1, batch_size):  # the last partial batch is dropped
            idx = perm[i:i + batch_size]
            x, y = split.x_train[idx], y_train[idx]
            start = time.perf_counter()
            if isinstance(opt, VIOptimizer):
                def closure() -> Tuple[Tensor, Tensor]:
                    opt.zero_grad()
                    out = model(x)
                    loss = _loss(out, y, split.regression)
                    loss.backward()
                    return loss, out
                loss, _ = opt.step(closure, targets=y if split.regression else None)
            elif method == "ivon":
                with opt.sampled_params(train=True):
                    opt.zero_grad()
                    loss = _loss(model(x), y, split.regression)
                    loss.backward()
                opt.step()
            else:
                opt.zero_grad()
                loss = _loss(model(x), y, split.regression)
                loss.backward()
                opt.step()
            times.append(time.perf_counter() - start)
            last = float(loss.detach())
    return Trained(method, lr, seed, model, opt, times, int(getattr(opt, "num_skipped", 0)), last)


# ------------------------------------------------------------------------------------------------
# prediction and metrics
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def output_samples(run: Trained, x: Tensor, num_samples: int) -> Tensor:
    """``[S, N, O]`` raw outputs at ``S`` posterior samples (VI / IVON), or ``[1, N, O]`` at the point estimate."""
    run.model.eval()
    if isinstance(run.opt, VIOptimizer):
        gen = torch.Generator().manual_seed(10_000 + run.seed)
        outs = []
        for _ in range(num_samples):
            with run.opt.sampled_params(gen):
                outs.append(run.model(x))
        return torch.stack(outs)
    if run.method == "ivon":  # IVON draws from torch's global generator: seeded per run, as VI's generator is,
        outs = []             # so its samples do not depend on which runs were trained or evaluated before
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(10_000 + run.seed)
            for _ in range(num_samples):
                with run.opt.sampled_params():
                    outs.append(run.model(x))
        return torch.stack(outs)
    return run.model(x).unsqueeze(0)


@torch.no_grad()
def class_probs(run: Trained, x: Tensor, num_samples: int) -> Tensor:
    """``[N, C]`` predictive probabilities: the Bayesian model average (``VIOptimizer.predict`` for VI)."""
    if isinstance(run.opt, VIOptimizer):
        run.model.eval()
        return run.opt.predict(x, num_samples=num_samples, generator=torch.Generator().manual_seed(10_000 + run.seed))
    return metrics.bayesian_model_average(torch.softmax(output_samples(run, x, num_samples), -1))


def gaussian_nll(mean: Tensor, var: Tensor, y: Tensor) -> float:
    """Mean Gaussian negative log-likelihood ``½ log(2π v) + (y − m)²/(2v)`` (float64); all three of one shape
    (a [N, 1] mean against [N] targets would broadcast to [N, N])."""
    if not mean.shape == var.shape == y.shape:
        raise ValueError(f"gaussian_nll: mean {tuple(mean.shape)}, var {tuple(var.shape)} and y {tuple(y.shape)} "
                         "must have one shape")
    mean, var, y = mean.double(), var.double(), y.double()
    return float((0.5 * torch.log(2 * math.pi * var) + (y - mean).pow(2) / (2 * var)).mean())


@torch.no_grad()
def regression_predictive(run: Trained, split: Split, x: Tensor, num_samples: int) -> Tuple[Tensor, Tensor]:
    """Predictive mean and variance ``[N, 1]`` in standardized target units (see the module docstring)."""
    if isinstance(run.opt, VIOptimizer):  # the learned σ² and the BMA's moments
        run.model.eval()
        return run.opt.predict(x, num_samples=num_samples, generator=torch.Generator().manual_seed(10_000 + run.seed),
                               return_variance=True)
    sigma = math.sqrt(split.noise_var)
    samples = output_samples(run, x, num_samples) * sigma  # [S, N, 1]
    mean = samples.mean(0)
    if samples.shape[0] > 1:  # VI / IVON: σ² plus the spread of the sampled means
        return mean, split.noise_var + samples.var(0, unbiased=False)
    val = output_samples(run, split.x_val, 1)[0] * sigma  # point estimate: its validation residual variance
    return mean, torch.full_like(mean, float((split.y_val - val).pow(2).mean()))


def evaluate(run: Trained, split: Split, which: str, num_samples: int) -> Dict[str, float]:
    """Metrics of ``run`` on the ``which`` (``"val"`` or ``"test"``) split. Regression NLL and RMSE are
    in the target's original units (``+ log y_scale``, ``× y_scale``)."""
    x, y = (split.x_val, split.y_val) if which == "val" else (split.x_test, split.y_test)
    if split.regression:
        mean, var = regression_predictive(run, split, x, num_samples)
        return {"nll": gaussian_nll(mean, var, y) + math.log(split.y_scale),
                "rmse": float((mean - y).pow(2).mean().sqrt()) * split.y_scale}
    try:
        return metrics.evaluate(class_probs(run, x, num_samples), y)
    except ValueError:  # non-finite probabilities: a diverged run
        return {"accuracy": 0.0, "nll": math.inf, "ece": math.nan, "brier": math.nan}


def entropies(run: Trained, split: Split, num_samples: int) -> Tuple[Dict[str, Any], Any]:
    """Mean predictive entropy (nats) of ``run``'s predictions on the test split and on
    out-of-distribution inputs built from it (``examples/bayesian_digits.py``'s ``ood_sets``:
    rotated 90°, flipped, uniform and Gaussian noise; applied to the standardized 8×8 images), and
    the reliability-diagram data of the same test probabilities."""
    from examples.bayesian_digits import ood_sets

    images = split.x_test.reshape(-1, 1, 8, 8)
    sets = ood_sets(images, 0, gaussian_noise=True)
    probs = class_probs(run, split.x_test, num_samples)
    rel = metrics.reliability_diagram_data(probs, split.y_test)
    ood = {k: float(metrics.predictive_entropy(class_probs(run, v.reshape(split.x_test.shape), num_samples)).mean())
           for k, v in sets.items()}
    return {"entropy_test": float(metrics.predictive_entropy(probs).mean()), "entropy_ood": ood}, rel


def choose_lr(val_nll: Mapping[float, float]) -> Optional[float]:
    """The learning rate with the smallest **validation** NLL (ties: the first in the mapping's order);
    non-finite values are never chosen; None when no lr has a finite validation NLL.

    Args:
        val_nll: ``{lr: validation NLL}`` per grid value (the mean over the selection seeds).
    """
    finite = [(v, i, lr) for i, (lr, v) in enumerate(val_nll.items()) if math.isfinite(v)]
    return min(finite)[2] if finite else None


def mean_std(values: Sequence[float]) -> Dict[str, float]:
    vals = list(values)
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0}


# ------------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------------
def extend_beyond(lr: float, direction: int) -> float:
    """The next grid value beyond ``lr`` in ``direction`` (−1: below, +1: above): one half-decade step
    (``lr·10^(±1/2)``), rounded to 2 significant digits like :data:`LR_GRIDS`."""
    if direction not in (-1, 1):
        raise ValueError(f"direction must be -1 or +1, got {direction}")
    return float(f"{lr * 10 ** (direction / 2):.2g}")


def select_lr(task: str, method: str, split: Split, args: argparse.Namespace, ivon_mod: Any
              ) -> Tuple[List[Dict[str, Any]], Optional[float], Dict[int, Trained]]:
    """The lr selection: every grid value trained on seeds ``0 … args.select_seeds − 1`` and scored by
    the **mean validation NLL** over those seeds (:func:`choose_lr`); the test split is not evaluated.

    Grid-edge rule: while the chosen lr is the smallest (largest) value tried, one more value a
    half-decade beyond that end (:func:`extend_beyond`) is trained on the same seeds and the choice is
    made again, at most ``args.edge_extensions`` (default :data:`EDGE_EXTENSIONS`) times per end.

    Returns ``(grid, chosen, runs)``: one record per value tried, the grid's first, then the extensions
    (``"val_nll"`` the mean, ``"val_nll_seeds"`` the per-seed values, ``"extension"`` whether the value
    was added by the grid-edge rule), the chosen lr (None when no value has a finite mean), and the
    chosen lr's selection runs ``{seed: run}``, which the test seeds reuse where they coincide.
    """
    epochs, batch = args.epochs[task], BATCH_SIZE[task]
    select_seeds = getattr(args, "select_seeds", 1)
    max_ext = getattr(args, "edge_extensions", EDGE_EXTENSIONS)
    grid_runs: Dict[float, Dict[int, Trained]] = {}
    grid: List[Dict[str, Any]] = []

    def score(lr: float, extension: bool) -> None:
        runs = {s: train(task, method, split, lr, s, epochs, batch, ivon_mod) for s in range(select_seeds)}
        vals = [evaluate(r, split, "val", args.mc_samples)["nll"] for r in runs.values()]
        mean = statistics.fmean(vals) if all(math.isfinite(v) for v in vals) else math.inf
        grid_runs[lr] = runs
        grid.append({"lr": lr, "val_nll": mean, "val_nll_seeds": vals, "extension": extension,
                     "skipped_steps": sum(r.skipped for r in runs.values()),
                     "final_batch_loss": runs[0].final_loss})

    for lr in args.grids[method]:
        score(lr, False)
    extended = {-1: 0, 1: 0}
    while True:
        chosen = choose_lr({g["lr"]: g["val_nll"] for g in grid})
        tried = sorted(grid_runs)
        if chosen is None or len(tried) < 2:
            break
        end = -1 if chosen == tried[0] else (1 if chosen == tried[-1] else 0)
        if end == 0 or extended[end] >= max_ext:
            break
        new = extend_beyond(chosen, end)
        if new in grid_runs or new <= 0:
            break
        extended[end] += 1
        score(new, True)
    for lr in list(grid_runs):  # only the chosen value's runs are kept
        if lr != chosen:
            del grid_runs[lr]
    return grid, chosen, (grid_runs[chosen] if chosen is not None else {})


def run_method(task: str, method: str, split: Split, args: argparse.Namespace, ivon_mod: Any) -> Dict[str, Any]:
    """Grid on the validation split (:func:`select_lr`: mean validation NLL over ``args.select_seeds``
    seeds), then ``args.seeds`` seeds at the chosen lr on the test split (the selection's runs of those
    seeds are reused, not retrained)."""
    epochs, batch = args.epochs[task], BATCH_SIZE[task]
    grid, chosen, chosen_runs = select_lr(task, method, split, args, ivon_mod)
    tried = sorted(g["lr"] for g in grid)
    out: Dict[str, Any] = {"grid": grid, "chosen_lr": chosen, "lr_grid": tried,
                           "chosen_at_grid_edge": chosen is not None and len(grid) > 1 and
                           chosen in (tried[0], tried[-1])}
    if chosen is None:
        out["error"] = "no lr of the grid gave a finite validation NLL"
        return out
    runs = [chosen_runs[s] if s in chosen_runs else train(task, method, split, chosen, s, epochs, batch, ivon_mod)
            for s in range(args.seeds)]
    del chosen_runs
    if task in getattr(args, "entropy_tasks", ()):  # seed 0: predictive entropy in and out of distribution
        out["entropy"], rel = entropies(runs[0], split, args.mc_samples)
        getattr(args, "reliability", {}).setdefault(task, {})[method] = rel
    per_seed = [{"seed": r.seed, "skipped_steps": r.skipped, **evaluate(r, split, "test", args.mc_samples)} for r in runs]
    keys = [k for k in per_seed[0] if k not in ("seed", "skipped_steps")]
    out["seeds"] = per_seed
    out["summary"] = {k: mean_std([p[k] for p in per_seed]) for k in keys}
    out["skipped_steps"] = sum(r.skipped for r in runs)
    out["step_ms_median"] = 1e3 * statistics.median(t for r in runs for t in r.step_seconds)
    return out


def check_targets(task: str, res: Mapping[str, Any]) -> Dict[str, Any]:
    """Issue 27's targets for ``vi-diag`` on one task, with the margins (positive = met by that much)."""
    need = {"vi-diag", "adam"} | ({"ivon"} if "ivon" in res else set())
    if not need <= {m for m, r in res.items() if "summary" in r}:
        return {"evaluated": False, "why": f"needs {sorted(need)} with results"}
    s = {m: r["summary"] for m, r in res.items() if "summary" in r}
    vi = s["vi-diag"]
    refs = [m for m in ("ivon", "adam") if m in s]
    out: Dict[str, Any] = {"evaluated": True, "compared_with": refs}
    if "accuracy" in vi:
        margin = vi["accuracy"]["mean"] - (s["adam"]["accuracy"]["mean"] - 0.005)
        out["accuracy_ge_adam_minus_0.5pct"] = {"met": margin >= 0, "margin": margin}
        keys = ("nll", "ece")
    else:
        keys = ("nll",)
    for k in keys:
        best = min(s[m][k]["mean"] for m in refs)
        margin = best - vi[k]["mean"]
        out[f"{k}_le_{'_and_'.join(refs)}"] = {"met": margin >= 0, "margin": margin}
    out["all_met"] = all(v["met"] for v in out.values() if isinstance(v, dict))
    return out


def _fmt(s: Mapping[str, Any], key: str, pct: bool = False, digits: int = 3) -> str:
    if key not in s:
        return ""
    m, sd = s[key]["mean"], s[key]["std"]
    return f"{100 * m:.2f} ± {100 * sd:.2f}%" if pct else f"{m:.{digits}f} ± {sd:.{digits}f}"


def format_tables(tasks: Mapping[str, Any], mc_samples: int) -> str:
    """The quality tables of :func:`run_tasks`'s result (one per task), with the targets' verdicts."""
    lines: List[str] = []
    for task, res in tasks.items():
        n = res["n"]
        seeds = max((len(r.get("seeds", [])) for r in res["methods"].values()), default=0)
        lines += ["", f"{task}: {n['train']} train / {n['val']} val / {n['test']} test, {res['epochs']} epochs, "
                  f"batch {BATCH_SIZE[task]}, {seeds} seeds; lr chosen by validation NLL; VI/IVON: BMA of "
                  f"{mc_samples} samples" + (f"; IVON/Adam/SGD: given noise variance σ² = {res['noise_var']:.3f} "
                                             "(standardized, OLS on train); VI: learned" if "noise_var" in res else "")]
        regression = "noise_var" in res
        head = ["method", "lr", "NLL", "RMSE"] if regression else ["method", "lr", "accuracy", "NLL", "ECE", "Brier"]
        head += ["skipped"]
        rows = []
        for m, r in res["methods"].items():
            if "summary" not in r:
                rows.append([m, "", r.get("error", r.get("skipped", ""))] + [""] * (len(head) - 3))
                continue
            s = r["summary"]
            vals = [_fmt(s, "nll"), _fmt(s, "rmse", digits=1)] if regression else \
                [_fmt(s, "accuracy", True), _fmt(s, "nll"), _fmt(s, "ece", True), _fmt(s, "brier")]
            edge = " (edge)" if r.get("chosen_at_grid_edge") else ""
            rows.append([m, f"{r['chosen_lr']:g}{edge}"] + vals + [r["skipped_steps"]])
        lines.append(markdown_table(head, rows))
        grid_skips = {m: sum(g["skipped_steps"] for g in r["grid"]) for m, r in res["methods"].items()}
        if any(grid_skips.values()):
            lines.append("skipped steps in the lr-grid runs: " + ", ".join(f"{m} {k}" for m, k in grid_skips.items() if k))
        t = res["targets"]
        if t.get("evaluated"):
            parts = [f"{k}: {'met' if v['met'] else 'MISSED'} (margin {v['margin']:+.4f})"
                     for k, v in t.items() if isinstance(v, dict)]
            lines.append("vi-diag targets: " + "; ".join(parts))
        else:
            lines.append(f"vi-diag targets not evaluated: {t.get('why')}")
        if res.get("paired"):  # benchmarks/vi.py's paired extra over more seeds
            from benchmarks.vi_paired import paired_text

            lines.append(paired_text(res["paired"]))
    return "\n".join(lines)


def run_tasks(args: argparse.Namespace, ivon_mod: Any, tasks: Sequence[str], methods: Sequence[str]
              ) -> Dict[str, Any]:
    """``{task: {"n", "methods": {method: run_method(...)}, "targets", ["noise_var", "y_scale"]}}``."""
    out: Dict[str, Any] = {}
    # a bar over the (task, method) runs: each next() before a run counts the runs done so far, the
    # last one after them all closes the bar
    ticks = iter(progress(range(len(tasks) * len(methods)), "vi quality"))
    for task in tasks:
        split = load_task(task)
        res: Dict[str, Any] = {"n": {"train": len(split.y_train), "val": len(split.y_val), "test": len(split.y_test)},
                               "epochs": args.epochs[task], "methods": {}}
        if split.regression:
            res["noise_var"] = split.noise_var
            res["y_scale"] = split.y_scale
        for method in methods:
            next(ticks, None)
            t0 = time.perf_counter()
            res["methods"][method] = run_method(task, method, split, args, ivon_mod)
            r = res["methods"][method]
            print(f"  {task} ({args.epochs[task]} ep) {method:8s} lr {r['chosen_lr']}  "
                  f"{ {k: round(v['mean'], 4) for k, v in r.get('summary', {}).items()} }  ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
        res["targets"] = check_targets(task, res["methods"])
        out[task] = res
    next(ticks, None)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Alias: ``python -m benchmarks.vi --skip-timing ARGS``."""
    from benchmarks import vi

    return vi.main(["--skip-timing", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
