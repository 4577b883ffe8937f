"""Model registry (timm's style): a name in the config builds the model for the data's sizes and task."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from torch import nn

from qtrain.errors import ConfigError
from qtrain.models.alexnet import AlexNetCIFAR
from qtrain.models.mobilenetv2 import MobileNetV2CIFAR
from qtrain.models.resnet import STAGES, ResNetImageNet
from qtrain.models.resnet_cifar import ResNetCIFAR
from qtrain.models.transformer import TransformerLM
from qtrain.task import CLASSIFICATION, Task

MODELS: dict[str, tuple[type[nn.Module], Callable[..., nn.Module]]] = {
    "resnet20": (ResNetCIFAR, partial(ResNetCIFAR, 20)),
    "resnet38": (ResNetCIFAR, partial(ResNetCIFAR, 38)),
    "resnet74": (ResNetCIFAR, partial(ResNetCIFAR, 74)),
    "resnet110": (ResNetCIFAR, partial(ResNetCIFAR, 110)),
    "resnet164": (ResNetCIFAR, partial(ResNetCIFAR, 164, bottleneck=True)),
    "resnet18": (ResNetImageNet, partial(ResNetImageNet, STAGES[18])),
    "resnet34": (ResNetImageNet, partial(ResNetImageNet, STAGES[34])),
    "alexnet": (AlexNetCIFAR, AlexNetCIFAR),
    "mobilenetv2": (MobileNetV2CIFAR, MobileNetV2CIFAR),
    "transformer": (TransformerLM, TransformerLM),
}


def model_task(name: str) -> Task:
    """The task model ``name`` is built for (a class says so with a ``task`` attribute; classification otherwise)."""
    return getattr(MODELS[name][0], "task", CLASSIFICATION)


def build_model(name: str, config: Mapping[str, Any] | None = None, **inputs: Any) -> nn.Module:
    """Build model ``name`` for the data's sizes: ``in_channels``, ``num_classes`` and ``input_size`` (h, w) of
    images, or a language model's ``vocab_size``.

    A model class that lists ``options`` takes those keys from its model ``config`` (the ImageNet ResNets' ``stem``).
    """
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r} (choose from: {', '.join(sorted(MODELS))})")
    cls, make = MODELS[name]
    if "input_size" in inputs:
        h, w = inputs["input_size"]
        if h != w:
            raise ConfigError(f"model {name} takes square inputs, got {h}x{w}")
        if h < cls.min_input_size:
            raise ConfigError(f"input {inputs['in_channels']}x{h}x{w} is too small for model {name}: it needs at least "
                              f"{cls.min_input_size}x{cls.min_input_size}")
        inputs = {**inputs, "input_size": h}
    options = {key: (config or {})[key] for key in getattr(cls, "options", ()) if key in (config or {})}
    return make(**inputs, **options)
