"""The method interface.

A method is a precision policy: the trainer calls its hooks, and every hook defaults to doing
nothing, so a method overrides only the hooks it needs and never edits the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qtrain.config.methods import MethodConfig
from qtrain.cost.profile import OperandSizes, operand_sizes, profile_macs
from qtrain.precision import PrecisionRecord


@dataclass(frozen=True)
class RunFacts:
    """What a method may need to know of the run: micro-batch size, accumulation, training-set size.

    ``batch_size`` is the global micro-batch; ``rank_batch_size`` the most samples of it one process
    trains on (the same on one process); ``batches_per_epoch`` the micro-batches of an epoch (None: a pass of
    ``samples_per_epoch`` in batches of ``batch_size``).
    """

    batch_size: int
    accum_steps: int
    samples_per_epoch: int
    rank_batch_size: int | None = None
    batches_per_epoch: int | None = None

    def __post_init__(self) -> None:
        if self.rank_batch_size is None:
            object.__setattr__(self, "rank_batch_size", self.batch_size)
        if self.batches_per_epoch is None:
            object.__setattr__(self, "batches_per_epoch", -(-self.samples_per_epoch // self.batch_size))


@dataclass
class StepInfo:
    """Where the trainer is: epoch, optimizer step, and the micro-batch's sample count (over every process)."""

    epoch: int
    step: int
    samples: int


class Method:
    """Float32 training: no quantization, every operand charged 32 bits."""

    skips_layers = False  # whether a forward may leave some parameters unused (DDP must then look for them)

    def __init__(self, cfg: MethodConfig) -> None:
        self.cfg = cfg  # read and checked against its schema (qtrain.config.methods)

    @property
    def name(self) -> str:
        return self.cfg.name

    def prepare(self, model: nn.Module) -> nn.Module:
        """Swap layers for quantized ones, add gates; called once before the optimizer is built."""
        return model

    def parameter_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (called once, after :meth:`prepare`): one, every parameter of ``model``."""
        return [{"params": list(model.parameters())}]

    def attach(self, optimizer: torch.optim.Optimizer, facts: RunFacts) -> None:
        """Called once the optimizer exists (before a resume loads state): a method that sets the learning rate keeps it."""

    def profile(self, model: nn.Module, sample: torch.Tensor) -> dict[str, int]:
        """MACs per sample of every costed layer (called once after :meth:`prepare`, in eval mode)."""
        return profile_macs(model, sample)

    def operand_sizes(self, model: nn.Module, sample: torch.Tensor) -> dict[str, OperandSizes]:
        """Operand elements of every layer :meth:`profile` costs, each layer running as it does there (what the
        hardware models move through memory)."""
        return operand_sizes(model, sample)

    def loss(self, loss: torch.Tensor, info: StepInfo) -> torch.Tensor:
        """Add method terms to the task loss."""
        return loss

    def after_backward(self, info: StepInfo) -> None:
        """Read gradients before the optimizer step."""

    def after_step(self, info: StepInfo) -> None:
        """Act after the optimizer step (re-quantize, switch precision)."""

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        """Epoch-level decisions (loss indicators, precision switches); may add columns to ``metrics``."""

    def stopped(self) -> str | None:
        """The rule by which the method has ended training before ``train.epochs`` (None: training goes on).

        The trainer asks after every epoch, and before the first one of a resumed run: a method that stops
        keeps that in :meth:`state_dict`, so a resumed run stays stopped.
        """
        return None

    def precision(self) -> PrecisionRecord:
        """The current per-layer precision; layers absent from it are float32."""
        return {}

    def layer_columns(self) -> dict[str, dict[str, Any]]:
        """Extra precision.csv columns of each layer's epoch rows (its state at the epoch's end)."""
        return {}

    def drain_event_rows(self) -> list[dict[str, Any]]:
        """precision.csv rows of the method's events since the last call (AdaPT's ``switch``, DYNASTY's ``bitmap``,
        DFQ's ``gates_eval`` and ``gates_probability``)."""
        return []

    def report(self, epochs: int) -> dict[str, Any]:
        """Figures for summary.json under the method's name after ``epochs`` epochs (empty: nothing to add)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Everything the method needs to resume (model-held state is in the model's own state_dict)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
