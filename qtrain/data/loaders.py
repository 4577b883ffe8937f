"""Each dataset's loader, as :mod:`qtrain.data.registry` names it: the ``data`` config in, the whole dataset out
(the subset, sample and fold are taken by :func:`qtrain.data.load_data`)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from qtrain.data.batches import ImageData
from qtrain.data.embedded_text import pydoc_corpus
from qtrain.data.folder import FolderData, load_folder
from qtrain.data.text import TextData, read_corpus
from qtrain.data.vision import load_cifar, load_digits_data, load_mnist, make_synthetic_data
from qtrain.errors import DataError


def digits(cfg: DictConfig) -> ImageData:
    return load_digits_data()


def synthetic(cfg: DictConfig) -> ImageData:
    return make_synthetic_data(cfg.n_train, cfg.n_test, cfg.num_classes, cfg.channels, cfg.size, cfg.seed)


def cifar(cfg: DictConfig) -> ImageData:
    return load_cifar(cfg.root, int(cfg.name.removeprefix("cifar")))


def mnist(cfg: DictConfig) -> ImageData:
    return load_mnist(cfg.root)


def folder(cfg: DictConfig) -> FolderData:
    return load_folder(cfg.name, cfg.root, cfg.image_size, cfg.mean, cfg.std, cfg.workers)


def embedded_text(cfg: DictConfig) -> TextData:
    return read_corpus(pydoc_corpus(), cfg.name, cfg.level, cfg.min_count)


# The folder each WikiText release unpacks to: data.root may name it or, as for every other dataset, its parent.
RELEASE_FOLDERS = {"wikitext2": "wikitext-2", "wikitext103": "wikitext-103"}


def corpus(cfg: DictConfig) -> TextData:
    root, folder = Path(cfg.root).expanduser(), RELEASE_FOLDERS.get(cfg.name)
    if folder is None:  # a corpus of one's own: its files are in data.root
        return read_corpus(root, cfg.name, cfg.level, cfg.min_count)
    if (root / folder).is_dir() and not any(root.glob("*.tokens")):
        return read_corpus(root / folder, cfg.name, cfg.level, cfg.min_count)
    try:
        return read_corpus(root, cfg.name, cfg.level, cfg.min_count)
    except DataError as err:
        raise DataError(f"{err} (nor a {folder}/ folder holding one)") from None
