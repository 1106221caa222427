"""Training on scikit-learn's digits: time to 97 % test accuracy and steps per second, for
torchsso2's optimizers and the ones users would pick instead.

Examples::

    python -m benchmarks.peers_training --quick
    python -m benchmarks.peers_training --full --json benchmarks/results/peers_training.json
    python -m benchmarks.peers_training --optimizers sgd ivon sso-kfac --seeds 0 1 2 --epochs 40

Optimizers (hyper-parameters in :data:`SETTINGS`; the torch/torchsso2 ones are the examples'
defaults from ``examples/common.py`` and ``examples/bayesian_digits.py``; where those did not
reach 97 % within 15 epochs on the MLP (adam, sso-diag, ivon, kaisa/kfac_pytorch) the learning
rate / damping were picked from a 2–3 point sweep on seed 0 — a light touch, not a tuning study):

* ``sgd`` (momentum 0.9), ``adam`` — torch.optim;
* ``ivon`` — ``ivon.IVON`` (ess = 10 × the training-set size, the tempered posterior of
  ``examples/bayesian_digits.py``; 1 MC sample, evaluated at the mean);
* ``sso-kfac`` / ``sso-diag`` — ``torchsso2.SecondOrderOptimizer`` (fisher_mc);
* ``vi-diag`` / ``vi-kfac`` — ``torchsso2.VIOptimizer`` (evaluated at the posterior mean);
* ``kaisa`` — ``torchsso2.KFACPreconditioner`` + SGD (the KAISA drop-in face);
* ``kfac_pytorch`` — ``kfac.preconditioner.KFACPreconditioner`` + SGD, same settings as ``kaisa``.

Time to target counts training time only (evaluation after each epoch is excluded); a run
that never reaches the target reports its best accuracy instead. Steps/s = optimizer steps
(forward + backward + update, curvature included) per training second. Each (optimizer,
seed) run trains a fresh model from the same initialisation per seed.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks import _peer_utils as pu  # noqa: E402
from benchmarks.common import progress  # noqa: E402
from examples.common import fraction_in, nonnegative_int, positive_int  # noqa: E402

logger = logging.getLogger("benchmarks.peers_training")

OPTIMIZERS = ("sgd", "adam", "ivon", "sso-kfac", "sso-diag", "vi-diag", "vi-kfac", "kaisa", "kfac_pytorch")
TARGET = 0.97

#: per-optimizer hyper-parameters (lr first)
SETTINGS: Dict[str, Dict[str, Any]] = {
    "sgd": dict(lr=0.1, momentum=0.9),
    "adam": dict(lr=1e-2),
    # ess = 10·N: the same tempered posterior (T = 0.1) as the VI runs (examples/bayesian_digits.py)
    "ivon": dict(lr=1.0, hess_init=0.5, weight_decay=1e-4, beta2=0.99999, ess_scale=10.0),
    "sso-kfac": dict(lr=0.01, approx="kfac", damping=0.1, curv_update_interval=1, inv_update_interval=10),
    "sso-diag": dict(lr=0.003, approx="diag", damping=1e-2, curv_update_interval=1, inv_update_interval=1),
    # VIOptimizer at its defaults except lr, tempered as examples/bayesian_digits.py (T = 0.1)
    "vi-diag": dict(lr=0.1, approx="diag", dataset_scale=10.0),
    "vi-kfac": dict(lr=0.1, approx="kfac", dataset_scale=10.0, inv_update_interval=10),
    "kaisa": dict(lr=0.05, momentum=0.9, damping=0.01, factor_update_steps=1, inv_update_steps=10),
    "kfac_pytorch": dict(lr=0.05, momentum=0.9, damping=0.01, factor_update_steps=1, inv_update_steps=10),
}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers_training",
                                description="Time to 97%% test accuracy on digits, and steps/s, per optimizer.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="MLP, 1 seed, 2 epochs (a smoke run: the target is "
                      "usually not reached)")
    mode.add_argument("--full", action="store_true", help="MLP and CNN, 3 seeds (MLP) / 1 seed (CNN), up to 40 epochs")
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS), help='optimizers (default: all; a peer that is not installed is skipped)')
    p.add_argument("--models", nargs="+", choices=("mlp", "cnn"), default=None, help='models (default: mlp; --full mlp cnn)')
    p.add_argument("--seeds", type=nonnegative_int, nargs="+", default=None, help='seeds (default 0 1 2; --quick 0)')
    p.add_argument("--epochs", type=positive_int, default=None, help="max epochs per run (default 40; --quick 2)")
    p.add_argument("--batch-size", type=positive_int, default=64, help='batch size (default 64)')
    p.add_argument("--target", type=fraction_in(0, 1, low_open=True), default=TARGET, help="test accuracy to reach, in (0, 1]")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="write the JSON report here (default benchmarks/results/peers_training.json with --full, "
                   "the run README's table needs; none otherwise)")
    p.add_argument("-v", "--verbose", action="store_true", help='log progress (INFO)')
    a = p.parse_args(argv)
    if a.json is None and a.full and not a.models and a.optimizers == list(OPTIMIZERS):
        a.json = Path(__file__).resolve().parent / "results" / "peers_training.json"
    a.models = a.models or (["mlp", "cnn"] if a.full else ["mlp"])
    a.seeds = a.seeds if a.seeds is not None else ([0] if a.quick else [0, 1, 2])
    a.epochs = a.epochs if a.epochs is not None else (2 if a.quick else 40)
    return a


# ---------------------------------------------------------------------------------------------
# one "stepper" per optimizer: step(x, y) -> loss, hiding each library's loop protocol
# ---------------------------------------------------------------------------------------------
Stepper = Callable[[Tensor, Tensor], float]


def make_stepper(name: str, model: nn.Module, n_train: int, seed: int) -> Optional[Stepper]:
    """A step function for optimizer ``name``, or None when its peer library is missing."""
    s = dict(SETTINGS[name])
    loss_fn = nn.CrossEntropyLoss()
    if name in ("sgd", "adam"):
        opt: Any = (torch.optim.SGD if name == "sgd" else torch.optim.Adam)(model.parameters(), **s)

        def step(x: Tensor, y: Tensor) -> float:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            return float(loss.detach())
        return step
    if name == "ivon":
        ivon = pu.peer("ivon")
        if ivon is None:
            return None
        scale = s.pop("ess_scale", 1.0)
        opt = ivon.IVON(model.parameters(), ess=n_train * scale, mc_samples=1, **s)

        def step(x: Tensor, y: Tensor) -> float:
            with opt.sampled_params(train=True):
                opt.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
            opt.step()
            return float(loss.detach())
        return step
    if name.startswith("sso-") or name.startswith("vi-"):
        from examples.common import make_closure
        from torchsso2 import SecondOrderOptimizer, VIOptimizer

        if name.startswith("sso-"):
            opt = SecondOrderOptimizer(model, momentum=0.9, curvature="fisher_mc", seed=seed, **s)
        else:
            scale = s.pop("dataset_scale", 1.0)  # 1 / temperature
            opt = VIOptimizer(model, dataset_size=round(n_train * scale), seed=seed, **s)

        def step(x: Tensor, y: Tensor) -> float:
            loss, _ = opt.step(make_closure(opt, model, x, y))
            return float(loss.detach())
        return step
    if name in ("kaisa", "kfac_pytorch"):
        lr, momentum = s.pop("lr"), s.pop("momentum")
        sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        if name == "kaisa":
            from torchsso2 import KFACPreconditioner
        else:
            mod = pu.peer("kfac_pytorch")
            if mod is None:
                return None
            KFACPreconditioner = mod.KFACPreconditioner  # noqa: N806
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pre = KFACPreconditioner(model, lr=lr, **s)

        def step(x: Tensor, y: Tensor) -> float:
            sgd.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            pre.step()
            sgd.step()
            return float(loss.detach())
        return step
    raise ValueError(f"optimizer={name!r}; expected one of {', '.join(OPTIMIZERS)}")


_PEER_OF = {"ivon": "ivon", "kfac_pytorch": "kfac_pytorch"}


def train(name: str, model_name: str, seed: int, args: argparse.Namespace, data: Any) -> Optional[Dict[str, Any]]:
    from examples.common import accuracy, batches, make_model

    torch.manual_seed(seed)
    model = make_model(model_name)
    step = make_stepper(name, model, len(data.y_train), seed)
    if step is None:
        return None
    gen = torch.Generator().manual_seed(seed)
    wall, steps, reached = 0.0, 0, None
    history: List[Dict[str, Any]] = []
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.perf_counter()
        loss = float("nan")
        for idx in batches(len(data.y_train), args.batch_size, gen):
            loss = step(data.x_train[idx], data.y_train[idx])
            steps += 1
        wall += time.perf_counter() - t0
        acc = accuracy(model, data.x_test, data.y_test)
        history.append({"epoch": epoch, "train_loss": loss, "test_accuracy": acc, "wall_s": wall, "steps": steps})
        logger.info("%s %s seed %d epoch %d loss %.3f acc %.4f", name, model_name, seed, epoch, loss, acc)
        if reached is None and acc >= args.target:
            reached = {"epoch": epoch, "wall_s": wall, "steps": steps}
            break
        if loss != loss:  # nan: diverged
            break
    return {"optimizer": name, "model": model_name, "seed": seed, "reached": reached is not None,
            "time_to_target_s": reached["wall_s"] if reached else None,
            "epochs_to_target": reached["epoch"] if reached else None,
            "best_accuracy": max(h["test_accuracy"] for h in history),
            "steps_per_s": steps / wall if wall > 0 else None, "steps": steps, "train_wall_s": wall,
            "history": history, "settings": SETTINGS[name]}


def summarize(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (model, optimizer): median over seeds."""
    out = []
    keys = sorted({(r["model"], r["optimizer"]) for r in runs}, key=lambda k: (k[0], OPTIMIZERS.index(k[1])))
    for model_name, name in keys:
        rs = [r for r in runs if r["model"] == model_name and r["optimizer"] == name]
        hit = [r for r in rs if r["reached"]]
        out.append({"model": model_name, "optimizer": name, "seeds": len(rs), "reached": len(hit),
                    "median_time_to_target_s": statistics.median([r["time_to_target_s"] for r in hit]) if hit else None,
                    "median_epochs_to_target": statistics.median([r["epochs_to_target"] for r in hit]) if hit else None,
                    "median_best_accuracy": statistics.median([r["best_accuracy"] for r in rs]),
                    "median_steps_per_s": statistics.median([r["steps_per_s"] for r in rs])})
    return out


