"""The command-line check: what ``qtrain``'s overrides name and set, read before Hydra composes anything."""

from __future__ import annotations

import contextlib
import difflib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from qtrain.errors import ConfigError

GROUPS = ("method", "model", "data", "optim", "sched", "experiment", "scale")
LAUNCHER = "hydra/launcher"  # Hydra's group of launchers: conf/hydra/launcher/ adds qtrain's (parallel, slurm)
# Combinations of group choices whose composed configs the command-line check reads (a sweep may name more).
MAX_COMPOSED = 16
MAX_VALIDATED = 64  # a sweep's jobs checked before its first starts (beyond it, each job checks its own)
DIRECTORY_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir")
# Hydra keys through which a command line could make qtrain call any function, read any config file or set the
# environment: the callbacks (qtrain's own run callback among them), the config search path, logging handlers, the
# launcher's and sweeper's classes and the job's environment. A key under one of these, or above one (a whole
# subtree given at once), is refused; the rest of hydra.* (run.dir, sweep.dir, the launchers' keys) is the user's.
UNSAFE_HYDRA_KEYS = ("hydra.callbacks", "hydra.searchpath", "hydra.job_logging", "hydra.hydra_logging",
                     "hydra.launcher._target_", "hydra.sweeper", "hydra.job.env_set")
# the sweeper as a whole (its params become each job's overrides, past these checks) and the groups that would
# place a config under an unsafe key
UNSAFE_HYDRA_GROUPS = ("hydra/sweeper", "hydra/callbacks", "hydra/job_logging", "hydra/hydra_logging")
# resolvers that turn a string into a config node, which Hydra may then instantiate
NODE_RESOLVERS = ("oc.create", "oc.decode")
# Hydra's instantiation keys: a value holding one makes Hydra call the function it names (conf/optim and conf/sched
# name theirs in their files; the command line chooses among them with optim=NAME, sched=NAME)
INSTANTIATION_KEYS = ("_target_", "_args_", "_partial_", "_recursive_", "_convert_")


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


def _listed(override: Any) -> bool:
    """Whether a sweep's values are listed on the command line (a list or a range), not Hydra's to expand (a glob, an
    interval)."""
    return override.is_discrete_sweep() and override.value_type.name != "GLOB_CHOICE_SWEEP"


def override_values(override: Any) -> list[Any]:
    """The values an override sets: one, or each of a sweep's (an interval sweep gives none to check)."""
    if not override.is_sweep_override():
        return [override.value()]
    return list(override.sweep_iterator()) if _listed(override) else []


def sweep_size(overrides: list[str]) -> int | None:
    """How many jobs Hydra's basic sweeper makes of ``overrides`` (every combination), or None where a sweep's
    values are Hydra's to expand (a glob or an interval)."""
    size = 1
    for override in _parse(overrides):
        if override.is_sweep_override():
            values = override_values(override)
            if not values:
                return None
            size *= len(values)
    return size


def swept_keys(overrides: list[str]) -> set[str]:
    """The keys (and groups) a sweep's command line gives several values."""
    return {override.key_or_group for override in _parse(overrides) if override.is_sweep_override()}


def _is_group(override: Any) -> bool:
    return override.key_or_group in GROUPS and override.package is None


_COMPOSING: list[Path] = []  # the config tree of the enclosing composing() context, if any


@contextlib.contextmanager
def composing(conf_dir: Path) -> Iterator[None]:
    """Hydra set up once for every :func:`compose_config` inside (each call alone sets it up anew)."""
    if _COMPOSING:
        if _COMPOSING[-1] != conf_dir:
            raise RuntimeError(f"composing from {conf_dir} inside a composition from {_COMPOSING[-1]}")
        yield
        return
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        _COMPOSING.append(conf_dir)
        try:
            yield
        finally:
            _COMPOSING.pop()


def compose_config(conf_dir: Path, choices: list[str], with_hydra: bool = False) -> DictConfig:
    from hydra import compose

    with composing(conf_dir):
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
    for value in override_values(override):
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
        for name in (name for o in choices for name in override_values(o)):
            if name not in options:
                raise ConfigError(f"unknown launcher {name!r} (choose from: {', '.join(options)})")
    keys = [o for o in overrides if o.key_or_group.startswith("hydra.launcher.") and o.key_or_group.count(".") == 2
            and not (o.is_add() or o.is_delete())]
    if keys:
        cfg = compose_config(conf_dir, [o.input_line for o in choices], with_hydra=True)
        for override in keys:
            _check_key(cfg, override, f" of hydra/launcher={cfg.hydra.runtime.choices[LAUNCHER]}")


