"""ResNet-18 and ResNet-34 (He et al., 2016) in their ImageNet form and their CIFAR form, from one definition: the
forms differ in the stem only (the CIFAR form is DYNASTY's CIFAR-100 row's, DYNASTY paper Sec. 5.1; ``stem: auto``
takes it for inputs up to 64 x 64). See docs/models.md."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from qtrain.config.models import Stem
from qtrain.errors import ConfigError
from qtrain.models.resnet_cifar import BasicBlock

STEMS = tuple(stem.value for stem in Stem)
CIFAR_UP_TO = 64
STAGES = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}


class ResNetImageNet(nn.Module):
    min_input_size = 1
    options = ("stem",)

    def __init__(self, blocks: Sequence[int], in_channels: int = 3, num_classes: int = 1000, input_size: int = 224,
                 stem: str = "auto") -> None:
        """``blocks``: BasicBlocks per stage (``STAGES[18]``, ``STAGES[34]``)."""
        super().__init__()
        if stem not in STEMS:  # a caller's stem (the config's is checked before any work, by qtrain.config.models)
            raise ConfigError(f"model.stem={stem!r} is not allowed (choose from: {', '.join(STEMS)})")
        self.form = ("cifar" if input_size <= CIFAR_UP_TO else "imagenet") if stem == "auto" else stem
        if self.form == "cifar":
            self.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
            self.pool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
            self.pool = nn.MaxPool2d(3, 2, 1)
        self.bn1 = nn.BatchNorm2d(64)
        stages, in_planes = [], 64
        for n, (planes, stride) in zip(blocks, ((64, 1), (128, 2), (256, 2), (512, 2))):
            stage = [BasicBlock(in_planes, planes, stride)] + [BasicBlock(planes, planes, 1) for _ in range(n - 1)]
            stages.append(nn.Sequential(*stage))
            in_planes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.pool(F.relu(self.bn1(self.conv1(x))))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
