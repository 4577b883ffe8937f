"""MobileNetV2 (Sandler et al., 2018) for 32x32 inputs, the CIFAR variant FracTrain trains (Sec. 4.2, Table 1).

ImageNet's layout with the strides adapted to CIFAR: the stem is a stride-1 3x3 convolution and
the second stage keeps stride 1, so a 32x32 input reaches the last stage at 4x4. Inverted residual
blocks: 1x1 expansion, 3x3 depthwise, 1x1 linear projection, with a residual connection where the
shape allows. The depthwise convolutions are what the quantized methods hold at FW-8/BW-16.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from qtrain.models.blocks import Block

# (expansion t, output channels c, blocks n, stride of the first block s); CIFAR strides
STAGES = ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


def _conv_bn(in_planes: int, planes: int, kernel: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(in_planes, planes, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(planes)]


class InvertedResidual(Block):
    def __init__(self, in_planes: int, planes: int, expansion: int, stride: int) -> None:
        super().__init__()
        hidden = in_planes * expansion
        self.identity = stride == 1 and in_planes == planes
        expand = [*_conv_bn(in_planes, hidden, 1), nn.ReLU6(inplace=True)] if expansion != 1 else []
        self.body = nn.Sequential(
            *expand,
            *_conv_bn(hidden, hidden, 3, stride, groups=hidden), nn.ReLU6(inplace=True),
            *_conv_bn(hidden, planes, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return out + x if self.identity else out


class MobileNetV2CIFAR(nn.Module):
    min_input_size = 1

    def __init__(self, in_channels: int = 3, num_classes: int = 10, input_size: int = 32) -> None:
        """``input_size`` is accepted for a uniform model signature; pooling makes any size work."""
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(in_channels, 32, 3), nn.ReLU6(inplace=True))
        blocks, in_planes = [], 32
        for expansion, planes, n, stride in STAGES:
            for i in range(n):
                blocks.append(InvertedResidual(in_planes, planes, expansion, stride if i == 0 else 1))
                in_planes = planes
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(*_conv_bn(in_planes, 1280, 1), nn.ReLU6(inplace=True))
        self.fc = nn.Linear(1280, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.blocks(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
