"""Train a ResNet-18-style network on CIFAR-10 with SGD + torchsso2's K-FAC preconditioner.

    python examples/cifar10_resnet.py --synthetic --epochs 1 --steps-per-epoch 20
    python examples/cifar10_resnet.py --data-dir ~/data/cifar-10-batches-py --epochs 10
    torchrun --standalone --nproc_per_node=2 examples/cifar10_resnet.py --synthetic ...
    mpiexec -n 2 python examples/cifar10_resnet.py --synthetic ...

``--data-dir`` is the directory of the *python* version of CIFAR-10 (``data_batch_1`` ...
``data_batch_5`` and ``test_batch``, pickled; its ``cifar-10-batches-py`` subdirectory is also
accepted); no torchvision needed. Under ``torchrun`` the model is wrapped in
``DistributedDataParallel`` (gloo on CPU, nccl on GPU); under ``mpiexec`` the script averages
gradients over MPI itself and the preconditioner communicates over MPI. ``--batch-size`` is
per process; each process reads its shard of the data. Only rank 0 prints.
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Tuple

if __package__ in (None, ""):  # run as ``python examples/cifar10_resnet.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from examples.resnet import build_parser, run

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def _read_batches(files) -> Tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for f in files:
        with open(f, "rb") as fh:
            d = pickle.load(fh, encoding="bytes")
        xs.append(np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(d[b"labels"], dtype=np.int64))
    x = torch.from_numpy(np.concatenate(xs)).float().div_(255.0)
    x = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    return x, torch.from_numpy(np.concatenate(ys))


def load_cifar10(data_dir: str) -> Tuple[Dataset, Dataset, int]:
    """CIFAR-10 from the pickled python batches in ``data_dir`` (normalized tensors, no augmentation)."""
    root = Path(data_dir).expanduser()
    if not (root / "test_batch").exists() and (root / "cifar-10-batches-py" / "test_batch").exists():
        root = root / "cifar-10-batches-py"
    train_files = sorted(root.glob("data_batch_*"))
    if not train_files or not (root / "test_batch").exists():
        raise FileNotFoundError(f"{root} has no CIFAR-10 python batches (data_batch_1..5 and test_batch); "
                                "download cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html "
                                "and extract it, or use --synthetic")
    return TensorDataset(*_read_batches(train_files)), TensorDataset(*_read_batches([root / "test_batch"])), 10


def main(argv=None) -> None:
    p = build_parser(__doc__.splitlines()[0], image_size=32, num_classes=10, width=64, batch_size=128, lr=0.1)
    run(p.parse_args(argv), stem="cifar", load_real=load_cifar10)


if __name__ == "__main__":
    main()