def _holds_instantiation(value: Any) -> bool:
    """Whether a parsed override value (a dict, a list, a sweep's values) holds an instantiation key at any depth."""
    if isinstance(value, dict):
        return any(str(k) in INSTANTIATION_KEYS or _holds_instantiation(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(map(_holds_instantiation, value))
    return False


def _check_safe(override: Any) -> None:
    """Refuse an override through which the command line could make qtrain call a function of its choosing."""
    key, text = override.key_or_group, override.input_line or override.key_or_group
    placed = [key] + ([override.package] if override.package else [])  # a group's config placed under a package
    for unsafe in UNSAFE_HYDRA_KEYS:
        if any(k == unsafe or k.startswith(f"{unsafe}.") or unsafe.startswith(f"{k}.") for k in placed):
            raise ConfigError(f"{text} is not allowed: {unsafe} is qtrain's own (set hydra.run.dir, hydra.sweep.dir "
                              "or the launcher's keys instead)")
    if key in UNSAFE_HYDRA_GROUPS or (key.startswith("hydra/") and (override.is_add() or override.is_delete()
                                                                     or override.package)):
        raise ConfigError(f"{text} is not allowed: qtrain chooses {key} itself (choose hydra/launcher=NAME only)")
    if (key.split(".")[-1] in INSTANTIATION_KEYS or any(map(_holds_instantiation, override_values(override)))
            or any(name in text for name in (*INSTANTIATION_KEYS, *NODE_RESOLVERS))):
        raise ConfigError(f"{text} is not allowed: the command line names no function for Hydra to call (choose the "
                          "optimizer and schedule with optim=NAME and sched=NAME)")


def check_command_line(overrides: list[str], conf_dir: Path, multirun: bool) -> None:
    """Raise ConfigError for an override that names no group choice or key, gives a value of the wrong type, or could
    make qtrain call a function (:data:`UNSAFE_HYDRA_KEYS`, :data:`INSTANTIATION_KEYS`)."""
    with composing(conf_dir):
        _check_command_line(overrides, conf_dir, multirun)


def _check_command_line(overrides: list[str], conf_dir: Path, multirun: bool) -> None:
    everything = _parse(overrides)
    for override in everything:
        _check_safe(override)
    seen: dict[str, str] = {}
    for override in everything:
        key, text = override.key_or_group, override.input_line or override.key_or_group
        if key in seen:
            raise ConfigError(f"{key} is given twice ({seen[key]}, {text}): give it once")
        seen[key] = text
    _check_launcher([o for o in everything if o.is_hydra_override()], conf_dir)
    for override in everything:
        text = override.input_line or override.key_or_group
        if override.key_or_group in DIRECTORY_KEYS and any(not str(v).strip() for v in override_values(override)):
            raise ConfigError(f"{text} is not allowed: {override.key_or_group} names the run's folder (give a path, or "
                              "leave it out for qtrain's own)")
        if _expands_to_nothing(override):
            raise ConfigError(f"{text} sweeps over no values: give it one at least")
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
        for choice in override_values(override):
            if choice not in options and not (override.key_or_group == "experiment" and choice is None):
                raise ConfigError(f"unknown {override.key_or_group} {choice!r} (choose from: {', '.join(options)})")
    choices = [[f"{o.key_or_group}={'null' if v is None else v}" for v in override_values(o)] for o in parsed
               if _is_group(o) and override_values(o)]  # a glob sweep's choices are Hydra's to expand: the default stands in
    keys = [o for o in parsed if not _is_group(o)]
    if not keys and not multirun:
        return
    configs = ([compose_config(conf_dir, list(combo)) for combo in itertools.islice(itertools.product(*choices), MAX_COMPOSED)]
               if keys else [])
    for override in keys:
        key, text = override.key_or_group, override.input_line or override.key_or_group
        group, _, leaf = key.partition(".")
        if group in GROUPS and leaf == "name":  # the name is the group's choice: renaming it would mislabel the run
            raise ConfigError(f"{text} is not allowed: choose the {group} with {group}=NAME")
        if override.is_add():
            if all(_has_key(cfg, key) for cfg in configs):
                raise ConfigError(f"{text} is not allowed: {key} is set already (drop the +)")
            raise _unknown_key(key, configs[0], f"{text} is not allowed: nothing reads {key}")
        if override.is_delete():
            raise ConfigError(f"{text} is not allowed: qtrain reads every key of its config (set {key} instead)")
        for cfg in configs:
            _check_key(cfg, override)
    if not multirun:
        settings = [o.input_line for o in keys if not o.is_sweep_override()]
        for combo in itertools.islice(itertools.product(*choices), MAX_COMPOSED):
            _resolve(compose_config(conf_dir, [*combo, *settings]))
        return
    from qtrain.config.checks import validate

    # every job's values pass the checks before the first job starts
    for job in itertools.islice(itertools.product(*map(_job_values, parsed)), MAX_VALIDATED):
        cfg = compose_config(conf_dir, [text for text in job if text])
        _resolve(cfg)
        validate(cfg)


def _expands_to_nothing(override: Any) -> bool:
    """A sweep whose values Hydra would expand to none (``range(0,0)``): its sweep would run no job."""
    return override.is_sweep_override() and _listed(override) and not override_values(override)


def _job_values(override: Any) -> list[str]:
    """The override as each job of a sweep gets it: one per swept value; none for a glob or an interval sweep,
    whose values are Hydra's to expand (the default stands in)."""
    if not override.is_sweep_override():
        return [override.input_line]
    if not _listed(override):
        return [""]
    return [f"{override.get_key_element()}={value}" for value in override.sweep_string_iterator()]


def _resolve(cfg: DictConfig) -> None:
    """Resolve every interpolation of ``cfg``: a value a resolver refuses (``model.preset``), an interpolation of a
    missing key or environment variable, or one that refers to itself, is a one-line error."""
    from omegaconf.errors import InterpolationResolutionError

    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except InterpolationResolutionError as err:
        cause = err.__cause__ or err.__context__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise ConfigError(str(cause)) from None
        where = f"{err.full_key} " if getattr(err, "full_key", None) else ""
        reason = str(err).strip().splitlines()[0].removeprefix("KeyError raised while resolving interpolation: ")
        raise ConfigError(f"{where}cannot be resolved: {reason.strip(chr(34))}") from None
