"""ResNet-18 and ResNet-50 (He et al., 2015) with a CIFAR stem (32x32) or an ImageNet stem (224x224)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _shortcut(in_planes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.shortcut = _shortcut(in_planes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + self.shortcut(x))


def _shortcut(in_planes: int, out_planes: int, stride: int) -> nn.Module:
    if stride == 1 and in_planes == out_planes:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, 1, stride, bias=False), nn.BatchNorm2d(out_planes)
    )


_DEPTHS = {"resnet18": (BasicBlock, (2, 2, 2, 2)), "resnet50": (Bottleneck, (3, 4, 6, 3))}


class GlobalAvgPool(nn.Module):
    """``AdaptiveAvgPool2d(1)`` as a mean: its backward is deterministic on a GPU too
    (torch has no deterministic CUDA kernel for adaptive pooling's backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3), keepdim=True)


class ResNet(nn.Module):
    """A ResNet as a flat sequence of named children (stem, layer1..4, head), so
    that it can be split into pipeline stages at any child boundary."""

    def __init__(
        self,
        depth: Literal["resnet18", "resnet50"] = "resnet18",
        stem: Literal["cifar", "imagenet"] = "cifar",
        num_classes: int = 10,
        width: int = 64,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        block, counts = _DEPTHS[depth]
        if stem == "cifar":
            # 3x3 stride-1 convolution, no pooling: keeps 32x32 inputs large enough.
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 7, 2, 3, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(),
                nn.MaxPool2d(3, 2, 1),
            )
        in_planes = width
        for i, count in enumerate(counts):
            planes = width * 2**i
            blocks = []
            for j in range(count):
                blocks.append(block(in_planes, planes, stride=2 if (i > 0 and j == 0) else 1))
                in_planes = planes * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.head = nn.Sequential(GlobalAvgPool(), nn.Flatten(), nn.Linear(in_planes, num_classes))
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        # Zero the last batch-norm of each residual branch: each block starts as identity.
        for module in self.modules():
            if isinstance(module, (BasicBlock, Bottleneck)):
                last_bn = module.bn3 if isinstance(module, Bottleneck) else module.bn2
                nn.init.zeros_(last_bn.weight)

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """The stem, each residual block, the head: in order, they are `forward`."""
        blocks = [
            (f"layer{i}.{j}", block)
            for i in range(1, 5)
            for j, block in enumerate(getattr(self, f"layer{i}"))
        ]
        return [("stem", self.stem), *blocks, ("head", self.head)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.head(x)
