"""The CIFAR ResNet family of He et al. (2016), depth 6n+2: ResNet-20/38/74 are n = 3/6/12.

Three stages of n BasicBlocks with 16/32/64 channels (METHODS.md, "PFQ, DFQ, FracTrain": ResNet-38 =
[6,6,6], ResNet-74 = [12,12,12]); downsampling shortcuts are 1x1 convolutions with batch norm (the
"option B" of the FracTrain/SkipNet reference code). Global average pooling makes any input size work.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from qtrain.models.blocks import Block


class BasicBlock(Block):
    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.identity = stride == 1 and in_planes == planes
        self.projection_name = None if self.identity else "shortcut.0"
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if not self.identity:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetCIFAR(nn.Module):
    min_input_size = 1

    def __init__(self, depth: int, in_channels: int = 3, num_classes: int = 10, input_size: int = 32) -> None:
        """``input_size`` is accepted for a uniform model signature; pooling makes any size work."""
        super().__init__()
        if (depth - 2) % 6 or depth < 8:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2 with n >= 1, got {depth}")
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        stages, in_planes = [], 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            blocks = []
            for i in range(n):
                blocks.append(BasicBlock(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
