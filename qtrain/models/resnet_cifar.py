"""The CIFAR ResNets of He et al.: depth 6n+2 with basic blocks (ResNet-20/38/74/110: n = 3/6/12/18) and depth
9n+2 with bottleneck blocks (ResNet-164: n = 18, FracTrain appendix B), in FracTrain's reference code's layout.
The layout, the initialization and why ResNet-164 takes that form: docs/models.md."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from qtrain.config.models import ClassifierInit
from qtrain.errors import ConfigError
from qtrain.models.blocks import Block

CLASSIFIER_INITS = tuple(init.value for init in ClassifierInit)


class BasicBlock(Block):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.identity = stride == 1 and in_planes == planes
        self.projection_name = None if self.identity else "shortcut.0"
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = projection_shortcut(in_planes, planes, stride, self.identity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(Block):
    """1x1 to ``planes``, 3x3 at ``stride``, 1x1 to ``4 * planes``; post-activation (ReLU after the sum)."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        out_planes = planes * self.expansion
        self.identity = stride == 1 and in_planes == out_planes
        self.projection_name = None if self.identity else "shortcut.0"
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.shortcut = projection_shortcut(in_planes, out_planes, stride, self.identity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


def projection_shortcut(in_planes: int, out_planes: int, stride: int, identity: bool) -> nn.Sequential:
    """The identity (an empty Sequential) or a 1x1 convolution with batch norm (the block's ``projection``)."""
    if identity:
        return nn.Sequential()
    return nn.Sequential(nn.Conv2d(in_planes, out_planes, 1, stride, bias=False), nn.BatchNorm2d(out_planes))


def normal_in_out_(weight: torch.Tensor) -> None:
    """Redraw a classifier's weight from N(0, 2/(in*out)), as FracTrain's reference code initializes its CIFAR
    ResNets' ``nn.Linear``, in place of torch's uniform(±1/sqrt(in)) (the bias keeps torch's, as there). The draw
    leaves the random stream where it was, so that every later draw (the data's order, the gates) is the one the
    same seed makes with torch's initialization: the two differ in the classifier's start alone."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        weight.normal_(0.0, (2.0 / weight.numel()) ** 0.5)


class ResNetCIFAR(nn.Module):
    min_input_size = 1
    options = ("classifier_init",)

    def __init__(self, depth: int, in_channels: int = 3, num_classes: int = 10, input_size: int = 32,
                 bottleneck: bool = False, classifier_init: str = "torch") -> None:
        """Depth 6n+2 of basic blocks or, with ``bottleneck``, 9n+2 of bottleneck blocks. ``input_size`` is
        accepted for a uniform model signature; pooling makes any size work. ``classifier_init``: ``torch``
        (``nn.Linear``'s own) or ``normal_in_out`` (FracTrain's reference code's), :func:`normal_in_out_`."""
        super().__init__()
        if classifier_init not in CLASSIFIER_INITS:  # a caller's (the config's is checked before any work)
            raise ConfigError(f"model.classifier_init={classifier_init!r} is not allowed (choose from: "
                              f"{', '.join(CLASSIFIER_INITS)})")
        block, per_block = (Bottleneck, 9) if bottleneck else (BasicBlock, 6)
        if (depth - 2) % per_block or depth < per_block + 2:
            raise ValueError(f"CIFAR ResNet depth must be {per_block}n+2 with n >= 1 for {block.__name__} blocks, "
                             f"got {depth}")
        n = (depth - 2) // per_block
        self.conv1 = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        stages, in_planes = [], 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            blocks = []
            for i in range(n):
                blocks.append(block(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.fc = nn.Linear(in_planes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if classifier_init == ClassifierInit.NORMAL_IN_OUT.value:
            normal_in_out_(self.fc.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
