"""K-FAC command-line options of the ResNet examples, with kfac_pytorch's example names.

kfac_pytorch's ``examples/torch_cifar10_resnet.py`` builds its preconditioner and schedulers
from these options (``examples/vision/optimizers.py`` there); the same code runs here with
``import torchsso2.kfac as kfac`` in place of ``import kfac``:

* ``--kfac-factor-update-steps``, ``--kfac-inv-update-steps`` (``0`` turns K-FAC off),
  multiplied by ``--kfac-update-steps-alpha`` at each epoch of ``--kfac-update-steps-decay``;
* ``--kfac-damping``, multiplied by ``--kfac-damping-alpha`` at each epoch of
  ``--kfac-damping-decay`` (a :class:`~torchsso2.kfac.scheduler.LambdaParamScheduler`
  stepped once per epoch with ``step=epoch``, as there);
* ``--kfac-factor-decay``, ``--kfac-kl-clip``, ``--kfac-inv-method`` (``INVERSE`` instead of
  ``EIGEN``), ``--kfac-skip-layers`` (regexes of module names / class names),
  ``--kfac-colocate-factors`` / ``--no-kfac-colocate-factors`` (the latter also passes
  ``compute_eigenvalue_outer_product=False``, which needs colocated factors, as kfac_pytorch);
* ``--kfac-strategy comm-opt|mem-opt|hybrid-opt`` (hybrid uses ``--kfac-grad-worker-fraction``,
  default 0.25 there); without it ``--kfac-grad-worker-fraction`` takes a strategy name or a float;
* ``--batches-per-allreduce k``: ``k`` loader batches per optimizer step (``loss / k`` each,
  DDP synchronizes on the ``k``-th), ``accumulation_steps=k``; an epoch's last group of
  ``m < k`` batches gets the mean gradient over its ``m`` batches (see ``examples/resnet.py``);
* ``--lr-decay`` (epochs where the lr is multiplied by 0.1) and ``--warmup-epochs`` (linear
  warm-up from ``lr / world_size``): a ``LambdaLR`` stepped per epoch; the preconditioner's
  ``lr`` follows the optimizer's (``lr=lambda step: optimizer.param_groups[0]["lr"]``).
"""
from __future__ import annotations

import argparse
from typing import Callable, List, Optional, Tuple

import torch

import torchsso2.kfac as kfac
if __package__ in (None, ""):  # run as a script (its --help): make the repository root importable
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

from examples.common import nonnegative_int, positive_float, positive_int

STRATEGY_NAMES = ("comm-opt", "mem-opt", "hybrid-opt")
HYBRID_DEFAULT_FRACTION = 0.25  # kfac_pytorch's example default of --kfac-grad-worker-fraction


def add_kfac_arguments(p: argparse.ArgumentParser) -> None:
    """The scheduling / layer options of kfac_pytorch's CIFAR-10 example (same names)."""
    g = p.add_argument_group("K-FAC schedules and layers (kfac_pytorch's example names)")
    g.add_argument("--kfac-update-steps-alpha", type=positive_float, default=10.0,
                   help="factor/inverse update steps are multiplied by this at each --kfac-update-steps-decay epoch")
    g.add_argument("--kfac-update-steps-decay", nargs="+", type=nonnegative_int, default=None,
                   help="epochs at which the update steps are multiplied by --kfac-update-steps-alpha")
    g.add_argument("--kfac-inv-method", action="store_true", help="INVERSE compute method instead of EIGEN")
    g.add_argument("--kfac-damping-alpha", type=positive_float, default=0.5,
                   help="damping is multiplied by this at each --kfac-damping-decay epoch")
    g.add_argument("--kfac-damping-decay", nargs="+", type=nonnegative_int, default=None,
                   help="epochs at which the damping is multiplied by --kfac-damping-alpha")
    g.add_argument("--kfac-skip-layers", nargs="+", type=str, default=[],
                   help="regexes of module names or class names not to precondition (e.g. Linear)")
    g.add_argument("--kfac-colocate-factors", action=argparse.BooleanOptionalAction, default=True,
                   help="decompose A and G of a layer on the same rank (--no-kfac-colocate-factors also turns "
                        "off compute_eigenvalue_outer_product, which needs both factors on one rank)")
    g.add_argument("--kfac-strategy", choices=STRATEGY_NAMES, default=None,
                   help="comm-opt, mem-opt or hybrid-opt (with --kfac-grad-worker-fraction, default "
                        f"{HYBRID_DEFAULT_FRACTION}); overrides a strategy given to --kfac-grad-worker-fraction")
    g.add_argument("--batches-per-allreduce", type=positive_int, default=1,
                   help="loader batches per optimizer step (gradient accumulation; K-FAC accumulation_steps); "
                        "an epoch's last group may hold fewer: its gradient and factors are the mean over its own "
                        "batches")
    g.add_argument("--lr-decay", nargs="+", type=nonnegative_int, default=[],
                   help="epochs at which the learning rate is multiplied by 0.1")
    g.add_argument("--warmup-epochs", type=nonnegative_int, default=0,
                   help="epochs of linear lr warm-up from lr / world size")


