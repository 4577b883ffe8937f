"""``qtrain-report DIR...``: the command that reads run directories and writes the report: the runs table, with
``--paper`` the published tables beside ours, with ``--reference`` a reference curve, and CSV, LaTeX, plots and HTML.
docs/reports.md describes the report and its one-line errors."""

from __future__ import annotations

import argparse
import html
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from qtrain.errors import QtrainError
from qtrain.report.paper import (
    NAMES,
    NOT_PRODUCED_GROUP,
    NOT_RUN_GROUP,
    compare,
    load_table,
    paper_tables,
    table_baseline,
    views,
)
from qtrain.report.runs import ReportError, Run, find_runs, one_per_identity
from qtrain.report.tables import AGGREGATES, CONFIG_COLUMNS, display_frame, run_frame, summary_frame
from qtrain.results import check_writable

if TYPE_CHECKING:
    from qtrain.report.reference import Reference

PAPERS = {"adapt": "AdaPT", "dynasty": "DYNASTY", "fractrain": "FracTrain"}


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="qtrain-report", description="Tables and plots of qtrain runs, and the papers' tables beside them.")
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="run directories, or folders that hold them (searched)")
    parser.add_argument("--baseline", nargs="+", default=[], metavar="KEY=VALUE",
                        help=f"the row to compute savings against, e.g. method=sbm (keys: {', '.join(CONFIG_COLUMNS)})")
    parser.add_argument("--paper", nargs="+", default=[], metavar="TABLE",
                        help="published tables to compare with (e.g. fractrain_table3; 'all' for every one)")
    parser.add_argument("--stand-in", nargs="+", default=[], metavar="DATA=PAPER_DATA",
                        help="with --paper, read the runs on DATA as stand-ins for the paper's PAPER_DATA cells (e.g. "
                             "cifar10=cifar100); compared only as at a reduced scale, each figure against the table's "
                             "baseline, and marked in a stand_in column")
    parser.add_argument("--aggregate", default="mean", choices=AGGREGATES,
                        help="over the seeds and folds of a configuration: mean ± std (default), or the figures of the "
                             "run with the best final test accuracy (AdaPT's protocol: the best of 10 folds)")
    parser.add_argument("--csv", type=Path, metavar="FILE",
                        help="write the runs table (mean and std columns) as CSV; with --paper, each paper table too, "
                             "beside it as FILE's name + '-TABLE' (t.csv: t-fractrain_table3.csv), its parts in a "
                             "'view' column and the cells without a run with the reason or command in 'why'")
    parser.add_argument("--latex", type=Path, metavar="FILE",
                        help="write the runs table as a LaTeX tabular (needs \\usepackage{booktabs}); with --paper, "
                             "each paper table too, as FILE's name + '-TABLE', one tabular per part")
    parser.add_argument("--plots", type=Path, metavar="OUT", help="write the plots as PNG and report.html into OUT")
    parser.add_argument("--reference", type=Path, nargs="+", metavar="FILE",
                        help="a reference learning curve (e.g. results/reference/*.csv), or one file per seed of the "
                             "reference's run (their mean, with each seed's gates and the seeds' range): the runs (the "
                             "seeds of one configuration) epoch by epoch beside it, the differences' mean and largest "
                             "size, its gate shares where it has them, and with --plots the curves over it")
    parser.add_argument("--reference-from", type=int, default=1, metavar="EPOCH",
                        help="with --reference, the first epoch the differences' mean and largest size count (default 1)")
    parser.add_argument("--shares-at", type=int, nargs="+", default=[], metavar="EPOCH",
                        help="with --reference, the epochs whose gate shares are set side by side (default: the runs' "
                             "last epoch)")
    parser.add_argument("--gates-every", type=int, default=1, metavar="N",
                        help="with --reference, the per-epoch gate tables show every N-th epoch and the last (default 1)")
    return parser.parse_args(argv)


def _selector(pairs: list[str]) -> dict[str, str]:
    selector = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in CONFIG_COLUMNS:
            raise ReportError(f"--baseline {pair} is not allowed: give KEY=VALUE with KEY one of {', '.join(CONFIG_COLUMNS)}")
        selector[key] = value
    return selector


