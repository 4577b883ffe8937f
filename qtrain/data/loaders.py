"""Each dataset's loader, as :mod:`qtrain.data.registry` names it: the ``data`` config in, the whole dataset out
(the subset, sample and fold are taken by :func:`qtrain.data.load_data`)."""

from __future__ import annotations

from omegaconf import DictConfig

from qtrain.data.batches import ImageData
from qtrain.data.embedded_text import pydoc_corpus
from qtrain.data.folder import FolderData, load_folder
from qtrain.data.text import TextData, read_corpus
from qtrain.data.vision import load_cifar, load_digits_data, load_mnist, make_synthetic_data


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


def corpus(cfg: DictConfig) -> TextData:
    return read_corpus(cfg.root, cfg.name, cfg.level, cfg.min_count)
