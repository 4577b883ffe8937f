"""The checks of a composed config's run-level values (training length, batch sizes, device, data, optimizer,
schedule), made before any work; a method's own values are checked by its constructor."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from qtrain.config.command_line import group_options
from qtrain.config.identity import INSTANTIATION_KEYS
from qtrain.data.registry import Kind, dataset
from qtrain.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
TEXT_LEVELS = ("word", "char")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require_int(cfg: DictConfig, key: str, low: int) -> None:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key}={value!r} is not allowed: it must be an integer >= {low}")


def _require_number(cfg: DictConfig, key: str, low: float, high: float = math.inf, *,
                    low_open: bool = False, high_open: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    if not _is_number(value) or value < low or value > high or (low_open and value == low) or (high_open and value == high):
        if high == math.inf:
            allowed = f"> {low:g}" if low_open else f">= {low:g}"
        else:
            allowed = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigError(f"{key}={value!r} is not allowed: it must be a finite number {allowed}")


def _require_bool(cfg: DictConfig, key: str) -> None:
    value = OmegaConf.select(cfg, key)
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} is not allowed: it must be true or false")


def _validate_data(cfg: DictConfig) -> None:
    data = cfg.data
    entry = dataset(data.name)
    if entry.needs_root:  # scale=smoke turns a file dataset into its stand-in (no files), root and all
        if OmegaConf.is_missing(data, "root"):
            raise ConfigError(f"data.root is not set: pass data.root=DIR, the folder that holds the {data.name} files")
        if not isinstance(data.root, str) or not Path(data.root).expanduser().is_dir():
            raise ConfigError(f"data.root={data.root!r} is not allowed: it must be the folder that holds the "
                              f"{data.name} files")
    if entry.kind is Kind.TEXT:
        if data.level not in TEXT_LEVELS:
            raise ConfigError(f"data.level={data.level!r} is not allowed (choose from: {', '.join(TEXT_LEVELS)})")
        _require_int(cfg, "data.min_count", 1)
    else:
        _validate_images(cfg, entry.kind)
    sample = data.sample
    if sample is not None and (not isinstance(sample, DictConfig) or not sample.keys()
                               or not set(sample.keys()) <= {"train", "test"}
                               or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sample.values())):
        shown = OmegaConf.to_container(sample) if isinstance(sample, DictConfig) else sample
        raise ConfigError(f"data.sample={shown} is not allowed: {{train: N, test: M}} with integers >= 1 (a split left "
                          "out is taken whole), or null")


def _validate_images(cfg: DictConfig, kind: Kind) -> None:
    data = cfg.data
    if kind is Kind.SYNTHETIC:
        for key, low in (("n_train", 1), ("n_test", 1), ("num_classes", 2), ("channels", 1), ("size", 1), ("seed", 0)):
            _require_int(cfg, f"data.{key}", low)
    if kind is Kind.FOLDER:
        _validate_folder(cfg)
    else:
        _require_int(cfg, "data.augment.crop_padding", 0)
        _require_bool(cfg, "data.augment.flip")
    subset = data.subset
    if subset is not None and (not isinstance(subset, DictConfig) or set(subset.keys()) != {"by", "part"}
                               or subset.by not in ("classes", "samples") or subset.part not in (0, 1)):
        shown = OmegaConf.to_container(subset) if isinstance(subset, DictConfig) else subset
        raise ConfigError(f"data.subset={shown} is not allowed: {{by: classes|samples, part: 0|1}} or null")
    _require_int(cfg, "data.folds", 2)
    fold = data.fold
    if fold is not None and (isinstance(fold, bool) or not isinstance(fold, int) or not 0 <= fold < data.folds):
        raise ConfigError(f"data.fold={fold!r} is not allowed: an integer from 0 to data.folds - 1 = {data.folds - 1}, "
                          "or null (the whole training split)")


def _validate_folder(cfg: DictConfig) -> None:
    _require_int(cfg, "data.image_size", 1)
    _require_int(cfg, "data.workers", 0)
    for key, low in (("mean", -math.inf), ("std", 0.0)):
        values = cfg.data[key]
        if not isinstance(values, ListConfig) or len(values) != 3 or not all(_is_number(v) and v > low for v in values):
            bound = " > 0" if low == 0 else ""
            raise ConfigError(f"data.{key}={_plain(values)!r} is not allowed: it must be a list of 3 numbers{bound}, "
                              "one per RGB channel")


def _require_own_file(cfg: DictConfig, group: str, what: str) -> None:
    """``<group>.name`` names a file of ``conf/<group>/``, and the group's Hydra instantiation keys are that file's."""
    from qtrain.cli import conf_dir

    name = cfg[group].name
    options = group_options(conf_dir(), group)
    if name not in options:
        raise ConfigError(f"unknown {what} {name!r} (choose from: {', '.join(options)})")
    own = OmegaConf.load(conf_dir() / group / f"{name}.yaml")
    for key in INSTANTIATION_KEYS:
        value, allowed = OmegaConf.select(cfg, f"{group}.{key}"), own.get(key)
        if value != allowed:
            raise ConfigError(f"{group}.{key}={value!r} is not allowed: {group}={name} is built by its file's "
                              f"{key} ({allowed}), since the run's identity holds the name (choose another {group}=NAME)")


def _validate_optim(cfg: DictConfig) -> None:
    _require_own_file(cfg, "optim", "optimizer")
    _require_number(cfg, "optim.lr", 0, low_open=True)
    _require_number(cfg, "optim.weight_decay", 0)
    if cfg.optim.name == "sgd":
        _require_number(cfg, "optim.momentum", 0, 1, high_open=True)
        _require_bool(cfg, "optim.nesterov")
        if cfg.optim.nesterov and cfg.optim.momentum == 0:
            raise ConfigError("optim.nesterov=true is not allowed with optim.momentum=0: Nesterov needs momentum")
    else:
        betas = cfg.optim.betas
        if not isinstance(betas, ListConfig) or len(betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in betas):
            raise ConfigError(f"optim.betas={_plain(betas)!r} is not allowed: it must be two numbers in [0, 1)")
        _require_number(cfg, "optim.eps", 0, low_open=True)


def _validate_sched(cfg: DictConfig) -> None:
    _require_own_file(cfg, "sched", "schedule")
    name = cfg.sched.name
    if name == "multistep":
        milestones = cfg.sched.milestones
        if not isinstance(milestones, ListConfig) or any(isinstance(m, bool) or not isinstance(m, int) or m < 1
                                                         for m in milestones):
            raise ConfigError(f"sched.milestones={_plain(milestones)!r} is not allowed: it must be a list of epochs >= 1")
        _require_number(cfg, "sched.gamma", 0, low_open=True)
    if name in ("cosine", "plateau"):
        _require_number(cfg, "sched.min_lr", 0)
    if name == "plateau":
        _require_number(cfg, "sched.factor", 0, 1, low_open=True, high_open=True)
        _require_int(cfg, "sched.patience", 0)
        _require_number(cfg, "sched.threshold", 0)
    if name == "inverse_sqrt":
        _require_int(cfg, "sched.warmup_steps", 1)
    else:
        _require_int(cfg, "sched.warmup_epochs", 0)


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if isinstance(value, (ListConfig, DictConfig)) else value


def validate(cfg: DictConfig) -> None:
    """Check the run-level values (training length, batch sizes, device, seed, data, optimizer, schedule)."""
    _require_int(cfg, "train.epochs", 1)
    _require_int(cfg, "train.batch_size", 1)
    _require_int(cfg, "train.eval_batch_size", 1)
    _require_int(cfg, "train.accum_steps", 1)
    if cfg.train.batches_per_epoch is not None:
        _require_int(cfg, "train.batches_per_epoch", 1)
    _require_int(cfg, "seed", 0)
    for key in ("force", "progress", "fused"):
        _require_bool(cfg, key)
    if cfg.device not in DEVICES:
        raise ConfigError(f"device={cfg.device!r} is not allowed (choose from: {', '.join(DEVICES)})")
    init_from = cfg.train.init_from
    if init_from is not None and (not isinstance(init_from, str) or not init_from):
        raise ConfigError(f"train.init_from={init_from!r} is not allowed: it must be a finished run's directory or null")
    _validate_data(cfg)
    _validate_optim(cfg)
    _validate_sched(cfg)
    if cfg.hardware.target_acc is not None:
        _require_number(cfg, "hardware.target_acc", 0, 1, low_open=True)
