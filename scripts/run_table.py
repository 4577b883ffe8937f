"""Regenerate a paper table: run the commands in its experiment file's header, then its report.

Every ``conf/experiment/<table>.yaml`` lists, in its header, the sweeps that make the table's runs and the
``qtrain-report`` command that reads them, with ``DATA`` (the datasets) and ``OUT`` (the runs) to fill in.
This script fills them in, runs the sweeps ``--jobs`` at a time (each with an equal share of the cores as
torch threads), each sweep's output in ``OUT/logs/``, then runs the report commands with any extra arguments.
Finished runs are reported, not rerun, and a killed run resumes from its last epoch, so the script can
simply be started again after an interruption::

    python scripts/run_table.py adapt_table2 --data DATA --out OUT --scale mini --jobs 2 -- --plots OUT/figures
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CONF = Path(__file__).resolve().parents[1] / "conf" / "experiment"
SCALES = ("paper", "mini", "smoke")


def header_commands(table: str) -> list[list[str]]:
    """The ``qtrain`` and ``qtrain-report`` commands of the table's experiment header, in order."""
    path = CONF / f"{table}.yaml"
    if not path.is_file():
        tables = sorted(p.stem for p in CONF.glob("*table*.yaml"))
        raise SystemExit(f"run_table: error: {table!r} is not an experiment (tables: {', '.join(tables)})")
    commands = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        words = shlex.split(line.lstrip("# "))
        if words and words[0] in ("qtrain", "qtrain-report"):
            commands.append(words)
    return commands


def filled(words: list[str], data: Path, out: Path, scale: str) -> list[str]:
    """``words`` with DATA and OUT replaced and every ``scale=`` set to ``scale``."""
    words = [w.replace("DATA", str(data)).replace("OUT", str(out)) for w in words]
    return [f"scale={scale}" if w.startswith("scale=") else w for w in words]


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
    parser.add_argument("--jobs", type=int, default=2, help="sweeps at a time (default 2)")
    parser.add_argument("report_args", nargs="*", help="after --: extra arguments of the report commands")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs} is not allowed: it must be >= 1")
    commands = [filled(words, args.data.resolve(), args.out.resolve(), args.scale) for words in header_commands(args.table)]
    sweeps = [c for c in commands if c[0] == "qtrain"]
    reports = [c for c in commands if c[0] == "qtrain-report"]
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    with ThreadPoolExecutor(args.jobs) as pool:
        codes = list(pool.map(lambda item: run(item[1] + ["progress=false"], logs / f"{args.table}-{item[0]}.log", threads),
                              enumerate(sweeps)))
    for words, code in zip(sweeps, codes):
        print(f"{'ok' if code == 0 else f'FAILED ({code})'}: {shlex.join(words)}")
    for words in reports:
        subprocess.run([str(Path(sys.executable).with_name(words[0])), *words[1:], *args.report_args], check=False)
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
