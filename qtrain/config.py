"""Config checks that run before any work: one-line errors naming the bad value and what is allowed.

Group choices on the command line (``method=...``, ``model=...``) are checked against the files in
``conf/`` before Hydra composes anything, so an unknown name gets one line, not a traceback.
Method-specific values are checked by each method's constructor.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from qtrain.errors import ConfigError

GROUPS = ("method", "model", "data", "optim", "sched", "experiment")


def group_options(conf_dir: Path, group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def check_overrides(args: list[str], conf_dir: Path) -> None:
    """Raise ConfigError for a ``group=choice`` argument whose choice has no config file."""
    for arg in args:
        key, sep, value = arg.partition("=")
        group = key.lstrip("+~")
        if not sep or group not in GROUPS or any(c in value for c in "()${}[]*"):
            continue
        options = group_options(conf_dir, group)
        for choice in value.split(","):
            if choice not in options and not (group == "experiment" and choice == "null"):
                raise ConfigError(f"unknown {group} {choice!r} (choose from: {', '.join(options)})")


def _require_int(cfg: DictConfig, key: str, low: int) -> None:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key}={value!r} is not allowed: it must be an integer >= {low}")


def validate(cfg: DictConfig) -> None:
    """Check the run-level values (training length, batch sizes, device, seed, data root)."""
    _require_int(cfg, "train.epochs", 0)
    _require_int(cfg, "train.batch_size", 1)
    _require_int(cfg, "train.eval_batch_size", 1)
    _require_int(cfg, "train.accum_steps", 1)
    _require_int(cfg, "seed", 0)
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={cfg.device!r} is not allowed (choose from: auto, cpu, cuda)")
    if "root" in cfg.data and OmegaConf.is_missing(cfg.data, "root"):
        raise ConfigError(f"data.root is not set: pass data.root=DIR, the folder that holds the {cfg.data.name} files")
    augment = cfg.data.augment
    if isinstance(augment.crop_padding, bool) or not isinstance(augment.crop_padding, int) or augment.crop_padding < 0:
        raise ConfigError(f"data.augment.crop_padding={augment.crop_padding!r} is not allowed: it must be an integer >= 0")
