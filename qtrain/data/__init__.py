"""Dataset registry: a name in the config loads the data and fixes the task."""

from __future__ import annotations

from dataclasses import replace

from omegaconf import DictConfig

from qtrain.config import TEXT_DATASETS
from qtrain.data.base import Data, Stream
from qtrain.data.batches import BatchStream, ImageData, ImageSplit
from qtrain.data.embedded_text import pydoc_corpus
from qtrain.data.folder import load_folder
from qtrain.data.subsets import take_fold, take_sample, take_subset
from qtrain.data.text import TextData, TokenStream, first_tokens, read_corpus
from qtrain.data.vision import load_cifar, load_digits_data, load_mnist, make_synthetic_data
from qtrain.errors import ConfigError
from qtrain.task import CHARACTER_MODEL, CLASSIFICATION, LANGUAGE_MODEL, Task

# Every dataset's task, known before anything is loaded (a model is checked against it in the preflight).
DATASETS: dict[str, Task] = {
    "digits": CLASSIFICATION, "synthetic": CLASSIFICATION, "cifar10": CLASSIFICATION, "cifar100": CLASSIFICATION,
    "mnist": CLASSIFICATION, "imagenet": CLASSIFICATION, "imagefolder": CLASSIFICATION,
    **dict.fromkeys(TEXT_DATASETS, LANGUAGE_MODEL),
}


def data_task(cfg: DictConfig) -> Task:
    """The task of the dataset ``cfg`` (the ``data`` config group) names: a character-level corpus's adds bits per
    character."""
    if cfg.name in TEXT_DATASETS and cfg.level == "char":
        return CHARACTER_MODEL
    return DATASETS[cfg.name]


def load_data(cfg: DictConfig) -> Data:
    """Load the dataset that ``cfg`` (the ``data`` config group) names: images with the half that ``subset`` names,
    their ``sample`` and the training parts of cross-validation ``fold`` (of ``folds``), or a corpus (the embedded
    ``text``, else files under ``root``) and its ``sample``."""
    if cfg.name in TEXT_DATASETS:
        root = pydoc_corpus() if cfg.name == "text" else cfg.root
        return replace(first_tokens(read_corpus(root, cfg.name, cfg.level, cfg.min_count), cfg.sample),
                       task=data_task(cfg))
    return take_fold(take_sample(take_subset(_load(cfg), cfg.subset), cfg.sample), cfg.fold, cfg.folds)


def _load(cfg: DictConfig) -> Data:
    name = cfg.name
    if name == "digits":
        return load_digits_data()
    if name == "synthetic":
        return make_synthetic_data(cfg.n_train, cfg.n_test, cfg.num_classes, cfg.channels, cfg.size, cfg.seed)
    if name in ("cifar10", "cifar100"):
        return load_cifar(cfg.root, int(name[5:]))
    if name == "mnist":
        return load_mnist(cfg.root)
    if name in ("imagenet", "imagefolder"):
        return load_folder(name, cfg.root, cfg.image_size, cfg.mean, cfg.std, cfg.workers)
    raise ConfigError(f"unknown dataset {name!r} (choose from: {', '.join(DATASETS)})")


__all__ = ["BatchStream", "Data", "ImageData", "ImageSplit", "DATASETS", "Stream", "TextData", "TokenStream", "data_task",
           "load_data"]
