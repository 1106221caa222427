"""A small ResNet for the K-FAC examples and benchmarks (no torchvision needed).

:class:`BasicBlock` (two 3×3 convs + identity / 1×1 projection shortcut) and :class:`ResNet`
with a configurable base ``width`` and ``depths`` (blocks per stage; ``(2, 2, 2, 2)`` is
ResNet-18) and two stems: ``"cifar"`` (3×3 conv, stride 1, no pooling, for 32×32 inputs) and
``"imagenet"`` (7×7 conv stride 2 + 3×3 max-pool, for 224×224 inputs). Global average pooling
makes both work for any input size.
"""
from __future__ import annotations

from typing import Sequence

from torch import Tensor, nn

__all__ = ["BasicBlock", "ResNet", "resnet18", "cifar_resnet", "imagenet_resnet"]


class BasicBlock(nn.Module):
    """``relu(bn(conv3x3(relu(bn(conv3x3(x))))) + shortcut(x))``."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet of :class:`BasicBlock` stages with widths ``width · (1, 2, 4, 8, ...)``.

    Args:
        depths: blocks per stage (``(2, 2, 2, 2)``: ResNet-18); the first stage has stride 1,
            every later one stride 2.
        width: channels of the first stage (64 for the standard ResNet-18).
        num_classes: outputs of the final linear layer.
        stem: ``"cifar"`` or ``"imagenet"``.
        in_channels: input channels (3).
    """

    def __init__(self, depths: Sequence[int] = (2, 2, 2, 2), width: int = 64, num_classes: int = 10,
                 stem: str = "cifar", in_channels: int = 3) -> None:
        super().__init__()
        if width < 1 or not depths or any(d < 1 for d in depths):
            raise ValueError(f"width must be >= 1 and depths non-empty positive ints, got {width}, {depths}")
        if stem == "cifar":
            self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        elif stem == "imagenet":
            self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                                      nn.MaxPool2d(3, stride=2, padding=1))
        else:
            raise ValueError(f"stem={stem!r}; expected 'cifar' or 'imagenet'")
        stages = []
        in_planes = width
        for i, depth in enumerate(depths):
            planes = width * 2 ** i
            blocks = []
            for j in range(depth):
                blocks.append(BasicBlock(in_planes, planes, stride=2 if (i > 0 and j == 0) else 1))
                in_planes = planes
            stages.append(nn.Sequential(*blocks))
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_planes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.pool(self.layers(self.stem(x))).flatten(1))


def resnet18(num_classes: int = 1000, width: int = 64, stem: str = "imagenet") -> ResNet:
    """ResNet-18 layout (2, 2, 2, 2)."""
    return ResNet((2, 2, 2, 2), width, num_classes, stem)


def cifar_resnet(num_classes: int = 10, width: int = 16, depths: Sequence[int] = (2, 2, 2, 2)) -> ResNet:
    return ResNet(depths, width, num_classes, "cifar")


def imagenet_resnet(num_classes: int = 1000, width: int = 64, depths: Sequence[int] = (2, 2, 2, 2)) -> ResNet:
    return ResNet(depths, width, num_classes, "imagenet")


# --------------------------------------------------------------------------------------------
# training driver shared by examples/cifar10_resnet.py and examples/imagenet_resnet.py
# --------------------------------------------------------------------------------------------
import argparse  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Callable, Tuple  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset  # noqa: E402

if __package__ in (None, ""):  # run as a script (its --help): make the repository root importable
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

from examples.common import (fraction_in, nonnegative_float, nonnegative_int, positive_float,  # noqa: E402
                             positive_int, positive_int_list, progress_bar)
from examples.kfac_options import add_kfac_arguments, make_kfac  # noqa: E402

STRATEGIES = {"comm-opt": "COMM_OPT", "mem-opt": "MEM_OPT", "hybrid-opt": "HYBRID_OPT"}


def grad_worker_fraction(text: str):
    """``comm-opt | mem-opt | hybrid-opt`` -> :class:`DistributedStrategy`, else a float in [0, 1]."""
    from torchsso2.kfac import DistributedStrategy

    key = text.strip().lower().replace("_", "-")
    if key in STRATEGIES:
        return DistributedStrategy[STRATEGIES[key]]
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comm-opt, mem-opt, hybrid-opt or a float in [0, 1], got {text!r}")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"grad worker fraction must be in [0, 1], got {value}")
    return value


