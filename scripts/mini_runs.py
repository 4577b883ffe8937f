"""What the miniature reproductions share: train a set of qtrain runs side by side, and describe the machine.

Each run lives in its own directory, so rerunning a script resumes unfinished runs and reports finished ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd


def parser(description: str, out: str, holds: str = "cifar-10-batches-py") -> argparse.ArgumentParser:
    """The command line every miniature takes: --root (the folder that ``holds`` the data), --out, --jobs, --report-only."""
    args = argparse.ArgumentParser(description=description)
    args.add_argument("--root", required=True, help=f"folder holding {holds}")
    args.add_argument("--out", default=out)
    args.add_argument("--jobs", type=int, default=1, help="runs trained at a time, sharing the cores")
    args.add_argument("--report-only", action="store_true", help="tabulate the runs as they stand, train nothing")
    return args


def train_all(runs: dict[str, list[str]], runs_dir: Path, jobs: int) -> None:
    """Train every run (``qtrain`` with its overrides, in ``runs_dir/<name>``), ``jobs`` at a time, longest first.

    ``runs`` lists the runs shortest first; each job gets ``cores / jobs`` torch threads.
    """
    threads = max(1, (os.cpu_count() or 1) // jobs)
    qtrain = Path(sys.executable).with_name("qtrain")

    def train(name: str) -> None:
        command = [str(qtrain), *runs[name], "progress=false", f"hydra.run.dir={runs_dir / name}"]
        print(" ".join(command), flush=True)
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(train, reversed(runs)))


def machine(run_dir: Path, jobs: int) -> tuple[str, str]:
    """The machine a run was measured on, and how the runs shared it, from the run's summary.json (for a run cut
    short, which has none: the threads :func:`train_all` gives each run, and this environment's versions)."""
    path = run_dir / "summary.json"
    if path.exists():
        summary = json.loads(path.read_text())
        count, torch_version, python = summary["threads"], summary["versions"]["torch"], summary["versions"]["python"]
    else:
        import torch

        count, torch_version, python = max(1, (os.cpu_count() or 1) // jobs), torch.__version__, platform.python_version()
    threads = f"{count} torch thread{'s' * (count != 1)}"
    described = (f"{platform.machine()} CPU, {os.cpu_count()} cores, {threads} per run, "
                 f"torch {torch_version}, Python {python}")
    sharing = ("the runs one after another on an otherwise idle machine" if jobs == 1 else
               f"{jobs} runs at a time, {threads} each")
    return described, sharing


def turning_points(metrics: pd.DataFrame) -> str:
    """The epochs after which a staged method (PFQ, FracTrain) moved to its next stage ("none"; "" for no stages)."""
    if "stage" not in metrics:
        return ""
    turns = metrics.index[metrics["stage"].diff().fillna(0) > 0]
    return " ".join(f"{int(metrics.epoch[i - 1])}" for i in turns) or "none"


def add_savings_vs_sbm(table: pd.DataFrame) -> None:
    """Add ``savings_vs_sbm_percent``: each quantized run's cost saving over the SBM row's (none for float32)."""
    sbm = float(table.loc[table.method == "sbm", "percent_of_float32"].iloc[0])
    table["savings_vs_sbm_percent"] = (100 * (1 - table["percent_of_float32"] / sbm)).round(1)
    table.loc[table.method == "float32", "savings_vs_sbm_percent"] = None


def write_results(out: str, table: pd.DataFrame, epochs: int, heading: str, text: str) -> None:
    """Add ``epoch_time_x_float32``, then write ``<out>.csv`` and ``<out>.md`` (heading, text, the table) and print it.

    A run that has not finished its ``epochs`` is named in a note above the table.
    """
    float32_epoch = float(table.loc[table.method == "float32", "median_epoch_s"].iloc[0])
    table["epoch_time_x_float32"] = (table["median_epoch_s"] / float32_epoch).round(2)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(path.with_suffix(".csv"), index=False)
    unfinished = table.loc[table.epochs != f"{epochs}/{epochs}", "method"].tolist()
    cut_short = (f"Cut short, by the time this machine had: {', '.join(unfinished)} (the `epochs` column); rerunning "
                 "the command resumes it from its last epoch.\n\n" if unfinished else "")
    path.with_suffix(".md").write_text(f"# {heading}\n\n{text}\n\n{cut_short}{table.to_markdown(index=False)}\n")
    print(table.to_string(index=False))
