"""Config checks that run before any work, and a run's identity.

Checks give one-line errors naming the bad value and what is allowed:

- :func:`check_command_line` reads the command line before Hydra composes anything: group choices
  (``method=...``) must name a file in ``conf/``; every ``key=value`` must name a key of the composed
  config (an unknown key gets the nearest valid one), and its value must have the type of the key's
  default; ``+key`` and ``~key`` are refused, since nothing in qtrain reads a key its config files lack;
  a key given twice is refused (Hydra would keep the last silently).
  ``hydra/launcher=...`` must name a launcher, and ``hydra.launcher.KEY=...`` one of its keys.
- :func:`validate` checks the run-level values of a composed config (training length, batch sizes,
  device, data, optimizer, schedule). Method-specific values are checked by each method's constructor.

A run's identity (:func:`identity`) is its whole resolved config minus :data:`NOT_IDENTITY`, the keys
that cannot change its results, plus ``world_size`` where torchrun starts more than one process
(BatchNorm statistics and activation ranges are per process), and ``data.python``, the Python release,
for ``data=text`` (its corpus is that release's documentation); its digest names the run directory and
guards resumes (``run.py``), so a run never resumes under another world size.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import itertools
import json
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from qtrain import distributed
from qtrain.data.registry import Kind, dataset
from qtrain.errors import ConfigError

GROUPS = ("method", "model", "data", "optim", "sched", "experiment", "scale")
LAUNCHER = "hydra/launcher"  # Hydra's group of launchers: conf/hydra/launcher/ adds qtrain's (parallel, slurm)
DEVICES = ("auto", "cpu", "cuda")
TEXT_LEVELS = ("word", "char")
INSTANTIATION_KEYS = ("_target_", "_partial_")  # Hydra's, in conf/optim and conf/sched


@dataclass(frozen=True)
class RunKey:
    """What a key is to a run. A key not in :data:`RUN_KEYS` is in the identity, names the run directory where the
    command line sets it, and makes runs different configurations in qtrain-report's tables."""

    identity: bool = True  # in the run's identity: its directory's id= digest and the guard of a resume
    path: bool = False  # made absolute in the identity: one folder named from two working directories is one run
    names_dir: bool = True  # an override of it is part of the run directory's name (hydra.job.override_dirname)
    configuration: bool = True  # runs that differ in it are different configurations (rows) in qtrain-report


_PLUMBING = RunKey(identity=False, names_dir=False, configuration=False)
# The keys that do not define a run, or not wholly. Everything else is the run's identity, ``device`` (CPU and GPU
# kernels round differently) and ``fused`` (compiled kernels reorder float reductions) included.
RUN_KEYS: dict[str, RunKey] = {
    "force": _PLUMBING,  # whether to start over
    "progress": _PLUMBING,  # progress bars on the terminal
    # Hydra's instantiation keys: the identity holds the optimizer's and schedule's name, and validate() holds
    # these to the named file's
    **{f"{group}.{key}": _PLUMBING for group in ("optim", "sched") for key in INSTANTIATION_KEYS},
    "hydra.run.dir": _PLUMBING, "hydra.sweep.dir": _PLUMBING, "hydra.sweep.subdir": _PLUMBING,  # where, not what
    "data.root": RunKey(path=True, names_dir=False, configuration=False),  # the data is the dataset's, wherever it is
    "train.init_from": RunKey(path=True, names_dir=False, configuration=False),
    "seed": RunKey(configuration=False),  # a row averages its seeds
    "data.fold": RunKey(configuration=False),  # and its cross-validation folds
    "device": RunKey(configuration=False),
}
NOT_IDENTITY = tuple(key for key, role in RUN_KEYS.items() if not role.identity)
PATH_KEYS = tuple(key for key, role in RUN_KEYS.items() if role.path)
NOT_IN_DIR_NAME = tuple(key for key, role in RUN_KEYS.items() if not role.names_dir)
NOT_CONFIGURATION = tuple(key for key, role in RUN_KEYS.items() if not role.configuration)
# The longest part of a run directory's name taken from its overrides (whole key=value items; the id follows).
NAME_LENGTH = 120
# Combinations of group choices whose composed configs the command-line check reads (a sweep may name more).
MAX_COMPOSED = 16


