"""A run's identity: the keys that define it (:data:`RUN_KEYS` says which do not, or not wholly), and its digest."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import platform
from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from qtrain import distributed
from qtrain.config.methods import METHODS
from qtrain.config.models import MODELS

INSTANTIATION_KEYS = ("_target_", "_partial_")  # Hydra's, in conf/optim and conf/sched
_ALWAYS = object()


@dataclass(frozen=True)
class RunKey:
    """What a key is to a run. A key not in :data:`RUN_KEYS` is in the identity, names the run directory where the
    command line sets it, and makes runs different configurations in qtrain-report's tables."""

    identity: bool = True  # in the run's identity: its directory's id= digest and the guard of a resume
    path: bool = False  # made absolute in the identity: one folder named from two working directories is one run
    names_dir: bool = True  # an override of it is part of the run directory's name (hydra.job.override_dirname)
    configuration: bool = True  # runs that differ in it are different configurations (rows) in qtrain-report
    # a key added after runs were made: at this value it is left out of the identity and of the report's
    # configurations, so that those runs keep their identities and stay the configurations they were
    omitted_at: Any = _ALWAYS


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
    "train.eval_every": RunKey(omitted_at=1),
    "method.scale_rule": RunKey(omitted_at="floor"),  # MX's
    "method.matmuls": RunKey(omitted_at="quantized"),  # FP8's and MX's
    "method.cp_gemms": RunKey(omitted_at="all"),  # DFQ's and FracTrain's
    "method.gate_lr": RunKey(omitted_at=None),  # DFQ's and FracTrain's
    "model.classifier_init": RunKey(omitted_at="torch"),  # the CIFAR ResNets'
}
NOT_IDENTITY = tuple(key for key, role in RUN_KEYS.items() if not role.identity)
PATH_KEYS = tuple(key for key, role in RUN_KEYS.items() if role.path)
NOT_IN_DIR_NAME = tuple(key for key, role in RUN_KEYS.items() if not role.names_dir)
NOT_CONFIGURATION = tuple(key for key, role in RUN_KEYS.items() if not role.configuration)
OMITTED_AT = {key: role.omitted_at for key, role in RUN_KEYS.items() if role.omitted_at is not _ALWAYS}


def identity(config: DictConfig | dict[str, Any]) -> dict[str, Any]:
    """The resolved config as the run records it (:func:`recorded`: a live config gains the world size above 1, a
    record holds it) minus :data:`NOT_IDENTITY` and the :data:`OMITTED_AT` keys at those values, with
    :data:`PATH_KEYS` made absolute."""
    if isinstance(config, DictConfig):
        plain = OmegaConf.to_container(recorded(config), resolve=True, throw_on_missing=False)
    else:
        plain = copy.deepcopy(config)
    plain.pop("hydra", None)
    for dotted in NOT_IDENTITY:
        *sections, key = dotted.split(".")
        _section(plain, sections).pop(key, None)
    for dotted, value in OMITTED_AT.items():
        *sections, key = dotted.split(".")
        section = _section(plain, sections)
        if key in section and section[key] == value:
            del section[key]
    for dotted in PATH_KEYS:
        *sections, key = dotted.split(".")
        section = _section(plain, sections)
        if isinstance(section.get(key), str) and section[key] != "???":
            section[key] = os.path.abspath(os.path.expanduser(section[key]))
    data = plain.get("data")
    if isinstance(data, dict) and data.get("name") == "text":  # Python's own docs: the corpus changes with the release
        data["python"] = platform.python_version()
    return plain


def recorded(config: DictConfig) -> DictConfig:
    """``config`` as the run's files record it (``.hydra/config.yaml``, the summary's ``config``): with ``world_size``
    where more than one process trains the run, so that the record alone gives the run's identity, and qtrain-report
    tells it from a one-process run of the same config (BatchNorm statistics and activation ranges are per process)."""
    if not distributed.active():  # absent on one process: the identities (and directories) of earlier runs stay
        return config
    record = copy.deepcopy(config)
    with open_dict(record):
        record.world_size = distributed.world_size()
    return record


def with_keys_added_since(config: dict[str, Any]) -> dict[str, Any]:
    """A run's recorded ``config`` with each :data:`OMITTED_AT` key it lacks set to the value it ran at, so that it
    builds today; a method's or model's key only where that method's or model's schema has it (MX's ``scale_rule``
    is no key of SBM's, the CIFAR ResNets' ``classifier_init`` none of the Transformer's)."""
    plain = copy.deepcopy(config)
    schema_keys = {}
    for section, schemas in (("method", METHODS), ("model", MODELS)):
        schema = schemas.get(_section(plain, [section]).get("name"))
        schema_keys[section] = {field.name for field in fields(schema)} if schema is not None else set()
    for dotted, value in OMITTED_AT.items():
        *sections, key = dotted.split(".")
        section = _section(plain, sections)
        if key not in section and (sections[0] not in schema_keys or key in schema_keys[sections[0]]):
            section[key] = value
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
