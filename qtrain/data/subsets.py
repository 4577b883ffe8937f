"""Parts of a dataset: FracTrain's halves (``data.subset``; FracTrain Sec. 4.5, appendix E), fixed-size samples
(``data.sample``) and AdaPT's stratified cross-validation folds (``data.fold`` of ``data.folds``; AdaPT paper
Sec. 4.1.1). The rules and the departure from AdaPT's reference code: docs/data.md."""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

import torch
from omegaconf import DictConfig

from qtrain.data.batches import ImageData, ImageSplit
from qtrain.data.folder import FileSplit, FolderData
from qtrain.errors import ConfigError

SPLIT_SEED = 0  # the sample split must not follow the run's seed: pre-training and retraining share it

SplitT = TypeVar("SplitT", ImageSplit, FileSplit)
DataT = TypeVar("DataT", ImageData, FolderData)


def class_range(labels: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The indices of the samples of classes ``lo`` to ``hi - 1``."""
    return ((labels >= lo) & (labels < hi)).nonzero().flatten()


def sample_half(labels: torch.Tensor, part: int) -> torch.Tensor:
    """The indices of half ``part`` (0: the larger half of an odd class) of every class, a fixed random choice."""
    generator = torch.Generator().manual_seed(SPLIT_SEED)
    chosen = []
    for label in labels.unique(sorted=True).tolist():
        members = (labels == label).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        half = (len(members) + 1) // 2
        chosen.append(members[:half] if part == 0 else members[half:])
    return torch.cat(chosen).sort().values


def balanced(labels: torch.Tensor, size: int, num_classes: int) -> torch.Tensor:
    """The indices of a fixed class-balanced random sample of ``size`` samples."""
    generator = torch.Generator().manual_seed(SPLIT_SEED)
    chosen = []
    for label in range(num_classes):
        members = (labels == label).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        chosen.append(members[:size // num_classes + (label < size % num_classes)])
    return torch.cat(chosen).sort().values


def fold_out(labels: torch.Tensor, fold: int, folds: int) -> torch.Tensor:
    """The indices of held-out part ``fold`` of ``folds``: each class's samples in a fixed random order, cut in
    ``folds`` near-equal parts, part ``fold`` of every class."""
    generator = torch.Generator().manual_seed(SPLIT_SEED)
    chosen = []
    for label in labels.unique(sorted=True).tolist():
        members = (labels == label).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        chosen.append(torch.tensor_split(members, folds)[fold])
    return torch.cat(chosen).sort().values


def _class_range(split: SplitT, lo: int, hi: int) -> SplitT:
    part = split.take(class_range(split.labels, lo, hi))
    return replace(part, labels=part.labels - lo)


def take_sample(data: DataT, sample: DictConfig | None) -> DataT:
    """``data`` itself, or the class-balanced sample of ``sample.train`` and ``sample.test`` images of its splits
    (a split ``sample`` leaves out stays whole)."""
    if sample is None:
        return data
    taken = {}
    for name in sample:
        split, size = getattr(data, name), sample[name]
        if size > len(split) or size < data.num_classes:
            raise ConfigError(f"data.sample.{name}={size} is not allowed: a class-balanced sample of the {name} split "
                              f"takes from {data.num_classes} (one of each class) to {len(split)} (the whole split) images")
        index = balanced(split.labels, size, data.num_classes)
        if len(index) < size:
            raise ConfigError(f"data.sample.{name}={size} is not allowed: some class of the {name} split has fewer than "
                              f"the {-(-size // data.num_classes)} images a class-balanced sample of {size} takes from each")
        taken[name] = split.take(index)
    return replace(data, **taken)


def take_subset(data: DataT, subset: DictConfig | None) -> DataT:
    """``data`` itself, or the half of it that ``subset`` ({by, part}) names."""
    if subset is None:
        return data
    if subset.by not in ("classes", "samples") or subset.part not in (0, 1):
        raise ConfigError(f"data.subset={dict(subset)} is not allowed: by is classes or samples, part is 0 or 1")
    if subset.by == "samples":
        return replace(data, train=data.train.take(sample_half(data.train.labels, subset.part)))
    half = data.num_classes // 2
    lo, hi = (0, half) if subset.part == 0 else (half, data.num_classes)
    return replace(data, train=_class_range(data.train, lo, hi), test=_class_range(data.test, lo, hi), num_classes=hi - lo)


def take_fold(data: DataT, fold: int | None, folds: int) -> DataT:
    """``data`` itself, or ``data`` training on every part of ``folds`` but the held-out part ``fold``."""
    if fold is None:
        return data
    smallest = int(data.train.labels.unique(return_counts=True)[1].min()) if len(data.train.labels) else 0
    if folds > smallest:
        raise ConfigError(f"data.folds={folds} is not allowed: at most {smallest}, the images of the training split's "
                          "smallest class (each fold holds part of every class)")
    keep = torch.ones(len(data.train.labels), dtype=torch.bool)
    keep[fold_out(data.train.labels, fold, folds)] = False
    return replace(data, train=data.train.take(keep.nonzero().flatten()))