def group_options(conf_dir: Path, group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def _parse(overrides: list[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed.extend(parser.parse_overrides([text]))
        except HydraException as err:
            lines = [line for line in str(err).splitlines() if not line.startswith(("See ", "Error parsing override"))]
            reason = lines[0].strip() if lines else "not Hydra's override syntax"
            if "=" not in text and parsed:  # the shell split a value at a space: its tail came as a word of its own
                reason += f" (a value with spaces must be quoted: {parsed[-1].input_line.partition('=')[0]}=\"... {text}\")"
            raise ConfigError(f"cannot read the override {text!r}: {reason}") from None
    return parsed


def _values(override: Any) -> list[Any]:
    """The values an override sets: one, or each of a sweep's (an interval sweep gives none to check)."""
    if not override.is_sweep_override():
        return [override.value()]
    if override.is_discrete_sweep() and override.value_type.name != "GLOB_CHOICE_SWEEP":
        return list(override.sweep_iterator())
    return []


def sweep_size(overrides: list[str]) -> int | None:
    """How many jobs Hydra's basic sweeper makes of ``overrides`` (every combination), or None where a sweep's
    values are Hydra's to expand (a glob or an interval)."""
    size = 1
    for override in _parse(overrides):
        if override.is_sweep_override():
            values = _values(override)
            if not values:
                return None
            size *= len(values)
    return size


def swept_keys(overrides: list[str]) -> set[str]:
    """The keys (and groups) a sweep's command line gives several values."""
    return {override.key_or_group for override in _parse(overrides) if override.is_sweep_override()}


def _is_group(override: Any) -> bool:
    return override.key_or_group in GROUPS and override.package is None


def _compose(conf_dir: Path, choices: list[str], with_hydra: bool = False) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return compose(config_name="config", overrides=choices, return_hydra_config=with_hydra)


def _has_key(cfg: DictConfig, key: str) -> bool:
    node: Any = cfg
    for part in key.split("."):
        if isinstance(node, DictConfig) and part in node.keys():
            node = node._get_node(part)
        elif isinstance(node, ListConfig) and part.isdigit() and int(part) < len(node):
            node = node._get_node(int(part))
        else:
            return False
    return True


def _unknown_key(key: str, cfg: DictConfig, what: str) -> ConfigError:
    """``what`` and a hint: the nearest key where the path leaves the config, else the keys that are there."""
    node: Any = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, DictConfig) and part in node.keys():
            node = node._get_node(part)
            continue
        where = ".".join(parts[:i]) or "the config"
        siblings = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
        nearest = difflib.get_close_matches(part, siblings, n=1, cutoff=0.6)
        if nearest:
            hint = f"did you mean {'.'.join([*parts[:i], nearest[0], *parts[i + 1:]])}?"
        else:
            hint = f"{where} has: {', '.join(siblings)}" if siblings else f"{where} holds no keys"
        return ConfigError(f"{what} ({hint})")
    return ConfigError(what)


_KINDS = (  # (type of the default, types a new value may have, what to call them)
    (bool, (bool,), "true or false"),
    (int, (int,), "an integer"),
    (float, (int, float), "a number"),
    (str, (str,), "a string"),
    (list, (list,), "a list"),
    (dict, (dict,), "a mapping"),
)


def _check_type(key: str, default: Any, value: Any) -> None:
    if default is None or default == "???" or (isinstance(value, str) and "${" in value):
        return  # no default to compare with, or an interpolation resolved later
    if isinstance(default, (ListConfig, DictConfig)):
        default = OmegaConf.to_container(default)
    for kind, allowed, name in _KINDS:
        if isinstance(default, kind):
            if value is not None and (not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool))):
                raise ConfigError(f"{key}={value!r} is not allowed: it must be {name}")
            return


def _check_key(cfg: DictConfig, override: Any, what: str = "") -> None:
    key = override.key_or_group
    if not _has_key(cfg, key):
        raise _unknown_key(key, cfg, f"unknown key {key}{what}")
    default = OmegaConf.select(cfg, key, throw_on_missing=False)
    for value in _values(override):
        _check_type(key, default, value)


