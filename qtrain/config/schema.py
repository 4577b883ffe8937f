"""Typed schemas of the run-level config groups (top-level keys, train, hardware, data by kind, optim and sched by
name): a dataclass per group, its keys' types read by :func:`read` (bool, int, float, :data:`Bits`, lists of them,
Enums, nested schemas), their ranges in field metadata (:func:`bounded`), the checks across keys in ``__post_init__``.
Each failure is a ConfigError naming the key, its value and what is allowed. Imports no torch."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from qtrain.data.registry import Kind
from qtrain.errors import ConfigError


@dataclass(frozen=True)
class Bounds:
    """The range of a number: [low, high], either end open."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        return (self.low < value or (not self.low_open and value == self.low)) and (
            value < self.high or (not self.high_open and value == self.high))

    def __str__(self) -> str:
        low, high = _number_text(self.low), _number_text(self.high)
        if self.high == math.inf:
            return f"> {low}" if self.low_open else f">= {low}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


def _number_text(value: float) -> str:
    """A bound as a reader types it: a whole number in full (2147483647, not 2.14748e+09), others as %g."""
    return str(int(value)) if math.isfinite(value) and value == int(value) and abs(value) < 1e15 else f"{value:g}"


def bounded(low: float = -math.inf, high: float = math.inf, *, low_open: bool = False, high_open: bool = False) -> Any:
    """A field whose number must lie in the range."""
    return field(metadata={"bounds": Bounds(low, high, low_open, high_open)})


def is_integer(value: Any) -> bool:
    """An int that is not a bool (True is an int to Python, not to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite real number: an int or float that is not a bool (nor inf or NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


Bits = typing.NewType("Bits", int)  # a bit-width: an integer in [1, 32], or in the range bounded() gives
BIT_WIDTHS = Bounds(1, 32)
_NOUNS = {int: ("an integer", "integers"), float: ("a finite number", "finite numbers")}


def _fits(value: Any, kind: Any, bounds: Bounds | None) -> bool:
    """Whether ``value`` is of the scalar annotation ``kind`` (bool, int, float, Bits; anything for Any) in ``bounds``."""
    if kind is bool:
        return isinstance(value, bool)
    if kind is Bits:
        return is_integer(value) and value in (bounds or BIT_WIDTHS)
    if kind in _NOUNS:
        return (is_integer if kind is int else is_number)(value) and (bounds is None or value in bounds)
    return True


def _allowed(kind: Any, bounds: Bounds | None, listed: bool = False) -> str:
    """What a value of the scalar annotation ``kind`` (or, ``listed``, a list of them) may be."""
    if kind is bool:
        return "it must be true or false"
    if kind is Bits:
        bounds = bounds or BIT_WIDTHS
        return f"bit-widths are integers from {bounds.low:g} to {bounds.high:g}"
    return f"it must be {'a list of ' if listed else ''}{_NOUNS[kind][listed]}{'' if bounds is None else f' {bounds}'}"


def not_allowed(key: str, value: Any, allowed: str) -> ConfigError:
    shown = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
    return ConfigError(f"{key}={shown!r} is not allowed: {allowed}")


def _typed(key: str, value: Any, kind: Any, bounds: Bounds | None) -> Any:
    """``value`` checked against the annotation ``kind`` (and ``bounds``): an Enum member for an Enum."""
    or_null = ""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if value is None:
            return None
        (kind,), or_null = [k for k in typing.get_args(kind) if k is not type(None)], " or null"
    if dataclasses.is_dataclass(kind):
        return read(kind, value, key)
    if isinstance(kind, type) and issubclass(kind, Enum):
        choices = [member.value for member in kind]
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not allowed (choose from: {', '.join(choices)})")
        return kind(value)
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        if not isinstance(value, (list, ListConfig)) or not all(_fits(v, item, bounds) for v in value):
            raise not_allowed(key, value, _allowed(item, bounds, listed=True) + or_null)
    elif not _fits(value, kind, bounds):
        raise not_allowed(key, value, _allowed(kind, bounds) + or_null)
    return value  # Any: checked by the schema's __post_init__


def read(schema: type, node: DictConfig, prefix: str = "") -> Any:
    """The ``schema`` dataclass made of ``node``'s keys (other keys of the node are not the schema's to check)."""
    if not isinstance(node, DictConfig):
        raise not_allowed(prefix, node, "it must be a mapping")
    kinds = typing.get_type_hints(schema)
    values = {}
    for item in dataclasses.fields(schema):
        key = f"{prefix}.{item.name}" if prefix else item.name
        values[item.name] = _typed(key, node.get(item.name), kinds[item.name], item.metadata.get("bounds"))
    return schema(**values)


class Device(Enum):
    AUTO = "auto"  # cuda when available
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True)
class TopLevel:
    seed: int = bounded(0, 2**31 - 1)  # numpy's legacy seeding takes below 2^32, and ranks add 1,000,003 each
    device: Device
    force: bool
    progress: bool
    fused: bool


@dataclass(frozen=True)
class Train:
    epochs: int = bounded(1)
    batch_size: int = bounded(1)
    eval_batch_size: int = bounded(1)
    accum_steps: int = bounded(1)
    batches_per_epoch: int | None = bounded(1)
    eval_every: int = bounded(1)
    init_from: Any

    def __post_init__(self) -> None:
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise not_allowed("train.init_from", self.init_from, "it must be a finished run's directory or null")


@dataclass(frozen=True)
class Hardware:
    target_acc: float | None = bounded(0, 1, low_open=True)


# ---- data, by the dataset's kind (qtrain.data.registry) ----

class TextLevel(Enum):
    WORD = "word"
    CHAR = "char"


@dataclass(frozen=True)
class Sampled:
    sample: Any  # {train: N, test: M} or null

    def __post_init__(self) -> None:
        sample = self.sample
        if sample is not None and (not isinstance(sample, DictConfig) or not sample.keys()
                                   or not set(sample.keys()) <= {"train", "test"}
                                   or any(not is_integer(n) or n < 1 for n in sample.values())):
            raise not_allowed("data.sample", sample, "{train: N, test: M} with integers >= 1 (a split left out is "
                              "taken whole), or null")


@dataclass(frozen=True)
class TextCorpus(Sampled):
    level: TextLevel
    min_count: int = bounded(1)


@dataclass(frozen=True)
class Images(Sampled):
    """Images held in memory or read from folders: a half of them, a sample, a cross-validation fold."""

    subset: Any  # {by: classes|samples, part: 0|1} or null
    folds: int = bounded(2)
    fold: Any  # 0 .. folds - 1, or null

    def __post_init__(self) -> None:
        super().__post_init__()
        subset = self.subset
        if subset is not None and (not isinstance(subset, DictConfig) or set(subset.keys()) != {"by", "part"}
                                   or subset.by not in ("classes", "samples") or subset.part not in (0, 1)):
            raise not_allowed("data.subset", subset, "{by: classes|samples, part: 0|1} or null")
        if self.fold is not None and (not is_integer(self.fold) or not 0 <= self.fold < self.folds):
            raise not_allowed("data.fold", self.fold, f"an integer from 0 to data.folds - 1 = {self.folds - 1}, or "
                              "null (the whole training split)")


@dataclass(frozen=True)
class Augment:
    crop_padding: int = bounded(0)
    flip: bool


@dataclass(frozen=True)
class ArrayImages(Images):
    augment: Augment


@dataclass(frozen=True)
class SyntheticImages(ArrayImages):
    n_train: int = bounded(1)
    n_test: int = bounded(1)
    num_classes: int = bounded(2)
    channels: int = bounded(1)
    size: int = bounded(1)
    seed: int = bounded(0)


@dataclass(frozen=True)
class FolderImages(Images):
    """An image tree: torchvision's transforms stand in for data.augment."""

    image_size: int = bounded(1)
    workers: int = bounded(0)
    mean: Any
    std: Any

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, low in (("mean", -math.inf), ("std", 0.0)):
            values = getattr(self, key)
            if not isinstance(values, ListConfig) or len(values) != 3 or not all(is_number(v) and v > low for v in values):
                bound = " > 0" if low == 0 else ""
                raise not_allowed(f"data.{key}", values, f"it must be a list of 3 numbers{bound}, one per RGB channel")


