"""The commands that make an experiment's runs and its report, as data: ``conf/sweeps/<experiment>.yaml``, a list of
command lines (``qtrain`` sweeps, then ``qtrain-report``), with ``DATA`` and ``OUT`` standing for the datasets' and
the runs' folders. Read here only, for ``qtrain-report --paper`` and ``scripts/run_table.py``; no torch."""

from __future__ import annotations

import shlex
from functools import cache

import yaml

from qtrain import resources
from qtrain.errors import ConfigError

PROGRAMS = ("qtrain", "qtrain-report")


@cache
def commands(experiment: str) -> tuple[tuple[str, ...], ...] | None:
    """The commands of ``experiment``'s sweeps file, each as its words, its program first; None where it has none.
    Raises ConfigError naming the file and the item where an item is not a command line of one of ``PROGRAMS``."""
    path = resources.conf_dir() / "sweeps" / f"{experiment}.yaml"
    if not path.is_file():
        return None
    lines = yaml.safe_load(path.read_text())  # as written: a command's ${...} is Hydra's to resolve, not ours
    if not isinstance(lines, list):
        raise ConfigError(f"{path} is not a list of command lines")
    found: list[tuple[str, ...]] = []
    for line in lines:
        try:
            words = shlex.split(line) if isinstance(line, str) else []
        except ValueError as error:  # an unclosed quote
            raise ConfigError(f"{path}: {line!r} does not split into words: {error}") from None
        if not words or words[0] not in PROGRAMS:
            raise ConfigError(f"{path}: {line!r} is not a command line of {' or '.join(PROGRAMS)}")
        found.append(tuple(words))
    return tuple(found)


def experiments() -> list[str]:
    """The experiments that have a sweeps file."""
    return sorted(path.stem for path in (resources.conf_dir() / "sweeps").glob("*.yaml"))