def launcher_options(conf_dir: Path) -> list[str]:
    """What ``hydra/launcher=NAME`` may name: qtrain's launchers (``conf/hydra/launcher/``) and Hydra's installed ones."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # discovering Hydra's plugins imports them, and they store their launchers' configs
    stored = (name.removesuffix(".yaml") for name in ConfigStore.instance().list(LAUNCHER))
    return sorted({*group_options(conf_dir, LAUNCHER), *stored})


def _check_launcher(overrides: list[Any], conf_dir: Path) -> None:
    """``hydra/launcher=NAME`` names a launcher; ``hydra.launcher.KEY=VALUE`` one of its keys, with a value of its type.

    Deeper keys, ``+`` and ``~`` are Hydra's to check (``hydra.launcher.additional_parameters`` takes any key).
    """
    choices = [o for o in overrides if o.key_or_group == LAUNCHER]
    if choices:
        options = launcher_options(conf_dir)
        for name in (name for o in choices for name in _values(o)):
            if name not in options:
                raise ConfigError(f"unknown launcher {name!r} (choose from: {', '.join(options)})")
    keys = [o for o in overrides if o.key_or_group.startswith("hydra.launcher.") and o.key_or_group.count(".") == 2
            and not (o.is_add() or o.is_delete())]
    if keys:
        cfg = _compose(conf_dir, [o.input_line for o in choices], with_hydra=True)
        for override in keys:
            _check_key(cfg, override, f" of hydra/launcher={cfg.hydra.runtime.choices[LAUNCHER]}")


def check_command_line(overrides: list[str], conf_dir: Path, multirun: bool) -> None:
    """Raise ConfigError for an override that names no group choice or key, or gives a value of the wrong type."""
    everything = _parse(overrides)
    seen: dict[str, str] = {}
    for override in everything:
        key, text = override.key_or_group, override.input_line or override.key_or_group
        if key in seen:
            raise ConfigError(f"{key} is given twice ({seen[key]}, {text}): give it once")
        seen[key] = text
    _check_launcher([o for o in everything if o.is_hydra_override()], conf_dir)
    parsed = [o for o in everything if not o.is_hydra_override()]
    for override in parsed:
        text = override.input_line or override.key_or_group
        if override.is_sweep_override() and not multirun:
            raise ConfigError(f"{text} is a sweep: add -m (--multirun) to run one job per value")
        if not _is_group(override):
            continue
        if override.is_delete() or override.is_add():
            raise ConfigError(f"{text} is not allowed: pick one with {override.key_or_group}=NAME")
        options = group_options(conf_dir, override.key_or_group)
        for choice in _values(override):
            if choice not in options and not (override.key_or_group == "experiment" and choice is None):
                raise ConfigError(f"unknown {override.key_or_group} {choice!r} (choose from: {', '.join(options)})")
    choices = [[f"{o.key_or_group}={'null' if v is None else v}" for v in _values(o)] for o in parsed
               if _is_group(o) and _values(o)]  # a glob sweep's choices are Hydra's to expand: the default stands in
    keys = [o for o in parsed if not _is_group(o)]
    if not keys:
        return
    configs = [_compose(conf_dir, list(combo)) for combo in itertools.islice(itertools.product(*choices), MAX_COMPOSED)]
    for override in keys:
        key, text = override.key_or_group, override.input_line or override.key_or_group
        if override.is_add():
            if all(_has_key(cfg, key) for cfg in configs):
                raise ConfigError(f"{text} is not allowed: {key} is set already (drop the +)")
            raise _unknown_key(key, configs[0], f"{text} is not allowed: nothing reads {key}")
        if override.is_delete():
            raise ConfigError(f"{text} is not allowed: qtrain reads every key of its config (set {key} instead)")
        for cfg in configs:
            _check_key(cfg, override)
    settings = [o.input_line for o in keys if not o.is_sweep_override()]
    for combo in itertools.islice(itertools.product(*choices), MAX_COMPOSED):
        _resolve(_compose(conf_dir, [*combo, *settings]))


def _resolve(cfg: DictConfig) -> None:
    """Resolve every interpolation of ``cfg``: a value a resolver refuses (``model.preset``) is a one-line error."""
    from omegaconf.errors import InterpolationResolutionError

    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except InterpolationResolutionError as err:
        cause = err.__cause__ or err.__context__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise ConfigError(str(cause)) from None


# ---- checks of a composed config ----

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


# ---- a run's identity ----

def identity(config: DictConfig | dict[str, Any]) -> dict[str, Any]:
    """The resolved config minus :data:`NOT_IDENTITY`, with :data:`PATH_KEYS` made absolute, and the world size above 1."""
    if isinstance(config, DictConfig):
        plain = OmegaConf.to_container(config, resolve=True, throw_on_missing=False)
    else:
        plain = copy.deepcopy(config)
    plain.pop("hydra", None)
    for dotted in NOT_IDENTITY:
        *sections, key = dotted.split(".")
        _section(plain, sections).pop(key, None)
    for dotted in PATH_KEYS:
        *sections, key = dotted.split(".")
        section = _section(plain, sections)
        if isinstance(section.get(key), str) and section[key] != "???":
            section[key] = os.path.abspath(os.path.expanduser(section[key]))
    if distributed.active():  # absent on one process: the identities (and directories) of earlier runs stay
        plain["world_size"] = distributed.world_size()
    data = plain.get("data")
    if isinstance(data, dict) and data.get("name") == "text":  # Python's own docs: the corpus changes with the release
        data["python"] = platform.python_version()
    return plain


def _section(plain: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The mapping at ``names`` in ``plain``, or an empty one where there is none."""
    for name in names:
        plain = plain.get(name) if isinstance(plain.get(name), dict) else {}
    return plain