def _stand_ins(pairs: list[str], paper: list[str]) -> dict[str, str]:
    """``--stand-in``'s pairs as {run data: paper data}."""
    if pairs and not paper:
        raise ReportError(f"--stand-in {pairs[0]} is not allowed without --paper (it says which paper cells runs match)")
    stand_ins = {}
    for pair in pairs:
        data, sep, paper_data = pair.partition("=")
        if not (sep and data and paper_data) or data == paper_data:
            raise ReportError(f"--stand-in {pair} is not allowed: give DATA=PAPER_DATA, two different dataset names")
        stand_ins[data] = paper_data
    return stand_ins


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


def _paper_frame(view: pd.DataFrame) -> pd.DataFrame:
    """A part of a paper table for reading: ``mean ± std`` cells, columns that say nothing here dropped (the scale
    at paper scale, the config where no run has one, the beside column where no figure has one)."""
    shown = view.copy()
    shown["ours"] = [f"{m:.4g}" + ("" if pd.isna(s) else f" ± {s:.2g}") if not pd.isna(m) else "-"
                     for m, s in zip(shown.ours, shown.ours_std)]
    shown["paper"] = [f"{p:.4g}" if not pd.isna(p) else "-" for p in shown.paper]
    drop = ["ours_std"] + (["metric"] if "figure" in shown else [])  # the figure says what is compared
    if "difference" in shown:
        shown["difference"] = [f"{d:+.4g}" if not pd.isna(d) else "-" for d in shown.difference]
    if "beside" in shown:
        shown["beside"] = [f"{b:.4g} ({what})" if not pd.isna(b) else "" for b, what in zip(shown.beside, shown.beside_is)]
        drop += ["beside_is"] + ([] if shown.beside.any() else ["beside"])
    drop += [column for column, plain in (("scale", "paper"), ("stand_in", ""), ("config", ""))
             if (shown[column] == plain).all()]
    return shown.drop(columns=drop)


def _paper_sections(name: str, comparison: pd.DataFrame, best: str) -> list[tuple[str, str, pd.DataFrame]]:
    """(kind, heading, numeric frame) for each part of paper table ``name`` (:func:`qtrain.report.paper.views`)."""
    title = _title(name)
    parts = views(comparison)
    if not parts:  # the target before any run: the published cells, ours empty
        table = load_table(name)
        published = pd.DataFrame({"row": table.row, "column": table.column, "metric": table.metric, "scale": "paper",
                                  "stand_in": "", "config": "", "paper": table.value, "ours": math.nan,
                                  "ours_std": math.nan})
        return [("paper scale", f"{title}: the paper's cells (no run here matches one yet)", published)]
    reduced = " and ".join(sorted(set(comparison.scale) - {"paper"}))
    baseline = table_baseline(load_table(name))
    against = f"against the table's {NAMES.get(baseline, baseline)} row" if baseline else "relative figures"
    headings = {
        "paper scale": f"{title}: paper and ours{best}",
        "comparable": f"{title} at {reduced} scale: {against}, ours beside the paper's{best}",
        "scale-bound": f"{title} at {reduced} scale: scale-bound absolute figures (context only: not comparable with "
                       f"the paper's){best}",
    }
    return [(kind, headings[kind], frame) for kind, frame in parts]


def _missing_note(missing: pd.DataFrame) -> str:
    """The table's cells without a run, in their two groups, each reason or command once with the rows it covers."""
    if missing.empty:
        return ""
    lines = [f"{len(missing)} of the table's cells have no run here:"]
    for group, heading in ((NOT_PRODUCED_GROUP, f"{NOT_PRODUCED_GROUP} (why)"),
                           (NOT_RUN_GROUP, f"{NOT_RUN_GROUP} (the command that makes it)")):
        cells = missing[missing.group == group]
        if cells.empty:
            continue
        lines.append(f"- {heading}: {len(cells)}")
        for why, part in cells.groupby("why", sort=False):
            rows = [f"{row} ({len(cols)} cells)" if len(cols) > 1 else f"{row}: {cols.iloc[0]}"
                    for row, cols in part.groupby("row", sort=False)["column"]]
            lines.append(f"  - {why if group == NOT_PRODUCED_GROUP else f'`{why}`'}: {'; '.join(rows)}")
    return "\n".join(lines)


