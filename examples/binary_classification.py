"""A binary classifier (one logit, ``F.binary_cross_entropy_with_logits``) on scikit-learn's breast cancer data.

``loss="binary_cross_entropy"`` gives the optimizers a Bernoulli likelihood on each logit: the natural
gradient of ``SecondOrderOptimizer`` uses its Fisher ``Jᵀ diag(p(1 − p)) J`` (K-FAC by default) and
``VIOptimizer.predict`` averages ``sigmoid(output)`` over posterior samples. Every optimizer runs at its
library defaults except the learning rate (Adam's and the torchsso2 optimizers' default lr unless ``--lr``
is given). The data ships with scikit-learn (no download): 569 examples, 30 features, split 341 / 114 / 114
(train / validation / test, stratified, ``random_state=0``), standardized with the training statistics.

Examples::

    python examples/binary_classification.py                        # adam, sso-kfac, vi-diag; 30 epochs
    python examples/binary_classification.py --methods vi-diag vi-kfac --epochs 60
    python examples/binary_classification.py --json /tmp/bc.json

The torchsso2 part::

    squeeze = lambda out: out.squeeze(-1)                    # the logits [N] the loss takes
    opt = SecondOrderOptimizer(model, loss="binary_cross_entropy", output_selector=squeeze)
    def closure():
        opt.zero_grad()
        out = model(x).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(out, y)   # y: floats in [0, 1], shape [N]
        loss.backward()
        return loss, out
    opt.step(closure)
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from examples.common import add_common_args, positive_float, positive_int, progress_bar, setup_run, write_json  # noqa: E402
from torchsso2 import SecondOrderOptimizer, VIOptimizer, metrics  # noqa: E402

METHODS = ("adam", "sso-kfac", "sso-adaptive", "vi-diag", "vi-kfac")
#: each method's learning rate when --lr is not given: the library's default (adaptive mode solves its own)
DEFAULT_LRS = {"adam": 1e-3, "sso-kfac": 1e-2, "sso-adaptive": None, "vi-diag": 1e-2, "vi-kfac": 1e-2}


def load_data(seed: int = 0) -> Dict[str, Tensor]:
    """Breast cancer, stratified 60 / 20 / 20 split, features standardized with the training statistics;
    labels as floats (1 = benign)."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    x, y = load_breast_cancer(return_X_y=True)
    x_tr, x_rest, y_tr, y_rest = train_test_split(x, y, test_size=0.4, stratify=y, random_state=seed)
    x_va, x_te, y_va, y_te = train_test_split(x_rest, y_rest, test_size=0.5, stratify=y_rest, random_state=seed)
    mean, std = x_tr.mean(0), x_tr.std(0)
    out = {}
    for name, (xs, ys) in {"train": (x_tr, y_tr), "val": (x_va, y_va), "test": (x_te, y_te)}.items():
        out[f"x_{name}"] = torch.tensor((xs - mean) / std, dtype=torch.float32)
        out[f"y_{name}"] = torch.tensor(ys, dtype=torch.float32)
    return out


