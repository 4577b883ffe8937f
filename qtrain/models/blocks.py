"""The block unit that DFQ gates (FracTrain Sec. 3.2): a residual block that may be skipped, which models mark by
subclassing :class:`Block`. See docs/models.md."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A residual block that DFQ may skip. ``identity``: its input and output have the same shape, so skipping it
    (DFQ's FW-0/BW-0 option, SkipNet's skip) is the identity. A block that changes the shape can be skipped only
    through its projection shortcut, as SkipNet and FracTrain's reference code do (where ``projection_name`` is set,
    ``shortcut`` is a 1x1 convolution followed by batch norm and ``projection_name`` names that convolution); one
    without a projection must always run."""

    identity: bool = False
    projection_name: str | None = None

    def projection(self, x: torch.Tensor) -> torch.Tensor:
        """The block's projection shortcut alone, run in float32 (only where ``projection_name`` is set)."""
        if self.projection_name is None:
            raise NotImplementedError(f"{type(self).__name__} has no projection shortcut")
        conv, bn = self.shortcut
        return bn(nn.Conv2d.forward(conv, x))  # the plain convolution, also where conv is a quantized layer
