"""Model registry (timm's style): a name in the config builds the model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from torch import nn

from qtrain.errors import ConfigError
from qtrain.models.alexnet import AlexNetCIFAR
from qtrain.models.mobilenetv2 import MobileNetV2CIFAR
from qtrain.models.resnet import ResNet18
from qtrain.models.resnet_cifar import ResNetCIFAR

MODELS: dict[str, tuple[type[nn.Module], Callable[..., nn.Module]]] = {
    "resnet20": (ResNetCIFAR, partial(ResNetCIFAR, 20)),
    "resnet38": (ResNetCIFAR, partial(ResNetCIFAR, 38)),
    "resnet74": (ResNetCIFAR, partial(ResNetCIFAR, 74)),
    "resnet18": (ResNet18, ResNet18),
    "alexnet": (AlexNetCIFAR, AlexNetCIFAR),
    "mobilenetv2": (MobileNetV2CIFAR, MobileNetV2CIFAR),
}


def build_model(name: str, in_channels: int, num_classes: int, input_size: tuple[int, int],
                config: Mapping[str, Any] | None = None) -> nn.Module:
    """Build model ``name`` for ``in_channels`` x ``input_size`` images of ``num_classes`` classes.

    A model class that lists ``options`` takes those keys from its model ``config`` (ResNet-18's ``stem``).
    """
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r} (choose from: {', '.join(sorted(MODELS))})")
    cls, make = MODELS[name]
    h, w = input_size
    if h != w:
        raise ConfigError(f"model {name} takes square inputs, got {h}x{w}")
    if h < cls.min_input_size:
        raise ConfigError(f"input {in_channels}x{h}x{w} is too small for model {name}: it needs at least "
                          f"{cls.min_input_size}x{cls.min_input_size}")
    options = {key: (config or {})[key] for key in getattr(cls, "options", ()) if key in (config or {})}
    return make(in_channels=in_channels, num_classes=num_classes, input_size=h, **options)


def check_model_config(config: Mapping[str, Any]) -> None:
    """The model config's own keys, checked by its class where it has any (before any data is loaded)."""
    cls, _ = MODELS[config["name"]]
    check = getattr(cls, "check", None)
    if check is not None:
        check(config)
