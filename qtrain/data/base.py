"""What the trainer and the run need of a dataset, whatever its kind: a :class:`Data` (its task, the sizes its model is
built for, its streams) and the :class:`Stream` of one split's batches, the same for every run of the same seed."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from omegaconf import DictConfig

from qtrain.task import Task


def rank_slice(size: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s contiguous part of a global batch of ``size`` samples (sizes differ by at most one)."""
    return slice(rank * size // world, (rank + 1) * size // world)


class GlobalBatches:
    """The global batches of a split of ``size`` samples, the order of an epoch, and each rank's part of a batch.

    What every :class:`Stream` shares: batches of ``batch_size`` samples over all ranks (the last may be
    short); the order of epoch ``e`` drawn from a generator seeded by (``seed``, ``e``) when ``shuffle``, else
    the samples as they are; a stream goes on drawing the epoch's augmentation from that same generator.
    """

    def __init__(self, size: int, batch_size: int, seed: int, shuffle: bool, rank: int = 0, world: int = 1) -> None:
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self.rank, self.world = rank, world

    def __len__(self) -> int:
        return -(-self.size // self.batch_size)

    @property
    def samples(self) -> int:
        return self.size

    def global_size(self, i: int) -> int:
        """How many samples batch ``i`` holds over all ranks."""
        return min(self.batch_size, self.size - i * self.batch_size)

    def smallest_part(self) -> int:
        """The fewest samples a rank gets from any batch (the last batch may be short)."""
        return self.global_size(len(self) - 1) // self.world

    def order(self, epoch: int) -> tuple[torch.Tensor, torch.Generator]:
        """Epoch ``epoch``'s order of the sample indices (on the CPU) and the generator that drew it."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.size, generator=gen) if self.shuffle else torch.arange(self.size)
        return order, gen

    def parts(self, order: torch.Tensor) -> Iterator[tuple[torch.Tensor, slice]]:
        """Each global batch of ``order`` and the slice of it that is this rank's."""
        for start in range(0, self.size, self.batch_size):
            batch = order[start:start + self.batch_size]
            yield batch, rank_slice(len(batch), self.rank, self.world)


class Stream(Protocol):
    """The batches of one split. ``epoch(e)`` yields ``(inputs, targets)`` on the training device."""

    def __len__(self) -> int:
        """Batches per epoch."""

    def global_size(self, i: int) -> int:
        """Samples (images, sequences) batch ``i`` holds over all ranks."""

    def smallest_part(self) -> int:
        """The fewest samples a rank gets from any batch."""

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of epoch ``epoch`` from batch ``start`` on (order and augmentation depend only on the seed,
        ``epoch`` and ``start``: batches before it are not loaded)."""

    @property
    def samples(self) -> int:
        """Samples per epoch over all ranks."""

    def example(self, n: int) -> torch.Tensor:
        """A batch of ``n`` model inputs on the training device (profiling the model's MACs and operand sizes)."""


class Data(Protocol):
    """A dataset, loaded once per run (images in memory, an image folder on disk, a token corpus): its
    :class:`~qtrain.task.Task`, the sizes its model is built for, and its :class:`Stream` objects, each rank of a
    multi-process run taking its slice of every global batch."""

    name: str
    task: Task

    def model_inputs(self) -> dict[str, Any]:
        """The sizes a model is built for (``in_channels``/``num_classes``/``input_size``, or ``vocab_size``)."""

    def streams(self, cfg: DictConfig, device: torch.device, rank: int, world: int) -> tuple[Stream, Stream]:
        """The training and evaluation streams of the run ``cfg`` (its ``train``, ``data`` and ``model`` keys)."""


class Periods:
    """``stream`` cut into epochs of ``steps`` batches (``train.batches_per_epoch``), over the endless run of its passes.

    Epoch ``e`` holds batches ``e * steps`` to ``(e + 1) * steps - 1`` of passes 0, 1, 2, ... of ``stream`` laid end
    to end, so each epoch takes up where the last one stopped and depends only on the seed and ``e`` (a resumed run
    sees the same batches). For training that a pass of the data is too long to cut into epochs (FracTrain's
    Transformer trains 50,000 steps, half a pass of WikiText-103), or epochs as the reference code counts them.
    """

    def __init__(self, stream: Stream, steps: int) -> None:
        self.stream, self.steps = stream, steps
        self._first = 0  # the batch (counted over passes) that the epoch being read started at

    def __len__(self) -> int:
        return self.steps

    @property
    def samples(self) -> int:
        """Samples per epoch: the stream's per batch, on average over a pass."""
        return round(self.steps * self.stream.samples / len(self.stream))

    def global_size(self, i: int) -> int:
        return self.stream.global_size((self._first + i) % len(self.stream))

    def smallest_part(self) -> int:
        return self.stream.smallest_part()

    def example(self, n: int) -> torch.Tensor:
        return self.stream.example(n)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        per_pass = len(self.stream)
        self._first = epoch * self.steps
        at, end = self._first + start, self._first + self.steps
        while at < end:
            pass_, first = divmod(at, per_pass)
            taken = min(per_pass - first, end - at)
            yield from itertools.islice(self.stream.epoch(pass_, first), taken)
            at += taken
