"""``qtrain-report DIR...``: the runs under the given folders as markdown tables, and optionally as CSV,
LaTeX, PNG plots and one HTML page; ``--paper`` sets published tables beside our figures.

Errors are one line, ``qtrain-report: error: ...``, exit code 2, before anything is written: an
output that cannot be written included. A damaged run is a row of its own (``runs.py``) and each
run identity is counted once.
"""

from __future__ import annotations

import argparse
import html
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from qtrain.errors import QtrainError
from qtrain.report.paper import compare, paper_tables
from qtrain.report.runs import ReportError, find_runs, one_per_identity
from qtrain.report.tables import CONFIG_COLUMNS, display_frame, run_frame, summary_frame
from qtrain.results import check_writable

PAPERS = {"adapt": "AdaPT", "dynasty": "DYNASTY", "fractrain": "FracTrain"}


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="qtrain-report", description="Tables and plots of qtrain runs, and the papers' tables beside them.")
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="run directories, or folders that hold them (searched)")
    parser.add_argument("--baseline", nargs="+", default=[], metavar="KEY=VALUE",
                        help=f"the row to compute savings against, e.g. method=sbm (keys: {', '.join(CONFIG_COLUMNS)})")
    parser.add_argument("--paper", nargs="+", default=[], metavar="TABLE",
                        help="published tables to compare with (e.g. fractrain_table3; 'all' for every one)")
    parser.add_argument("--csv", type=Path, metavar="FILE", help="write the runs table (mean and std columns) as CSV")
    parser.add_argument("--latex", type=Path, metavar="FILE", help="write the runs table as a LaTeX tabular")
    parser.add_argument("--plots", type=Path, metavar="OUT", help="write the plots as PNG and report.html into OUT")
    return parser.parse_args(argv)


def _selector(pairs: list[str]) -> dict[str, str]:
    selector = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in CONFIG_COLUMNS:
            raise ReportError(f"--baseline {pair} is not allowed: give KEY=VALUE with KEY one of {', '.join(CONFIG_COLUMNS)}")
        selector[key] = value
    return selector


def _paper_names(names: list[str]) -> list[str]:
    known = paper_tables()
    chosen = known if names == ["all"] else names
    for name in chosen:
        if name not in known:
            raise ReportError(f"unknown paper table {name!r} (choose from: all, {', '.join(known)})")
    return chosen


def _title(name: str) -> str:
    paper, _, table = name.partition("_table")
    return f"{PAPERS.get(paper, paper)} Table {table}"


def _paper_frame(comparison: pd.DataFrame) -> pd.DataFrame:
    shown = comparison.copy()
    shown["ours"] = [f"{m:.4g}" + ("" if pd.isna(s) else f" ± {s:.2g}") if not pd.isna(m) else "-"
                     for m, s in zip(shown.ours, shown.ours_std)]
    shown["difference"] = [f"{d:+.4g}" if not pd.isna(d) else "-" for d in shown.difference]
    shown["paper"] = [f"{p:.4g}" for p in shown.paper]
    return shown.drop(columns="ours_std")


def _write_html(path: Path, sections: list[tuple[str, pd.DataFrame, str]], images: list[Path]) -> None:
    parts = ["<!doctype html><meta charset='utf-8'><title>qtrain report</title>",
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:3px 6px}img{max-width:100%;margin:1em 0}</style>"]
    for heading, frame, note in sections:
        parts += [f"<h2>{html.escape(heading)}</h2>", frame.to_html(index=False, na_rep="-", border=0)]
        if note:
            parts.append(f"<p>{html.escape(note)}</p>")
    parts.append("<h2>Plots</h2>")
    parts += [f"<figure><img src='{html.escape(image.name)}' alt='{html.escape(image.stem)}'></figure>" for image in images]
    path.write_text("\n".join(parts) + "\n")


def _check_outputs(args: argparse.Namespace) -> None:
    """Each output can be written: a file's folder exists as a writable folder or can be made, a folder likewise."""
    for option, path, is_file in (("--csv", args.csv, True), ("--latex", args.latex, True), ("--plots", args.plots, False)):
        if path is None:
            continue
        if is_file and path.is_dir():
            raise ReportError(f"{option} {path} is not allowed: it is a directory (give a file name)")
        if not is_file and path.exists() and not path.is_dir():
            raise ReportError(f"{option} {path} is not allowed: it is a file (give a folder)")
        check_writable(path.parent if is_file else path, f"{option} folder")


def _check_baseline(table: pd.DataFrame, baseline: dict[str, str]) -> None:
    for key, value in baseline.items():
        present = sorted(set(table[key].astype(str)))
        if value not in present:
            raise ReportError(f"--baseline {key}={value} matches no run (its runs have {key}: {', '.join(present)})")


def _write(path: Path, write: Callable[[Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path)


def report(argv: list[str] | None = None) -> str:
    """Build the report that ``argv`` asks for, write its files, and return the markdown printed."""
    args = _arguments(argv)
    baseline = _selector(args.baseline)
    names = _paper_names(args.paper)
    _check_outputs(args)
    runs, twins = one_per_identity(find_runs(args.dirs))
    table = summary_frame(run_frame(runs), baseline)
    _check_baseline(table, baseline)
    note = (f"{len(twins)} more director{'y holds a run' if len(twins) == 1 else 'ies hold runs'} counted once above "
            f"(the same identity under another name): {', '.join(str(run.dir) for run in twins)}") if twins else ""
    sections = [(f"Runs ({len(runs)})", display_frame(table), note)]
    for name in names:
        comparison, unmatched = compare(runs, name)
        note = f"{unmatched} of the table's cells have no run here." if unmatched else ""
        sections.append((f"{_title(name)}: paper and ours", _paper_frame(comparison), note))
    if args.csv:
        _write(args.csv, lambda path: table.to_csv(path, index=False))
    if args.latex:
        _write(args.latex, lambda path: path.write_text(display_frame(table).to_latex(index=False)))
    if args.plots:
        from qtrain.report.plots import write_plots

        images = write_plots(runs, args.plots)
        _write_html(args.plots / "report.html", sections, images)
    lines = []
    for heading, frame, note in sections:
        lines += [f"## {heading}", "", frame.to_markdown(index=False) if len(frame) else "(no run matches a cell)", ""]
        if note:
            lines += [note, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``qtrain-report``: print the report, or one line naming what is wrong."""
    try:
        print(report(argv))
    except QtrainError as err:
        print(f"qtrain-report: error: {err}", file=sys.stderr)
        sys.exit(2)
    except OSError as err:  # an output that the checks let through and writing then refused (a full disk)
        print(f"qtrain-report: error: cannot write {err.filename}: {err.strerror}", file=sys.stderr)
        sys.exit(2)
