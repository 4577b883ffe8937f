"""Dataset registry: a name in the config loads the data and fixes the task."""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from qtrain.data.registry import REGISTRY, Kind, dataset

if TYPE_CHECKING:
    from qtrain.data.base import Data
    from qtrain.task import Task

# The names this package gives from its modules, imported when first asked for: the registry and the config checks
# import qtrain.data without torch.
_EXPORTS = {"Data": "base", "Stream": "base", "BatchStream": "batches", "ImageData": "batches", "ImageSplit": "batches",
            "TextData": "text", "TokenStream": "text"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"qtrain.data.{_EXPORTS[name]}"), name)
    if name == "DATASETS":  # every dataset's task, known before anything is loaded (the preflight checks the model's)
        from qtrain.task import TASKS

        return {name: TASKS[entry.task] for name, entry in REGISTRY.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def data_task(cfg: DictConfig) -> Task:
    """The task of the dataset ``cfg`` (the ``data`` config group) names: a character-level corpus's adds bits per
    character."""
    from qtrain.task import CHARACTER_MODEL, TASKS

    entry = dataset(cfg.name)
    if entry.kind is Kind.TEXT and cfg.level == "char":
        return CHARACTER_MODEL
    return TASKS[entry.task]


def load_data(cfg: DictConfig) -> Data:
    """Load the dataset that ``cfg`` (the ``data`` config group) names: images with the half that ``subset`` names,
    their ``sample`` and the training parts of cross-validation ``fold`` (of ``folds``), or a corpus (the embedded
    ``text``, else files under ``root``) and its ``sample``."""
    from qtrain.data.subsets import take_fold, take_sample, take_subset
    from qtrain.data.text import first_tokens

    entry = dataset(cfg.name)
    if entry.kind is Kind.TEXT:
        return replace(first_tokens(entry.load(cfg), cfg.sample), task=data_task(cfg))
    return take_fold(take_sample(take_subset(entry.load(cfg), cfg.subset), cfg.sample), cfg.fold, cfg.folds)


__all__ = ["BatchStream", "Data", "ImageData", "ImageSplit", "DATASETS", "Stream", "TextData", "TokenStream", "data_task",
           "load_data"]
