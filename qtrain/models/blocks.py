"""The block unit that DFQ gates (FracTrain Sec. 3.2): a residual block that may be skipped.

Models mark their blocks by subclassing :class:`Block`. ``identity`` says whether the block's input
and output have the same shape, so that skipping it (DFQ's FW-0/BW-0 option, SkipNet's skip) is the
identity. A block that changes the shape can be skipped only through its projection shortcut, as
SkipNet and FracTrain's reference code do (``projection``: where ``projection_name`` is set, the block's
``shortcut`` is a 1x1 convolution followed by batch norm, and ``projection_name`` names that
convolution); one without a projection must always run.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    identity: bool = False
    projection_name: str | None = None

    def projection(self, x: torch.Tensor, update_stats: bool = True) -> torch.Tensor:
        """The block's projection shortcut alone, run in float32 (only where ``projection_name`` is set).

        ``update_stats=False``: in training, the batch's statistics without updating the running ones.
        """
        if self.projection_name is None:
            raise NotImplementedError(f"{type(self).__name__} has no projection shortcut")
        conv, bn = self.shortcut
        out = nn.Conv2d.forward(conv, x)  # the plain convolution, also where conv is a quantized layer
        if update_stats or not bn.training or out.numel() == out.shape[1]:  # one value a channel: bn's hook (gates.py)
            return bn(out)
        return F.batch_norm(out, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
