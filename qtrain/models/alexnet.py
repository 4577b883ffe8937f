"""The CIFAR AlexNet of the AdaPT paper and reference code.

conv 64 k11 s4 p5, maxpool 2; conv 192 k5 p2, maxpool 2; conv 384 k3; conv 256 k3; conv 256 k3;
maxpool 2; linear to the classes. No batch norm. The three poolings need an input of at least
29x29 (32x32 CIFAR images reach the classifier as 256x1x1).
"""

from __future__ import annotations

import torch
from torch import nn


class AlexNetCIFAR(nn.Module):
    min_input_size = 29

    def __init__(self, in_channels: int = 3, num_classes: int = 10, input_size: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 11, 4, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        side = (input_size - 1) // 4 + 1
        side = side // 2 // 2 // 2
        self.classifier = nn.Linear(256 * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))
