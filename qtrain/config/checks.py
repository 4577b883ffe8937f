"""The checks of a composed config's values (training length, batch sizes, device, data, optimizer, schedule, the
model's and the method's own values), made before any work."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from qtrain.config import schema
from qtrain.config.command_line import group_options
from qtrain.config.identity import INSTANTIATION_KEYS
from qtrain.config.methods import check_method
from qtrain.config.models import check_model
from qtrain.data.registry import dataset
from qtrain.errors import ConfigError
from qtrain.resources import conf_dir


def _check_root(data: DictConfig) -> None:
    """A dataset read from files names the folder that holds them (scale=smoke's stand-ins read none)."""
    if OmegaConf.is_missing(data, "root"):
        raise ConfigError(f"data.root is not set: pass data.root=DIR, the folder that holds the {data.name} files")
    if not isinstance(data.root, str) or not Path(data.root).expanduser().is_dir():
        raise ConfigError(f"data.root={data.root!r} is not allowed: it must be the folder that holds the {data.name} files")


def _require_option(cfg: DictConfig, group: str, what: str) -> str:
    """``<group>.name``, which must name a file of ``conf/<group>/``."""
    name = cfg[group].name
    options = group_options(conf_dir(), group)
    if name not in options:
        raise ConfigError(f"unknown {what} {name!r} (choose from: {', '.join(options)})")
    return name


def _require_own_file(cfg: DictConfig, group: str, what: str) -> None:
    """``<group>.name`` names a file of ``conf/<group>/``, and the group's Hydra instantiation keys are that file's."""
    name = _require_option(cfg, group, what)
    own = OmegaConf.load(conf_dir() / group / f"{name}.yaml")
    for key in INSTANTIATION_KEYS:
        value, allowed = OmegaConf.select(cfg, f"{group}.{key}"), own.get(key)
        if value != allowed:
            raise ConfigError(f"{group}.{key}={value!r} is not allowed: {group}={name} is built by its file's "
                              f"{key} ({allowed}), since the run's identity holds the name (choose another {group}=NAME)")


def _steps_per_epoch_at_most(cfg: DictConfig) -> int | None:
    """A bound on an epoch's optimizer steps from the config alone, where it fixes one: ``train.batches_per_epoch``
    batches, or a pass over a training split of known size (a sample's, a synthetic set's, a release's; halves,
    folds and ranks train on fewer)."""
    batches = cfg.train.batches_per_epoch
    if batches is None:
        sample = OmegaConf.select(cfg, "data.sample.train")
        images = sample if sample is not None else OmegaConf.select(cfg, "data.n_train")
        images = images if images is not None else dataset(cfg.data.name).train_images
        if images is None:
            return None
        batches = -(-images // cfg.train.batch_size)
    return -(-batches // cfg.train.accum_steps)


def validate(cfg: DictConfig) -> None:
    """Check the run-level values (training length, batch sizes, device, seed, data, optimizer, schedule), the
    model's and the method's (against their schemas in :mod:`qtrain.config.models` and :mod:`qtrain.config.methods`)."""
    schema.read(schema.Train, cfg.train, "train")
    schema.read(schema.TopLevel, cfg)
    entry = dataset(cfg.data.name)
    if entry.needs_root:
        _check_root(cfg.data)
    schema.read(schema.DATA[entry.kind], cfg.data, "data")
    _require_own_file(cfg, "optim", "optimizer")
    schema.read(schema.OPTIMIZERS[cfg.optim.name], cfg.optim, "optim")
    _require_own_file(cfg, "sched", "schedule")
    schema.read(schema.SCHEDULES[cfg.sched.name], cfg.sched, "sched")
    if cfg.sched.name == "plateau" and cfg.train.eval_every > 1:
        raise ConfigError(f"train.eval_every={cfg.train.eval_every} is not allowed with sched=plateau: it steps on "
                          "every epoch's test loss (use train.eval_every=1, or another schedule)")
    schema.read(schema.Hardware, cfg.hardware, "hardware")
    _require_option(cfg, "model", "model")
    check_model(cfg.model)
    method = check_method(cfg.method)
    steps_per_epoch = _steps_per_epoch_at_most(cfg)
    if steps_per_epoch is not None:
        method.check_steps_per_epoch(steps_per_epoch, exact=False)
