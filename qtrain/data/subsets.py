"""Parts of a dataset: FracTrain's halves (``data.subset``) and fixed-size samples (``data.sample``).

Halves, for FracTrain's adaptation and fine-tuning settings (FracTrain Sec. 4.5, appendix E):

- ``by: classes``: part 0 holds the first half of the classes, part 1 the rest, in both the training
  and the test split, relabelled from 0 (adaptation: pre-train on one half, retrain on the other).
- ``by: samples``: the training split is halved within every class (a fixed random half, the same
  for every run); the test split stays whole (fine-tuning: pre-train on one half, retrain on the other).

A sample (``{train: N, test: M}``, taken after the halves) keeps N training and M test images, class-balanced:
each class gets N // classes of them and the first N % classes classes one more (a class with fewer
keeps all it has). The images are a fixed random choice, the same for every run, like the sample halves.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from omegaconf import DictConfig

from qtrain.data.batches import ImageData, ImageSplit
from qtrain.errors import ConfigError

SPLIT_SEED = 0  # the sample split must not follow the run's seed: pre-training and retraining share it


def _class_range(split: ImageSplit, lo: int, hi: int) -> ImageSplit:
    keep = (split.labels >= lo) & (split.labels < hi)
    return ImageSplit(split.images[keep], split.labels[keep] - lo)


def _sample_half(split: ImageSplit, part: int) -> ImageSplit:
    generator = torch.Generator().manual_seed(SPLIT_SEED)
    chosen = []
    for label in split.labels.unique(sorted=True).tolist():
        members = (split.labels == label).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        half = (len(members) + 1) // 2
        chosen.append(members[:half] if part == 0 else members[half:])
    index = torch.cat(chosen).sort().values
    return ImageSplit(split.images[index], split.labels[index])


def _balanced(split: ImageSplit, size: int, num_classes: int) -> ImageSplit:
    generator = torch.Generator().manual_seed(SPLIT_SEED)
    chosen = []
    for label in range(num_classes):
        members = (split.labels == label).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        chosen.append(members[:size // num_classes + (label < size % num_classes)])
    index = torch.cat(chosen).sort().values
    return ImageSplit(split.images[index], split.labels[index])


def take_sample(data: ImageData, sample: DictConfig | None) -> ImageData:
    """``data`` itself, or the class-balanced sample of ``sample.train`` and ``sample.test`` images of its splits."""
    if sample is None:
        return data
    return replace(data, train=_balanced(data.train, sample.train, data.num_classes),
                   test=_balanced(data.test, sample.test, data.num_classes))


def take_subset(data: ImageData, subset: DictConfig | None) -> ImageData:
    """``data`` itself, or the half of it that ``subset`` ({by, part}) names."""
    if subset is None:
        return data
    if subset.by not in ("classes", "samples") or subset.part not in (0, 1):
        raise ConfigError(f"data.subset={dict(subset)} is not allowed: by is classes or samples, part is 0 or 1")
    if subset.by == "samples":
        return replace(data, train=_sample_half(data.train, subset.part))
    half = data.num_classes // 2
    lo, hi = (0, half) if subset.part == 0 else (half, data.num_classes)
    return replace(data, train=_class_range(data.train, lo, hi), test=_class_range(data.test, lo, hi), num_classes=hi - lo)