def run(args: argparse.Namespace) -> Dict[str, Any]:
    from examples.common import load_digits_data

    data = load_digits_data()
    skipped: Dict[str, str] = {}
    runs: List[Dict[str, Any]] = []
    jobs = [(m, o, s) for m in args.models for o in args.optimizers
            for s in (args.seeds if m == "mlp" or not args.full else args.seeds[:1])]
    it: Any = progress(jobs, "peers_training")
    for model_name, name, seed in it:
        if name in skipped:
            continue
        r = train(name, model_name, seed, args, data)
        if r is None:
            skipped[name] = pu.skip_message(_PEER_OF[name])
            print(f"skipping {name}: {skipped[name]}")
            continue
        runs.append(r)
    return pu.report("peers_training", {"models": args.models, "optimizers": args.optimizers, "seeds": args.seeds,
                                        "max_epochs": args.epochs, "batch_size": args.batch_size,
                                        "target": args.target, "dataset": "sklearn digits 1347/450 split",
                                        "settings": {k: SETTINGS[k] for k in args.optimizers}},
                     summarize(runs), skipped, runs=runs)


def format_table(rep: Dict[str, Any]) -> str:
    tgt = rep["config"]["target"]
    hdr = ["model", "optimizer", f"reached {tgt:.0%}", "median time to target (s)", "median epochs",
           "median best acc", "median steps/s"]
    rows = [[r["model"], r["optimizer"], f"{r['reached']}/{r['seeds']}", pu.fmt(r["median_time_to_target_s"], ".2f"),
             pu.fmt(r["median_epochs_to_target"], ".0f"), pu.fmt(r["median_best_accuracy"], ".3f"),
             pu.fmt(r["median_steps_per_s"], ".0f")] for r in rep["results"]]
    return pu.with_skips(pu.markdown_table(hdr, rows, "llrrrrr"), rep)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return pu.print_and_save(run(args), format_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
