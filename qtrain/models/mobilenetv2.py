"""MobileNetV2 (Sandler et al., 2018) for 32x32 inputs, the CIFAR variant FracTrain trains (Sec. 4.2, Table 1), in
the reference code's layout (GATECH-EIC/FracTrain ``fractrain_cifar/models.py``). The layout, what DFQ's skip runs
and the depthwise convolutions' precision: docs/models.md."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from qtrain.models.blocks import Block

# (expansion t, output channels c, blocks n, stride of the first block s); CIFAR strides
STAGES = ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


class InvertedResidual(Block):
    def __init__(self, in_planes: int, planes: int, expansion: int, stride: int) -> None:
        super().__init__()
        hidden = in_planes * expansion
        self.stride = stride
        self.identity = stride == 1 and in_planes == planes
        self.conv1 = nn.Conv2d(in_planes, hidden, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(hidden)
        self.conv2 = nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False)
        self.bn2 = nn.BatchNorm2d(hidden)
        self.conv3 = nn.Conv2d(hidden, planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride == 1 and in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, bias=False), nn.BatchNorm2d(planes))
            self.projection_name = "shortcut.0"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return out + self.shortcut(x) if self.stride == 1 else out


class MobileNetV2CIFAR(nn.Module):
    min_input_size = 1

    def __init__(self, in_channels: int = 3, num_classes: int = 10, input_size: int = 32) -> None:
        """``input_size`` is accepted for a uniform model signature; pooling makes any size work."""
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True))
        blocks, in_planes = [], 32
        for expansion, planes, n, stride in STAGES:
            for i in range(n):
                blocks.append(InvertedResidual(in_planes, planes, expansion, stride if i == 0 else 1))
                in_planes = planes
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.Conv2d(in_planes, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU(inplace=True))
        self.fc = nn.Linear(1280, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