def build_parser(description: str, image_size: int, num_classes: int, width: int, batch_size: int,
                 lr: float) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--synthetic", action="store_true", help="random tensors of the dataset's shape (no download)")
    data.add_argument("--data-dir", type=str, help="directory of the real dataset")
    p.add_argument("--image-size", type=positive_int, default=image_size, help="synthetic image side (pixels)")
    p.add_argument("--num-classes", type=positive_int, default=num_classes, help="number of classes (synthetic data)")
    p.add_argument("--synthetic-samples", type=nonnegative_int, default=0,
                   help="synthetic training samples (0: steps-per-epoch × batch-size × world size, or 1024)")
    p.add_argument("--epochs", type=positive_int, default=1, help="training epochs")
    p.add_argument("--steps-per-epoch", type=nonnegative_int, default=0,
                   help="cap on the loader batches (micro-batches) per epoch, not on optimizer steps: with "
                        "--batches-per-allreduce k an epoch takes ceil(cap / k) optimizer steps (0: a full pass)")
    p.add_argument("--batch-size", type=positive_int, default=batch_size, help="per-process batch size")
    p.add_argument("--width", type=positive_int, default=width, help="channels of the first ResNet stage")
    p.add_argument("--depths", type=positive_int_list, default="2,2,2,2",
                   help="blocks per stage, comma-separated (2,2,2,2 = ResNet-18)")
    p.add_argument("--lr", "--base-lr", type=nonnegative_float, default=lr,
                   help="SGD learning rate (also the K-FAC KL-clip lr)")
    p.add_argument("--momentum", type=fraction_in(0.0, 1.0, high_open=True), default=0.9, help="SGD momentum")
    p.add_argument("--weight-decay", type=nonnegative_float, default=5e-4, help="SGD weight decay")
    p.add_argument("--no-kfac", action="store_true", help="plain SGD, no K-FAC preconditioner")
    p.add_argument("--kfac-factor-update-steps", type=positive_int, default=10,
                   help="steps between K-FAC factor updates")
    p.add_argument("--kfac-inv-update-steps", type=nonnegative_int, default=100,
                   help="steps between K-FAC decompositions (0 turns K-FAC off)")
    p.add_argument("--kfac-damping", type=positive_float, default=0.003, help="K-FAC damping")
    p.add_argument("--kfac-factor-decay", type=fraction_in(0.0, 1.0, low_open=True), default=0.95,
                   help="K-FAC factor running-average decay")
    p.add_argument("--kfac-kl-clip", type=positive_float, default=0.001, help="K-FAC KL clip")
    p.add_argument("--kfac-grad-worker-fraction", type=grad_worker_fraction, default="comm-opt",
                   help="comm-opt, mem-opt, hybrid-opt or a float in [0, 1] (0: 1/world size)")
    p.add_argument("--workers", type=nonnegative_int, default=0, help="DataLoader worker processes")
    p.add_argument("--seed", type=int, default=0, help="seed of the model init and data")
    p.add_argument("--threads", type=nonnegative_int, default=0, help="torch.set_num_threads (0: leave the default)")
    p.add_argument("--cpu", action="store_true", help="do not use CUDA even if available")
    p.add_argument("--no-progress", action="store_true", help="disable the tqdm progress bar of each epoch")
    add_kfac_arguments(p)
    return p


class Dist:
    """How this process was launched: ``mode`` is ``local``, ``torch`` (torchrun) or ``mpi`` (mpiexec)."""

    def __init__(self, cpu: bool) -> None:
        from torchsso2.distributed import get_communicator

        use_cuda = torch.cuda.is_available() and not cpu
        self.mode = "local"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            import torch.distributed as dist

            if use_cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            if not dist.is_initialized():
                dist.init_process_group("nccl" if use_cuda else "gloo")
            self.mode = "torch"
            self.comm = get_communicator("torch")
        else:
            self.comm = get_communicator("auto")  # MPI under mpiexec -n >1, else a no-op local one
            if self.comm.world_size > 1:
                self.mode = "mpi"
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        if use_cuda:
            local = int(os.environ.get("LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", self.rank)))
            self.device = torch.device("cuda", local % torch.cuda.device_count())
        else:
            self.device = torch.device("cpu")

    def print(self, *args: object) -> None:
        if self.rank == 0:
            print(*args, flush=True)

    def sum(self, values: Tuple[float, ...]) -> Tuple[float, ...]:
        t = torch.tensor(values, dtype=torch.float64)
        self.comm.allreduce([t], op="sum")
        return tuple(t.tolist())

    def close(self) -> None:
        from torchsso2.distributed import shutdown

        shutdown()