def make_model(hidden: int) -> nn.Module:
    """30 → hidden → 1 (one logit)."""
    return nn.Sequential(nn.Linear(30, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def squeeze(out: Tensor) -> Tensor:
    """The model's ``[N, 1]`` logits as the ``[N]`` the loss takes."""
    return out.squeeze(-1)


def make_optimizer(method: str, model: nn.Module, lr: Optional[float], n_train: int, seed: int) -> Any:
    lr_kw = {} if lr is None else {"lr": lr}
    if method == "adam":
        return torch.optim.Adam(model.parameters(), **lr_kw)
    if method == "sso-kfac":
        return SecondOrderOptimizer(model, loss="binary_cross_entropy", output_selector=squeeze, seed=seed, **lr_kw)
    if method == "sso-adaptive":
        return SecondOrderOptimizer(model, loss="binary_cross_entropy", output_selector=squeeze, seed=seed,
                                    use_adaptive_learning_rate=True, use_adaptive_momentum=True, adaptive_damping=True)
    approx = "kfac" if method == "vi-kfac" else "diag"
    return VIOptimizer(model, dataset_size=n_train, loss="binary_cross_entropy", approx=approx,
                       output_selector=squeeze, seed=seed, **lr_kw)


def probabilities(method: str, model: nn.Module, opt: Any, x: Tensor, seed: int, samples: int) -> Tensor:
    """``p(y = 1 | x)``: the Bayesian model average for VIOptimizer, ``sigmoid(f(x))`` otherwise."""
    if isinstance(opt, VIOptimizer):
        return opt.predict(x, num_samples=samples, generator=torch.Generator().manual_seed(seed))
    model.eval()
    with torch.no_grad():
        p = torch.sigmoid(squeeze(model(x)))
    model.train()
    return p


def scores(p: Tensor, y: Tensor) -> Dict[str, float]:
    """Accuracy, NLL, ECE and Brier score (:func:`torchsso2.metrics.evaluate`, as the other examples report them)
    of the probabilities ``p(y = 1 | x)`` ``[N]``, seen as the two classes' ``[N, 2]``."""
    return metrics.evaluate(torch.stack([1 - p, p], dim=1), y.long())


def train(method: str, data: Dict[str, Tensor], args: argparse.Namespace, lr: Optional[float]) -> Dict[str, Any]:
    torch.manual_seed(args.seed)
    model = make_model(args.hidden)
    x, y = data["x_train"], data["y_train"]
    opt = make_optimizer(method, model, lr, len(y), args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    bar = progress_bar(args.epochs, method, args.no_progress)
    for _ in range(args.epochs):
        for idx in torch.randperm(len(y), generator=gen).split(args.batch_size):
            xb, yb = x[idx], y[idx]

            def closure() -> Tuple[Tensor, Tensor]:
                opt.zero_grad()
                out = squeeze(model(xb))
                loss = F.binary_cross_entropy_with_logits(out, yb)
                loss.backward()
                return loss, out

            if isinstance(opt, torch.optim.Adam):
                closure()
                opt.step()
            else:
                opt.step(closure, targets=yb)
        bar.update()
    bar.close()
    result: Dict[str, Any] = {"method": method, "lr": lr if lr is not None else DEFAULT_LRS[method]}
    for split in ("val", "test"):
        p = probabilities(method, model, opt, data[f"x_{split}"], args.seed, args.mc_samples)
        result[split] = scores(p, data[f"y_{split}"])
    result["skipped_steps"] = int(getattr(opt, "num_skipped", 0))
    return result


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python examples/binary_classification.py",
        description="Train a one-logit MLP on scikit-learn's breast cancer data with Adam and torchsso2's "
        "optimizers under loss='binary_cross_entropy'; prints validation and test accuracy, NLL, Brier score "
        "and ECE.")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=["adam", "sso-kfac", "vi-diag"],
                   help="default: adam sso-kfac vi-diag")
    p.add_argument("--epochs", type=positive_int, default=30, help="default 30")
    p.add_argument("--batch-size", type=positive_int, default=32, help="default 32")
    p.add_argument("--hidden", type=positive_int, default=32, help="hidden units (default 32)")
    p.add_argument("--lr", type=positive_float, default=None,
                   help="one learning rate for every method (default: each method's library default: "
                   + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LRS.items() if v is not None)
                   + "; sso-adaptive solves its own)")
    p.add_argument("--mc-samples", type=positive_int, default=32,
                   help="posterior samples of VIOptimizer.predict (default 32)")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    add_common_args(p)
    args = p.parse_args(argv)
    if args.lr is not None and args.methods == ["sso-adaptive"]:
        p.error("--lr does not apply to sso-adaptive (adaptive mode solves the step size)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    args = parse_args(argv)
    setup_run(args)
    data = load_data()
    results = []
    for method in args.methods:
        lr = None if method == "sso-adaptive" else args.lr
        results.append(train(method, data, args, lr))
    header = f"{'method':<14}{'lr':>8}  {'val NLL':>8}  {'test acc':>8}  {'test NLL':>8}  {'Brier':>7}  {'ECE':>6}"
    print(header)
    for r in results:
        t = r["test"]
        lr_text = "-" if r["lr"] is None else format(r["lr"], "g")
        print(f"{r['method']:<14}{lr_text:>8}  {r['val']['nll']:8.4f}  {100 * t['accuracy']:7.2f}%  {t['nll']:8.4f}  "
              f"{t['brier']:7.4f}  {100 * t['ece']:5.2f}%" + (f"  ({r['skipped_steps']} skipped steps)"
                                                             if r["skipped_steps"] else ""))
    if args.json is not None:
        write_json(args.json, {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "results": results})
        print(f"results: {args.json}")
    if any(not math.isfinite(r["test"]["nll"]) for r in results):
        raise SystemExit("a method ended with a non-finite test NLL")
    return results


if __name__ == "__main__":
    main()
