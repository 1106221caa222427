"""Train a ResNet-18 on ImageNet with SGD + torchsso2's K-FAC preconditioner.

    python examples/imagenet_resnet.py --synthetic --image-size 64 --num-classes 10 --steps-per-epoch 5
    torchrun --standalone --nproc_per_node=8 examples/imagenet_resnet.py --data-dir /data/imagenet
    mpiexec -n 2 python examples/imagenet_resnet.py --synthetic ...

``--data-dir`` is an ImageFolder tree (``train/<class>/*.JPEG`` and ``val/<class>/*.JPEG``);
reading it needs torchvision (``torchvision.datasets.ImageFolder``), which torchsso2 does not
depend on — without torchvision the script stops with an explanation (``--synthetic`` works
without it). ``--synthetic`` draws 3×224×224 images of 1000 classes (``--image-size`` and
``--num-classes`` shrink them). Distribution as in ``examples/cifar10_resnet.py``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Tuple

if __package__ in (None, ""):  # run as ``python examples/imagenet_resnet.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.utils.data import Dataset

from examples.resnet import build_parser, run

_IMAGE_SIZE = 224


def load_imagenet(data_dir: str) -> Tuple[Dataset, Dataset, int]:
    """``ImageFolder(data_dir/train)`` (random-resized crops, flips) and ``ImageFolder(data_dir/val)``."""
    try:
        from torchvision import datasets, transforms
    except ImportError:
        raise RuntimeError("--data-dir for ImageNet needs an ImageFolder-style loader (JPEG decoding, "
                           "resizing, cropping), which comes from torchvision and torchvision is not installed. "
                           "Install the torchvision build matching your torch (pip install torchvision), "
                           "or run with --synthetic") from None
    root = Path(data_dir).expanduser()
    if not (root / "train").is_dir() or not (root / "val").is_dir():
        raise FileNotFoundError(f"{root} must contain ImageFolder trees train/<class>/... and val/<class>/...")
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = datasets.ImageFolder(str(root / "train"), transforms.Compose([
        transforms.RandomResizedCrop(_IMAGE_SIZE), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        normalize]))
    val = datasets.ImageFolder(str(root / "val"), transforms.Compose([
        transforms.Resize(int(_IMAGE_SIZE * 256 / 224)), transforms.CenterCrop(_IMAGE_SIZE), transforms.ToTensor(),
        normalize]))
    return train, val, len(train.classes)


def main(argv=None) -> None:
    global _IMAGE_SIZE
    p = build_parser(__doc__.splitlines()[0], image_size=224, num_classes=1000, width=64, batch_size=32, lr=0.1)
    args = p.parse_args(argv)
    _IMAGE_SIZE = args.image_size
    run(args, stem="imagenet", load_real=load_imagenet)


if __name__ == "__main__":
    main()