def digest(ident: dict[str, Any]) -> str:
    """A short hash of an identity: 8 hex digits, in the run directory's name."""
    text = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def first_difference(old: Any, new: Any, prefix: str = "") -> str:
    """``key old → new`` for the first key whose values differ (a section's ``name`` first, then sorted), or ``""``."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=lambda k: (k != "name", k)):
            found = first_difference(old.get(key, _ABSENT), new.get(key, _ABSENT), f"{prefix}{key}.")
            if found:
                return found
        return ""
    if old == new or (isinstance(old, float) and isinstance(new, float) and math.isnan(old) and math.isnan(new)):
        return ""
    return f"{prefix[:-1]} {old!r} → {new!r}"


def transformer_preset(preset: str, key: str) -> Any:
    """A Transformer preset's size: the resolver ``qtrain.transformer`` of ``conf/model/transformer.yaml``."""
    from qtrain.models.transformer import preset_value

    return preset_value(preset, key)


OmegaConf.register_new_resolver("qtrain.transformer", transformer_preset, replace=True)
# hydra.job.config.override_dirname.exclude_keys of conf/config.yaml
OmegaConf.register_new_resolver("qtrain.not_in_dir_name", lambda: list(NOT_IN_DIR_NAME), replace=True)


def run_dir_name(override_dirname: str, *, _root_: DictConfig) -> str:
    """The last part of a run directory: the overrides that name it, then ``id=`` the identity's digest.

    Registered as the resolver ``qtrain.run_dir_name`` and used by ``hydra.run.dir`` and
    ``hydra.sweep.subdir``: two configs with different identities never share a directory. The overrides
    are kept whole, as many as fit in :data:`NAME_LENGTH` characters. One identity may get two names
    (``seed=0`` given or left to its default): ``run.py`` reuses a finished run of the same identity
    from a directory beside this one (:func:`qtrain.run.finished_twin`).
    """
    task = OmegaConf.masked_copy(_root_, [k for k in _root_.keys() if k != "hydra"])
    name = ""
    for item in override_dirname.replace("/", "_").split(","):  # whole key=value items only, up to NAME_LENGTH
        longer = f"{name},{item}" if name else item
        if len(longer) > NAME_LENGTH:
            break
        name = longer
    run_id = f"id={digest(identity(task))}"
    return f"{name},{run_id}" if name else run_id
