"""Regenerate a paper table: run the commands of its sweeps file, then its report.

Every ``conf/sweeps/<table>.yaml`` lists the sweeps that make the table's runs and the ``qtrain-report`` command
that reads them, with ``DATA`` (the datasets) and ``OUT`` (the runs) to fill in.
This script fills them in, expands each sweep into its runs (the cartesian product of its comma-separated
values, as Hydra's basic sweeper does, so each run lands in the directory the sweep would give it), runs them
``--jobs`` at a time (each with an equal share of the cores as torch threads), each run's output in
``OUT/logs/``, then runs the report commands with any extra arguments. A run that starts from another run of the
table (``train.init_from=`` a directory that a run's ``hydra.run.dir=`` names, e.g. Table 5's pre-trainings) waits
for it, and is not started if it failed. ``--only KEY=VALUE`` keeps the runs
whose sweep gives KEY that value (e.g. ``--only model=resnet38`` for the ResNet-38 cells of a table that also
sweeps ResNet-74). Finished runs are reported, not rerun, and a killed run resumes from its last epoch, so the
script can simply be started again after an interruption::

    python scripts/run_table.py adapt_table2 --data DATA --out OUT --scale mini --jobs 2 -- --plots OUT/figures
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from qtrain import sweeps
from qtrain.errors import QtrainError

SCALES = ("paper", "mini", "smoke")


def table_commands(table: str) -> list[list[str]]:
    """The ``qtrain`` and ``qtrain-report`` commands of the table's sweeps file, in order."""
    try:
        commands = sweeps.commands(table)
    except QtrainError as error:
        raise SystemExit(f"run_table: error: {error}") from None
    if commands is None:
        raise SystemExit(f"run_table: error: {table!r} has no sweeps file conf/sweeps/{table}.yaml "
                         f"(one of: {', '.join(sweeps.experiments())})")
    return [list(words) for words in commands]


def filled(words: list[str], data: Path, out: Path, scale: str) -> list[str]:
    """``words`` with DATA and OUT replaced and every ``scale=`` set to ``scale``."""
    words = [w.replace("DATA", str(data)).replace("OUT", str(out)) for w in words]
    return [f"scale={scale}" if w.startswith("scale=") else w for w in words]


def expanded(words: list[str]) -> list[list[str]]:
    """The single runs of the sweep ``words`` (``qtrain -m`` and overrides), as Hydra's basic sweeper makes them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    options = [w for w in words[1:] if w.startswith("-")]
    choices = []
    for override in OverridesParser.create().parse_overrides([w for w in words[1:] if not w.startswith("-")]):
        key = override.get_key_element()
        values = override.sweep_string_iterator() if override.is_sweep_override() else [override.get_value_element_as_str()]
        choices.append([f"{key}={value}" for value in values])
    return [[words[0], *options, *run] for run in itertools.product(*choices)]


def selected(runs: list[list[str]], only: list[str]) -> list[list[str]]:
    """The runs that carry every ``KEY=VALUE`` of ``only``, or pass none of KEY."""
    def keeps(run: list[str]) -> bool:
        return all(pick in run or not any(w.startswith(pick.partition("=")[0] + "=") for w in run) for pick in only)
    return [run for run in runs if keeps(run)]


def option(words: list[str], key: str) -> str | None:
    """The value ``words`` give ``key``, or None."""
    return next((w.partition("=")[2] for w in words if w.startswith(key + "=")), None)


LOCATIONS = ("data.root", "hydra.sweep.dir")  # where a run reads and writes, not what it is


def log_names(table: str, runs: list[list[str]]) -> list[str]:
    """Each run's log file: the table and the values that set the run apart from the table's other runs (a path
    by its last part: a pre-training's ``hydra.run.dir``, a retraining's ``train.init_from``), made unique."""
    settings = [dict(w.split("=", 1) for w in run[1:] if "=" in w and not w.startswith("-")) for run in runs]
    found: list[str] = []
    for setting in settings:
        varying = [key for key, value in setting.items()
                   if key not in LOCATIONS and any(other.get(key) != value for other in settings)]
        picks = [re.sub(r"[^\w.]+", "_", setting[key].rstrip("/").rsplit("/", 1)[-1]).strip("_") for key in varying]
        name = unique = "-".join([table, *picks])
        count = 1
        while unique in found:
            count += 1
            unique = f"{name}-{count}"
        found.append(unique)
    return [f"{name}.log" for name in found]


def run_all(runs: list[list[str]], jobs: int, launch: Callable[[list[str]], int]) -> list[int | None]:
    """``launch`` every run, ``jobs`` at a time, in order; the exit codes, None for a run not started.

    A run whose ``train.init_from`` is the ``hydra.run.dir`` of an earlier run waits for that run and is not
    started (None) unless it exits 0. Runs start in list order, so a waiting run's producer has already started.
    """
    made_by: dict[str, Future] = {}  # hydra.run.dir -> the run that writes it

    def launch_after(words: list[str], producer: Future | None) -> int | None:
        if producer is not None and producer.result() != 0:
            return None
        return launch(words)

    with ThreadPoolExecutor(jobs) as pool:
        futures = []
        for words in runs:
            futures.append(pool.submit(launch_after, words, made_by.get(option(words, "train.init_from"))))
            if (target := option(words, "hydra.run.dir")) is not None:
                made_by[target] = futures[-1]
        return [future.result() for future in futures]


def run(words: list[str], log: Path, threads: int) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    exe = Path(sys.executable).with_name(words[0])
    with log.open("a") as stream:
        stream.write(f"$ {shlex.join(words)}\n")
        stream.flush()
        return subprocess.run([str(exe), *words[1:]], stdout=stream, stderr=subprocess.STDOUT, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("table", help="a paper-table experiment, e.g. adapt_table2")
    parser.add_argument("--data", type=Path, required=True, help="the folder holding the datasets (DATA)")
    parser.add_argument("--out", type=Path, required=True, help="the folder of the runs (OUT)")
    parser.add_argument("--scale", choices=SCALES, default="mini")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2)")
    parser.add_argument("--only", action="append", default=[], metavar="KEY=VALUE",
                        help="keep the runs that set KEY to VALUE (repeatable)")
    parser.epilog = "Arguments after -- are passed to the report commands."
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.report_args = argv[cut + 1:]
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs} is not allowed: it must be >= 1")
    bad = [pick for pick in args.only if "=" not in pick]
    if bad:
        parser.error(f"--only {bad[0]} is not allowed: it must be KEY=VALUE, e.g. model=resnet38")
    commands = [filled(words, args.data.resolve(), args.out.resolve(), args.scale) for words in table_commands(args.table)]
    runs = selected([r for c in commands if c[0] == "qtrain" for r in expanded(c)], args.only)
    reports = [c for c in commands if c[0] == "qtrain-report"]
    if not runs:
        parser.error(f"--only {' '.join(args.only)} matches none of {args.table}'s runs")
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)

    names = {id(words): name for words, name in zip(runs, log_names(args.table, runs))}
    codes = run_all(runs, args.jobs, lambda words: run(words + ["progress=false"], logs / names[id(words)], threads))
    for words, code in zip(runs, codes):
        status = "ok" if code == 0 else "NOT RUN (the run it starts from failed)" if code is None else f"FAILED ({code})"
        print(f"{status}: {shlex.join(words)}")
    for words in reports:
        subprocess.run([str(Path(sys.executable).with_name(words[0])), *words[1:], *args.report_args], check=False)
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
