"""AdaPT's training recipe that its float32 baselines share (AdaPT paper Sec. 3.1 and 3.4): the TNVS weight
initialization and the L1 term on the weights. Both :mod:`qtrain.methods.adapt` and :mod:`qtrain.methods.float32`
use it, so the baseline does not depend on the method it is compared with."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn


def tnvs_init_(weight: torch.Tensor, scale: float) -> None:
    """Sec. 3.1: truncated normal, ``σ = sqrt(scale / fan_in)``, cut at ``±sqrt(3 scale / fan_in)``.

    Drawn from the CPU generator and copied onto ``weight``'s device, so a run starts from the same weights (and
    leaves the generator in the same state for what follows) on every device.
    """
    fan_in = weight[0].numel()
    bound = math.sqrt(3 * scale / fan_in)
    drawn = nn.init.trunc_normal_(torch.empty(weight.shape, dtype=weight.dtype), 0.0, math.sqrt(scale / fan_in), -bound, bound)
    weight.copy_(drawn)


def initialize(model: nn.Module, init: str, scale: float) -> None:
    """``tnvs``: every Conv2d/Linear weight by :func:`tnvs_init_` (biases and batch norm keep the model's);
    ``model``: the model's own initialization."""
    if init == "tnvs":
        for layer in model.modules():
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                tnvs_init_(layer.weight.data, scale)


def l1_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``Σ |t|`` over every element of ``tensors``: the sparsifying term ``||W||_1`` (Sec. 3.4); its
    gradient is ``sign(t)``."""
    return sum(t.abs().sum() for t in tensors)