DATA: dict[Kind, type] = {Kind.IMAGES: ArrayImages, Kind.SYNTHETIC: SyntheticImages, Kind.FOLDER: FolderImages,
                          Kind.TEXT: TextCorpus}


# ---- the optimizer and schedule, by name (conf/optim/<name>.yaml, conf/sched/<name>.yaml) ----

@dataclass(frozen=True)
class Optimizer:
    lr: float = bounded(0, low_open=True)
    weight_decay: float = bounded(0)


@dataclass(frozen=True)
class SGD(Optimizer):
    momentum: float = bounded(0, 1, high_open=True)
    nesterov: bool

    def __post_init__(self) -> None:
        if self.nesterov and self.momentum == 0:
            raise ConfigError("optim.nesterov=true is not allowed with optim.momentum=0: Nesterov needs momentum")


@dataclass(frozen=True)
class Adam(Optimizer):
    betas: Any
    eps: float = bounded(0, low_open=True)

    def __post_init__(self) -> None:
        betas = self.betas
        if not isinstance(betas, ListConfig) or len(betas) != 2 or not all(is_number(b) and 0 <= b < 1 for b in betas):
            raise not_allowed("optim.betas", betas, "it must be two numbers in [0, 1)")


@dataclass(frozen=True)
class EpochSchedule:
    warmup_epochs: int = bounded(0)


@dataclass(frozen=True)
class MultiStep(EpochSchedule):
    milestones: Any
    gamma: float = bounded(0, low_open=True)

    def __post_init__(self) -> None:
        milestones = self.milestones
        if not isinstance(milestones, ListConfig) or any(not is_integer(m) or m < 1 for m in milestones):
            raise not_allowed("sched.milestones", milestones, "it must be a list of epochs >= 1")
        if any(a >= b for a, b in zip(milestones, milestones[1:])):  # torch would count a repeated one twice
            raise not_allowed("sched.milestones", milestones, "its epochs must increase")


@dataclass(frozen=True)
class Cosine(EpochSchedule):
    min_lr: float = bounded(0)


@dataclass(frozen=True)
class Plateau(Cosine):
    factor: float = bounded(0, 1, low_open=True, high_open=True)
    patience: int = bounded(0)
    threshold: float = bounded(0)


@dataclass(frozen=True)
class InverseSqrt:
    warmup_steps: int = bounded(1)


OPTIMIZERS: dict[str, type] = {"sgd": SGD, "adam": Adam}
SCHEDULES: dict[str, type] = {"constant": EpochSchedule, "multistep": MultiStep, "cosine": Cosine, "plateau": Plateau,
                              "inverse_sqrt": InverseSqrt}