def create_lr_schedule(workers: int, warmup_epochs: int, decay_schedule: List[int],
                       alpha: float = 0.1) -> Callable[[int], float]:
    """LR multiplier of epoch ``e``: warm-up from ``1/workers`` to 1, then ``alpha`` per passed decay epoch."""
    decays = sorted(decay_schedule)

    def lr_schedule(epoch: int) -> float:
        if epoch < warmup_epochs:
            return 1.0 / workers * (epoch * (workers - 1) / warmup_epochs + 1)
        return alpha ** sum(epoch >= e for e in decays)

    return lr_schedule


def step_lambda(alpha: float, epochs: Optional[List[int]]) -> Callable[[int], float]:
    """kfac_pytorch's example rule: the factor at epoch ``e`` is ``alpha ** #(decay epochs <= e)``.

    Note: ``LambdaParamScheduler`` multiplies the current value by it at every call, so the
    effect compounds over the epochs after a decay epoch, exactly as in kfac_pytorch's example.
    """
    decays = list(epochs or [])

    def scale(epoch: int) -> float:
        return alpha ** sum(epoch >= e for e in decays)

    return scale


def grad_worker_fraction_of(args: argparse.Namespace):
    """``--kfac-strategy`` (kfac_pytorch's) if given, else ``--kfac-grad-worker-fraction``."""
    if args.kfac_strategy == "comm-opt":
        return kfac.enums.DistributedStrategy.COMM_OPT
    if args.kfac_strategy == "mem-opt":
        return kfac.enums.DistributedStrategy.MEM_OPT
    if args.kfac_strategy == "hybrid-opt":
        value = args.kfac_grad_worker_fraction
        return value if isinstance(value, float) else HYBRID_DEFAULT_FRACTION
    return args.kfac_grad_worker_fraction


def make_kfac(model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace, world_size: int,
              communicator) -> Tuple[Optional[kfac.KFACPreconditioner], Optional[kfac.LambdaParamScheduler],
                                     torch.optim.lr_scheduler.LambdaLR]:
    """``(preconditioner, K-FAC scheduler, lr scheduler)``; no preconditioner with ``--no-kfac`` or
    ``--kfac-inv-update-steps 0``. Step both schedulers once per epoch (the K-FAC one with ``step=epoch``)."""
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, create_lr_schedule(world_size, args.warmup_epochs, args.lr_decay))
    if args.no_kfac or args.kfac_inv_update_steps <= 0:
        return None, None, lr_scheduler
    preconditioner = kfac.preconditioner.KFACPreconditioner(
        model,
        factor_update_steps=args.kfac_factor_update_steps,
        inv_update_steps=args.kfac_inv_update_steps,
        damping=args.kfac_damping,
        factor_decay=args.kfac_factor_decay,
        kl_clip=args.kfac_kl_clip,
        lr=lambda step: optimizer.param_groups[0]["lr"],
        accumulation_steps=args.batches_per_allreduce,
        colocate_factors=args.kfac_colocate_factors,
        # the G worker's precomputed 1/(λ_G λ_Aᵀ + damping) needs A decomposed on the same rank
        compute_eigenvalue_outer_product=args.kfac_colocate_factors,
        compute_method=kfac.enums.ComputeMethod.INVERSE if args.kfac_inv_method else kfac.enums.ComputeMethod.EIGEN,
        grad_worker_fraction=grad_worker_fraction_of(args),
        skip_layers=args.kfac_skip_layers,
        communicator=communicator,
    )
    scheduler = kfac.scheduler.LambdaParamScheduler(
        preconditioner,
        damping_lambda=step_lambda(args.kfac_damping_alpha, args.kfac_damping_decay),
        factor_update_steps_lambda=step_lambda(args.kfac_update_steps_alpha, args.kfac_update_steps_decay),
        inv_update_steps_lambda=step_lambda(args.kfac_update_steps_alpha, args.kfac_update_steps_decay),
    )
    return preconditioner, scheduler, lr_scheduler


if __name__ == "__main__":  # a module of examples/cifar10_resnet.py and examples/imagenet_resnet.py, not a program of its own
    argparse.ArgumentParser(prog="python examples/kfac_options.py", description=(
        "A module of examples/cifar10_resnet.py and examples/imagenet_resnet.py, which take its options: python examples/cifar10_resnet.py "
        "--help lists them; this module has none of its own.")).parse_args()
    raise SystemExit("examples/kfac_options.py is used by examples/cifar10_resnet.py and examples/imagenet_resnet.py: python examples/cifar10_resnet.py --help")
