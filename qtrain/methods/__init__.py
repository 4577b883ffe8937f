"""The methods, one module each: :func:`build_method` trains the one a config names, by the registry of their config
schemas (:data:`qtrain.config.methods.METHODS`, where each schema names the class that trains it)."""

from __future__ import annotations

import importlib

from omegaconf import DictConfig

from qtrain.config.methods import check_method
from qtrain.methods.base import Method, RunFacts, StepInfo


def build_method(cfg: DictConfig) -> Method:
    """The method ``cfg.name``, handed its config once read and checked against its schema."""
    config = check_method(cfg)
    module, name = config.implementation.split(":")
    return getattr(importlib.import_module(module), name)(config)


__all__ = ["Method", "RunFacts", "StepInfo", "build_method"]
