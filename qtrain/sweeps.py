"""The commands that make an experiment's runs and its report, as data: ``conf/sweeps/<experiment>.yaml``, a list of
command lines (``qtrain`` sweeps, then ``qtrain-report``), with ``DATA`` and ``OUT`` standing for the datasets' and
the runs' folders. Read here only, for ``qtrain-report --paper`` and ``scripts/run_table.py``; no torch."""

from __future__ import annotations

import shlex
from functools import cache

from qtrain import resources

PROGRAMS = ("qtrain", "qtrain-report")


@cache
def commands(experiment: str) -> tuple[tuple[str, ...], ...] | None:
    """The commands of ``experiment``'s sweeps file, each as its words, its program first; None where it has none.
    Raises ValueError naming the file and the item where an item is not a command line of one of ``PROGRAMS``."""
    from omegaconf import ListConfig, OmegaConf

    path = resources.conf_dir() / "sweeps" / f"{experiment}.yaml"
    if not path.is_file():
        return None
    items = OmegaConf.load(path)
    if not isinstance(items, ListConfig):
        raise ValueError(f"{path} is not a list of command lines")
    words = []
    for item in items:
        line = shlex.split(item) if isinstance(item, str) else []
        if not line or line[0] not in PROGRAMS:
            raise ValueError(f"{path}: {item!r} is not a command line of {' or '.join(PROGRAMS)}")
        words.append(tuple(line))
    return tuple(words)


def experiments() -> list[str]:
    """The experiments that have a sweeps file."""
    return sorted(path.stem for path in (resources.conf_dir() / "sweeps").glob("*.yaml"))
