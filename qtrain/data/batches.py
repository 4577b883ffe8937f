"""Tensor-resident image data and its batch stream: images stay a uint8 tensor on the training device and each batch
is augmented as whole-batch tensor operations, in an order that depends only on (seed, epoch). See docs/data.md."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch.nn import functional as F

from qtrain.data.base import GlobalBatches
from qtrain.task import CLASSIFICATION, Task


@dataclass
class ImageSplit:
    """Images (N, C, H, W) uint8 in [0, pixel_max] and their int64 labels."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def to(self, device: torch.device) -> ImageSplit:
        return ImageSplit(self.images.to(device), self.labels.to(device))

    def take(self, index: torch.Tensor) -> ImageSplit:
        """The images at ``index``, in its order."""
        return ImageSplit(self.images[index], self.labels[index])


@dataclass
class ImageData:
    """A classification dataset: splits, class count and the per-channel normalization."""

    name: str
    train: ImageSplit
    test: ImageSplit
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    pixel_max: float = 255.0
    task: Task = CLASSIFICATION

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train.images.shape[1:])

    def model_inputs(self) -> dict[str, Any]:
        channels, height, width = self.image_shape
        return {"in_channels": channels, "num_classes": self.num_classes, "input_size": (height, width)}

    def streams(self, cfg: DictConfig, device: torch.device, rank: int, world: int) -> tuple[BatchStream, BatchStream]:
        """Shuffled, augmented (``data.augment``) training batches and in-order test batches, resident on ``device``."""
        train, test = self.train.to(device), self.test.to(device)
        augment = cfg.data.augment
        return (BatchStream(self, train, cfg.train.batch_size, cfg.seed, True, augment.crop_padding, augment.flip,
                            rank, world),
                BatchStream(self, test, cfg.train.eval_batch_size, cfg.seed, False, rank=rank, world=world))


def channel_stats(images: torch.Tensor, pixel_max: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation of uint8 images scaled to [0, 1]."""
    x = images.to(torch.float64).div(pixel_max).transpose(0, 1).reshape(images.shape[1], -1)
    return tuple(x.mean(1).tolist()), tuple(x.std(1).tolist())


class BatchStream(GlobalBatches):
    """Batches of one split: shuffled and augmented for training, in order for evaluation."""

    def __init__(
        self,
        data: ImageData,
        split: ImageSplit,
        batch_size: int,
        seed: int,
        train: bool,
        crop_padding: int = 0,
        flip: bool = False,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        super().__init__(len(split), batch_size, seed, train, rank, world)
        self.split = split
        self.crop_padding, self.flip = (crop_padding, flip) if train else (0, False)
        device = split.images.device
        channels = data.image_shape[0]
        self.mean = torch.tensor(data.mean, device=device).view(1, channels, 1, 1) * data.pixel_max
        self.inv_std = 1.0 / (torch.tensor(data.std, device=device).view(1, channels, 1, 1) * data.pixel_max)

    def example(self, n: int) -> torch.Tensor:
        return self.split.images[:n].float()  # profiling reads shapes only: no normalization needed

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        device = self.split.images.device
        order, gen = self.order(epoch)
        for i, (batch, part) in enumerate(self.parts(order.to(device))):  # the random draws below cover the whole batch
            # every batch's draws are made, so that batches from ``start`` on are those of the whole epoch
            p = self.crop_padding
            shifts = [torch.randint(0, 2 * p + 1, (len(batch), 1), generator=gen)[part] for _ in "yx"] if p else None
            flips = torch.rand(len(batch), generator=gen)[part] < 0.5 if self.flip else None
            if i < start:
                continue
            idx = batch[part]
            x = self.split.images[idx].to(torch.float32)
            if shifts is not None:
                x = self._crop(x, *(s.to(device) for s in shifts))
            if flips is not None:
                x = torch.where(flips.to(device).view(-1, 1, 1, 1), x.flip(3), x)
            yield (x - self.mean) * self.inv_std, self.split.labels[idx]

    def _crop(self, x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
        """Each image's window shifted by (dy, dx) in the image padded by ``crop_padding``."""
        b, _, h, w = x.shape
        p = self.crop_padding
        padded = F.pad(x, (p, p, p, p))
        rows = (dy + torch.arange(h, device=x.device)).view(b, 1, h, 1)
        cols = (dx + torch.arange(w, device=x.device)).view(b, 1, 1, w)
        batch = torch.arange(b, device=x.device).view(b, 1, 1, 1)
        chans = torch.arange(x.shape[1], device=x.device).view(1, -1, 1, 1)
        return padded[batch, chans, rows, cols]
