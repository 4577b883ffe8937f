"""The commands that make an experiment's table: the ``qtrain`` sweeps and the ``qtrain-report`` commands that its file's
header (``conf/experiment/<name>.yaml``) lists, in order, with ``DATA`` and ``OUT`` standing for the datasets' and the
runs' folders. The one reader of them, for ``qtrain-report --paper`` (the command behind a cell with no run) and
``scripts/run_table.py`` (a table's runs). Imports nothing that needs torch."""

from __future__ import annotations

import shlex
from functools import cache

from qtrain import resources

PROGRAMS = ("qtrain", "qtrain-report")


@cache
def header_commands(experiment: str) -> tuple[tuple[str, ...], ...] | None:
    """The commands in the header (the comment lines that open the file) of experiment ``experiment``, each as its
    words, its program first; None where there is no such experiment."""
    path = resources.conf_dir() / "experiment" / f"{experiment}.yaml"
    if not path.is_file():
        return None
    commands = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("# ")
        if text.split(" ", 1)[0] in PROGRAMS:
            commands.append(tuple(shlex.split(text)))
    return tuple(commands)
