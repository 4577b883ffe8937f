"""Typed schemas of the model configs' own keys (``conf/model/<name>.yaml``), torch-free: a dataclass per model with
keys of its own in :data:`MODELS`, read by :func:`check_model` before any work, and the Transformer's presets
(:data:`PRESETS`, for the resolver ``qtrain.transformer`` of its config files)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from omegaconf import DictConfig

from qtrain.config.schema import bounded, read
from qtrain.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    """The key every model has: its name (a model of no other keys of its own has this schema)."""

    name: str


class Stem(Enum):
    AUTO = "auto"  # the CIFAR form up to 64x64 inputs, the ImageNet form above
    CIFAR = "cifar"
    IMAGENET = "imagenet"


@dataclass(frozen=True)
class ImageNetResNet(ModelConfig):
    stem: Stem


class ClassifierInit(Enum):
    TORCH = "torch"  # nn.Linear's own: uniform in +-1/sqrt(in)
    NORMAL_IN_OUT = "normal_in_out"  # N(0, 2/(in*out)): FracTrain's reference code's CIFAR ResNets


@dataclass(frozen=True)
class CIFARResNet(ModelConfig):
    classifier_init: ClassifierInit


# The Transformer's sizes by name, with each one's peak learning rate and warm-up (conf/recipe): base is FracTrain
# Table 2's Transformer-base, small trains on a CPU, tiny is for tests (docs/models.md)
PRESETS: dict[str, dict[str, Any]] = {
    "base": {"layers": 6, "d_model": 512, "heads": 8, "ffn": 2048, "dropout": 0.1, "seq_len": 256,
             "lr": 7.0e-4, "warmup_steps": 4000},
    "small": {"layers": 2, "d_model": 128, "heads": 4, "ffn": 512, "dropout": 0.1, "seq_len": 64,
              "lr": 1.0e-3, "warmup_steps": 100},
    "tiny": {"layers": 1, "d_model": 32, "heads": 2, "ffn": 64, "dropout": 0.0, "seq_len": 16,
             "lr": 1.0e-3, "warmup_steps": 100},
}
Preset = Enum("Preset", {name.upper(): name for name in PRESETS})


def preset_value(preset: str, key: str) -> Any:
    """A preset's size (the resolver ``qtrain.transformer`` of ``conf/model/transformer.yaml``)."""
    if preset not in PRESETS:
        raise ConfigError(f"model.preset={preset!r} is not allowed (choose from: {', '.join(PRESETS)})")
    return PRESETS[preset][key]


@dataclass(frozen=True)
class Transformer(ModelConfig):
    preset: Preset
    layers: int = bounded(1)
    d_model: int = bounded(1)
    heads: int = bounded(1)
    ffn: int = bounded(1)
    dropout: float = bounded(0, 1, high_open=True)
    seq_len: int = bounded(1)

    def __post_init__(self) -> None:
        if self.d_model % self.heads or self.d_model % 2:
            raise ConfigError(f"model.d_model={self.d_model} is not allowed with model.heads={self.heads}: "
                              "d_model must be even and a multiple of heads")


# The models with keys of their own to check; every other model (conf/model names them all) has ModelConfig's.
MODELS: dict[str, type[ModelConfig]] = {
    "resnet18": ImageNetResNet, "resnet34": ImageNetResNet, "transformer": Transformer,
    **dict.fromkeys(("resnet20", "resnet38", "resnet74", "resnet110", "resnet164"), CIFARResNet),
}


def check_model(model: DictConfig) -> ModelConfig:
    """``model`` (a composed config's ``model`` node; its name one of conf/model's files) read against its schema.

    The ``dfq_*`` keys are the gated methods' (DFQ, FracTrain): their schemas in :mod:`qtrain.config.methods` check
    them where a method reads them. What needs the data stays with the model registry (:mod:`qtrain.models`): whether
    the input is square and large enough.
    """
    return read(MODELS.get(model.name, ModelConfig), model, "model")
