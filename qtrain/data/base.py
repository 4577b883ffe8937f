"""What the trainer and the run need of a dataset, whatever its kind (DESIGN.md, "Data").

A :class:`Data` is loaded once per run (images in memory, an image folder on disk, a token corpus) and
knows its :class:`~qtrain.task.Task`, the sizes its model is built for, and how to cut itself into
:class:`Stream` objects: the batches of one split, the same for every run of the same seed, each rank
of a multi-process run taking its slice of every global batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from omegaconf import DictConfig

from qtrain.task import Task


def rank_slice(size: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s contiguous part of a global batch of ``size`` samples (sizes differ by at most one)."""
    return slice(rank * size // world, (rank + 1) * size // world)


class Stream(Protocol):
    """The batches of one split. ``epoch(e)`` yields ``(inputs, targets)`` on the training device."""

    def __len__(self) -> int:
        """Batches per epoch."""

    def global_size(self, i: int) -> int:
        """Samples (images, sequences) batch ``i`` holds over all ranks."""

    def smallest_part(self) -> int:
        """The fewest samples a rank gets from any batch."""

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of epoch ``epoch`` (its order and augmentation depend only on the seed and ``epoch``)."""

    @property
    def samples(self) -> int:
        """Samples per epoch over all ranks."""

    def example(self, n: int) -> torch.Tensor:
        """A batch of ``n`` model inputs on the training device (profiling the model's MACs and operand sizes)."""


class Data(Protocol):
    name: str
    task: Task

    def model_inputs(self) -> dict[str, Any]:
        """The sizes a model is built for (``in_channels``/``num_classes``/``input_size``, or ``vocab_size``)."""

    def streams(self, cfg: DictConfig, device: torch.device, rank: int, world: int) -> tuple[Stream, Stream]:
        """The training and evaluation streams of the run ``cfg`` (its ``train``, ``data`` and ``model`` keys)."""
