"""The method interface (DESIGN.md, "The method interface").

A method is a precision policy: the trainer calls its hooks, and every hook defaults to doing
nothing, so float32 is the base class itself and a new method never edits the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn

from qtrain.cost.profile import profile_macs
from qtrain.errors import ConfigError
from qtrain.precision import PrecisionRecord


@dataclass
class StepInfo:
    """Where the trainer is: epoch, optimizer step, and the micro-batch's sample count."""

    epoch: int
    step: int
    samples: int


def check_bits(cfg: DictConfig, *keys: str, low: int = 1, high: int = 32, prefix: str = "method.") -> None:
    """Raise a one-line ConfigError unless every ``cfg[key]`` (an integer or a list of them) is in [low, high]."""
    for key in keys:
        value = cfg[key]
        for bits in value if isinstance(value, ListConfig) else [value]:
            if isinstance(bits, bool) or not isinstance(bits, int) or not low <= bits <= high:
                raise ConfigError(f"{prefix}{key}={_plain(value)!r} is not allowed: "
                                  f"bit-widths are integers from {low} to {high}")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, ListConfig) else value


class Method:
    """Float32 training: no quantization, every operand charged 32 bits."""

    name = "float32"

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg

    def prepare(self, model: nn.Module) -> nn.Module:
        """Swap layers for quantized ones, add gates; called once before the optimizer is built."""
        return model

    def profile(self, model: nn.Module, sample: torch.Tensor) -> dict[str, int]:
        """MACs per sample of every costed layer (called once after :meth:`prepare`, in eval mode)."""
        return profile_macs(model, sample)

    def loss(self, loss: torch.Tensor, info: StepInfo) -> torch.Tensor:
        """Add method terms to the task loss."""
        return loss

    def after_backward(self, info: StepInfo) -> None:
        """Read gradients before the optimizer step."""

    def after_step(self, info: StepInfo) -> None:
        """Act after the optimizer step (re-quantize, switch precision)."""

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        """Epoch-level decisions (loss indicators, precision switches); may add columns to ``metrics``."""

    def precision(self) -> PrecisionRecord:
        """The current per-layer precision; layers absent from it are float32."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Everything the method needs to resume (model-held state is in the model's own state_dict)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