def synthetic_datasets(n_train: int, n_test: int, image_size: int, num_classes: int, seed: int
                       ) -> Tuple[Dataset, Dataset]:
    """Gaussian images plus a per-class pattern (so the task is learnable); identical on every rank."""
    g = torch.Generator().manual_seed(seed + 12345)
    patterns = torch.randn(num_classes, 3, image_size, image_size, generator=g)

    def make(n: int) -> TensorDataset:
        y = torch.randint(num_classes, (n,), generator=g)
        x = torch.randn(n, 3, image_size, image_size, generator=g) + 0.5 * patterns[y]
        return TensorDataset(x, y)

    return make(n_train), make(n_test)


def group_size(step: int, n_batches: int, k: int) -> int:
    """Loader batches in the optimizer step's group of batch ``step`` (0-based) of an epoch of
    ``n_batches``: ``k``, or fewer for the epoch's last group when ``k`` does not divide ``n_batches``."""
    return min(k, n_batches - step // k * k)


@torch.no_grad()
def finish_group(model: nn.Module, size: int, k: int) -> None:
    """Make the gradients of a group of ``size`` micro-batches, each backpropagated as ``loss / k``,
    their mean over the group: multiply them by ``k / size`` (a no-op for a full group).

    Only the epoch's last group can be short. The K-FAC preconditioner's ``accumulation_steps``
    stays ``k``: its hooks fold a group's factors into the running averages after the ``k``-th
    micro-batch, so a short group is never folded there and ``KFACPreconditioner.step()`` folds
    it instead, averaged over its own ``size`` micro-batches. The loss stays divided by ``k`` in
    the backward so that each micro-batch's G factor (from the gradients of the layer outputs) has
    the scale of every other group's; only the gradient is rescaled, before the preconditioner
    (and the KL clip) sees it."""
    if size == k:
        return
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(k / size)


def run(args: argparse.Namespace, stem: str, load_real: Callable[[str], Tuple[Dataset, Dataset, int]]) -> None:
    """Train ``ResNet(stem)`` with SGD (+ K-FAC) for ``args.epochs`` epochs, printing from rank 0."""
    from torchsso2.distributed import average_gradients

    if args.threads:
        torch.set_num_threads(args.threads)
    env = Dist(args.cpu)
    torch.manual_seed(args.seed)  # the same initial model on every rank
    world, rank = env.world_size, env.rank

    if args.synthetic:
        n_train = args.synthetic_samples or (args.steps_per_epoch * args.batch_size * world if args.steps_per_epoch
                                             else 1024)
        n_test = max(2 * args.batch_size * world, 64)
        train_set, test_set = synthetic_datasets(n_train, n_test, args.image_size, args.num_classes, args.seed)
        num_classes = args.num_classes
    else:
        try:
            train_set, test_set, num_classes = load_real(args.data_dir)
        except (RuntimeError, FileNotFoundError) as exc:
            raise SystemExit(f"error: {exc}")

    depths = args.depths
    model = ResNet(depths, args.width, num_classes, stem).to(env.device)
    if env.mode == "torch":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    preconditioner, kfac_scheduler, lr_scheduler = make_kfac(model, optimizer, args, world, env.comm)

    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed,
                                       drop_last=True)
    test_sampler = DistributedSampler(test_set, num_replicas=world, rank=rank, shuffle=False, drop_last=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                              num_workers=args.workers)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, sampler=test_sampler, num_workers=args.workers)
    if len(train_loader) == 0:
        raise SystemExit(f"error: {len(train_set)} training samples are fewer than one batch of "
                         f"{args.batch_size} per process × {world} processes")
    loss_fn = torch.nn.CrossEntropyLoss()
    kfac_text = "off" if preconditioner is None else (
        f"on ({preconditioner.distributed_strategy.name}, {len(preconditioner.layers)} layers, "
        f"{preconditioner.compute_method.name})")
    env.print(f"ResNet-{stem} width={args.width} depths={depths} classes={num_classes} | "
              f"{world} process(es) [{env.mode}] on {env.device} | batch {args.batch_size}/process | K-FAC {kfac_text}")

    test_acc = 0.0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        step_times, loss_sum, correct, count = [], 0.0, 0.0, 0.0
        # --batches-per-allreduce k: k loader batches (micro-batches, loss / k each) per optimizer step,
        # gradients synchronized on the k-th only, as kfac_pytorch's example does
        k = args.batches_per_allreduce
        n_batches = min(len(train_loader), args.steps_per_epoch) if args.steps_per_epoch else len(train_loader)
        optimizer.zero_grad(set_to_none=True)
        group_time = 0.0
        bar = progress_bar(n_batches, f"epoch {epoch}/{args.epochs}", args.no_progress or env.rank != 0)
        for step, (x, y) in enumerate(train_loader):
            if step >= n_batches:
                break
            x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            start = time.perf_counter()
            out = model(x)
            loss = loss_fn(out, y)
            last = (step + 1) % k == 0 or step + 1 == n_batches
            with model.no_sync() if env.mode == "torch" and not last else contextlib.nullcontext():
                (loss / k).backward()
            if last:
                finish_group(model, group_size(step, n_batches, k), k)
                if env.mode == "mpi":  # no DDP: average the gradients ourselves
                    average_gradients(model.parameters(), env.comm)
                if preconditioner is not None:
                    preconditioner.step()
                if preconditioner is None or not preconditioner.last_step_skipped:  # skipped: non-finite values
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
            group_time += time.perf_counter() - start
            if last:  # the time of one optimizer step: its micro-batches' forward/backward and the update
                step_times.append(group_time)
                group_time = 0.0
            loss_sum += float(loss.detach()) * len(y)
            correct += float((out.argmax(1) == y).sum())
            count += len(y)
            bar.update()
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        bar.close()
        loss_sum, correct, count = env.sum((loss_sum, correct, count))

        if env.mode == "mpi":  # BatchNorm's running statistics of rank 0, as DDP's broadcast_buffers gives torchrun
            env.comm.broadcast(list(model.buffers()), src=0)
        model.eval()
        t_loss, t_correct, t_count = 0.0, 0.0, 0.0
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(env.device), y.to(env.device)
                out = model(x)
                t_loss += float(loss_fn(out, y)) * len(y)
                t_correct += float((out.argmax(1) == y).sum())
                t_count += len(y)
        t_loss, t_correct, t_count = env.sum((t_loss, t_correct, t_count))
        test_acc = 100.0 * t_correct / max(t_count, 1)
        lr_scheduler.step()
        if kfac_scheduler is not None:
            kfac_scheduler.step(step=epoch)
        env.print(f"epoch {epoch}/{args.epochs}: train loss {loss_sum / max(count, 1):.4f} "
                  f"acc {100.0 * correct / max(count, 1):.2f}% | test loss {t_loss / max(t_count, 1):.4f} "
                  f"acc {test_acc:.2f}% | step time median {statistics.median(step_times) * 1e3:.1f} ms "
                  f"min {min(step_times) * 1e3:.1f} ms ({len(step_times)} optimizer steps, {n_batches} batches)")
        if preconditioner is not None:
            env.print(f"  K-FAC for epoch {epoch + 1}: damping {preconditioner.damping:g}, factor_update_steps "
                      f"{preconditioner.factor_update_steps}, inv_update_steps {preconditioner.inv_update_steps}, "
                      f"lr {preconditioner.lr:g}, K-FAC steps so far {preconditioner.steps}")
    env.print(f"final test accuracy: {test_acc:.2f}%")
    env.close()


if __name__ == "__main__":  # a module of examples/cifar10_resnet.py and examples/imagenet_resnet.py, not a program of its own
    argparse.ArgumentParser(prog="python examples/resnet.py", description=(
        "A module of examples/cifar10_resnet.py and examples/imagenet_resnet.py, which take its options: python examples/cifar10_resnet.py "
        "--help lists them; this module has none of its own.")).parse_args()
    raise SystemExit("examples/resnet.py is used by examples/cifar10_resnet.py and examples/imagenet_resnet.py: python examples/cifar10_resnet.py --help")