# Characters of our labels and cells that LaTeX's default input encoding does not set, in math mode.
LATEX_CHARACTERS = {"±": r"$\pm$", "∆": r"$\Delta$", "−": "-", "×": r"$\times$", "≈": r"$\approx$", "·": r"$\cdot$"}


# The runs table's columns a paper prints (the rest, hardware models, status and notes, stay in the CSV and markdown).
LATEX_RUN_COLUMNS = ("method", "model", "data", "scale", "setting", "config", "runs", "test acc %",
                     "test ppl (lower is better)", "eff. MACs", "% of float32", "savings % vs baseline",
                     "Δ vs baseline, same seed")


def latex(frame: pd.DataFrame) -> str:
    """``frame`` as a LaTeX tabular (booktabs rules) scaled to the text width (``\\resizebox``: graphicx), whose
    text is escaped: ``%``, ``_``, ``&``, ``#``, ``$``, braces and the rest as LaTeX reads them, and the symbols of
    :data:`LATEX_CHARACTERS` as math."""
    text = frame.to_latex(index=False, escape=True, na_rep="-")
    for character, replacement in LATEX_CHARACTERS.items():
        text = text.replace(character, replacement)
    return "\\resizebox{\\linewidth}{!}{%\n" + text + "}\n"


def markdown(frame: pd.DataFrame) -> str:
    """``frame`` as a Markdown table whose missing figures read ``-``, as in the LaTeX and HTML exports."""
    return frame.astype(object).where(frame.notna(), None).to_markdown(index=False, missingval="-")


def _beside(path: Path, name: str) -> Path:
    return path.with_name(f"{path.stem}-{name}{path.suffix}")


def _write_html(path: Path, sections: list[tuple[str, pd.DataFrame, str]], images: list[Path]) -> None:
    parts = ["<!doctype html><meta charset='utf-8'><title>qtrain report</title>",
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:3px 6px}img{max-width:100%;margin:1em 0}</style>"]
    for heading, frame, note in sections:
        parts += [f"<h2>{html.escape(heading)}</h2>", frame.to_html(index=False, na_rep="-", border=0)]
        if note:
            parts.append(f"<pre style='white-space:pre-wrap'>{html.escape(note)}</pre>")
    from qtrain.report.figure_style import caption

    parts.append("<h2>Plots</h2>")
    for image in images:
        text = html.escape(caption(image))
        parts.append(f"<figure><img src='{html.escape(image.name)}' alt='{text}'><figcaption>{text}</figcaption></figure>")
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


def _reference_sections(args: argparse.Namespace, runs: list[Run]) -> tuple[Reference | None, list]:
    """The reference curve ``--reference`` names and the report's sections about it (none without the option)."""
    if args.reference is None:
        if args.shares_at or args.reference_from != 1 or args.gates_every != 1:
            raise ReportError("--reference-from, --shares-at and --gates-every are not allowed without --reference "
                              "(they say how the runs are compared with it)")
        return None, []
    if args.gates_every < 1:
        raise ReportError(f"--gates-every {args.gates_every} is not allowed: give a whole number from 1")
    for path in args.reference:
        if not path.is_file():
            raise ReportError(f"--reference {path} is not allowed: no such file (give a reference curve's CSV)")
    from qtrain.report.figure_style import by_config
    from qtrain.report.reference import difference_table, gates_table, load_reference, noise_floor_table, shares_table

    configs = by_config(runs)
    if len(configs) > 1:
        raise ReportError(f"--reference compares the seeds of one configuration; these runs are {len(configs)}: "
                          f"{'; '.join(configs)}")
    reference = load_reference(args.reference)
    table, summary = difference_table(runs, reference, args.reference_from)
    last = int(max(run.metrics.epoch.max() for run in runs if "epoch" in run.metrics))
    shares = shares_table(runs, reference, args.shares_at or [last])
    what = f"{next(iter(configs))}, {len(runs)} run{'s' if len(runs) > 1 else ''}"
    sections = [(f"Against the reference {reference.name} ({what}): per epoch, ours the mean over the runs",
                 table.round(3), ""),
                (f"Against the reference {reference.name}: the differences from epoch {args.reference_from}",
                 summary.round(3), "")]
    if not shares.empty:
        sections.append((f"Against the reference {reference.name}: each gated block's most chosen option", shares, ""))
    gates = gates_table(runs, reference, args.gates_every)
    if not gates.empty:
        sections.append((f"Against the reference {reference.name}: each run's gates per epoch", gates.round(3), ""))
    floor = noise_floor_table(runs, reference, args.gates_every)
    if not floor.empty:
        sections.append((f"Against the reference {reference.name}: the gate target's noise floor (the reference "
                         "against its previous epoch, the runs against each other)", floor, ""))
    return reference, sections


