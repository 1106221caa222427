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
