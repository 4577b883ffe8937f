"""Every dataset qtrain loads, by its name in ``conf/data/``: its loader, its task, its kind, whether it reads data.root.

Adding a dataset is a ``conf/data/<name>.yaml`` and an entry here (its loader in :mod:`qtrain.data.loaders`).
Imports no torch: the config checks read this table before any work, and a loader is imported only when a run
loads its data.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from qtrain.errors import ConfigError


class Kind(Enum):
    """What a dataset holds, which decides the keys of its config that are checked."""

    IMAGES = "images"  # image arrays held in memory: data.augment applies
    SYNTHETIC = "synthetic"  # images made up from data.n_train, n_test, num_classes, channels, size and seed
    FOLDER = "folder"  # an image tree read by DataLoader workers: torchvision's transforms stand in for data.augment
    TEXT = "text"  # a language-modelling corpus: data.level and data.min_count


CLASSIFICATION = "classification"  # the names of qtrain.task's tasks (that module imports torch)
LANGUAGE_MODEL = "language_model"


@dataclass(frozen=True)
class Dataset:
    loader: str  # "module:function" that takes the data config and gives the whole dataset
    task: str  # CLASSIFICATION or LANGUAGE_MODEL
    kind: Kind
    needs_root: bool  # its files are read from data.root (scale=smoke's stand-ins need none)
    train_images: int | None = None  # the training split's size where the release fixes it (config checks bound a run by it)

    def load(self, cfg: Any) -> Any:
        """Import the loader and call it on ``cfg``, the ``data`` config group."""
        module, _, function = self.loader.partition(":")
        load: Callable[[Any], Any] = getattr(importlib.import_module(module), function)
        return load(cfg)


_LOADERS = "qtrain.data.loaders"
REGISTRY: dict[str, Dataset] = {
    "digits": Dataset(f"{_LOADERS}:digits", CLASSIFICATION, Kind.IMAGES, needs_root=False, train_images=1_437),
    "synthetic": Dataset(f"{_LOADERS}:synthetic", CLASSIFICATION, Kind.SYNTHETIC, needs_root=False),
    "cifar10": Dataset(f"{_LOADERS}:cifar", CLASSIFICATION, Kind.IMAGES, needs_root=True, train_images=50_000),
    "cifar100": Dataset(f"{_LOADERS}:cifar", CLASSIFICATION, Kind.IMAGES, needs_root=True, train_images=50_000),
    "mnist": Dataset(f"{_LOADERS}:mnist", CLASSIFICATION, Kind.IMAGES, needs_root=True, train_images=60_000),
    "imagenet": Dataset(f"{_LOADERS}:folder", CLASSIFICATION, Kind.FOLDER, needs_root=True),
    "imagefolder": Dataset(f"{_LOADERS}:folder", CLASSIFICATION, Kind.FOLDER, needs_root=True),
    "text": Dataset(f"{_LOADERS}:embedded_text", LANGUAGE_MODEL, Kind.TEXT, needs_root=False),
    "wikitext2": Dataset(f"{_LOADERS}:corpus", LANGUAGE_MODEL, Kind.TEXT, needs_root=True),
    "wikitext103": Dataset(f"{_LOADERS}:corpus", LANGUAGE_MODEL, Kind.TEXT, needs_root=True),
    "corpus": Dataset(f"{_LOADERS}:corpus", LANGUAGE_MODEL, Kind.TEXT, needs_root=True),
}


def dataset(name: str) -> Dataset:
    """The registry's entry for ``name``; an unknown name is a ConfigError naming the known ones."""
    if name not in REGISTRY:
        raise ConfigError(f"unknown dataset {name!r} (choose from: {', '.join(sorted(REGISTRY))})")
    return REGISTRY[name]