def report(argv: list[str] | None = None) -> str:
    """Build the report that ``argv`` asks for, write its files, and return the markdown printed."""
    args = _arguments(argv)
    baseline = _selector(args.baseline)
    names = _paper_names(args.paper)
    stand_ins = _stand_ins(args.stand_in, args.paper)
    _check_outputs(args)
    runs, twins = one_per_identity(find_runs(args.dirs))
    for data, paper_data in stand_ins.items():
        standing = [run for run in runs if run.data == data]
        if not standing:
            raise ReportError(f"--stand-in {data}={paper_data} matches no run (the runs' data: "
                              f"{', '.join(sorted({run.data for run in runs}))})")
        for run in standing:
            run.stands_in_for = paper_data
    table = summary_frame(run_frame(runs), baseline, args.aggregate)
    _check_baseline(table, baseline)
    best = " (each row: its best run)" if args.aggregate == "best" else ""
    note = (f"{len(twins)} more director{'y holds a run' if len(twins) == 1 else 'ies hold runs'} counted once above "
            f"(the same identity under another name): {', '.join(str(run.dir) for run in twins)}") if twins else ""
    sections = [(f"Runs ({len(runs)}){best}", display_frame(table), note)]
    reference, reference_sections = _reference_sections(args, runs)
    sections += reference_sections
    exports = []
    for name in names:
        comparison, missing = compare(runs, name, args.aggregate)
        parts = _paper_sections(name, comparison, best)
        for i, (_, heading, frame) in enumerate(parts):
            sections.append((heading, _paper_frame(frame), "" if i < len(parts) - 1 else _missing_note(missing)))
        exports.append((name, parts, missing))
    if args.csv:
        _write(args.csv, lambda path: table.to_csv(path, index=False))
        for name, parts, missing in exports:
            frames = [frame.assign(view=kind) for kind, _, frame in parts] + [missing.assign(view=missing.group)]
            export = pd.concat(frames).drop(columns="group")
            _write(_beside(args.csv, name), lambda path, export=export: export.to_csv(path, index=False))
    if args.latex:
        shown = display_frame(table)
        runs_table = shown[[column for column in LATEX_RUN_COLUMNS if column in shown]]
        _write(args.latex, lambda path: path.write_text(latex(runs_table)))
        for name, parts, _ in exports:
            text = "\n".join(f"% {heading}\n{latex(_paper_frame(frame))}" for _, heading, frame in parts)
            _write(_beside(args.latex, name), lambda path, text=text: path.write_text(text))
    if args.plots:
        from qtrain.report.paper_plots import write_paper_plots
        from qtrain.report.pareto import pareto_plot
        from qtrain.report.run_plots import write_plots

        images = write_plots(runs, args.plots) + pareto_plot(table, args.plots)
        if reference is not None:
            from qtrain.report.reference import reference_plot

            images += [path for path in [reference_plot(runs, reference, args.plots)] if path is not None]
        for name, parts, _ in exports:
            images += write_paper_plots(name, parts, args.plots)
        _write_html(args.plots / "report.html", sections, images)
    lines = []
    for heading, frame, note in sections:
        lines += [f"## {heading}", "", markdown(frame) if len(frame) else "(no run matches a cell)", ""]
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
