"""The accuracy-cost Pareto plot of the runs table: each configuration's mean accuracy (perplexity) against its cost
in % of float32, the frontier as a step line (:func:`pareto_plot`; the league's figures)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from qtrain.report.figure_style import (
    method_colour,
    save,
    slug,
)


def pareto_front(costs: list[float], scores: list[float]) -> list[int]:
    """The indices of the points no other point beats on both cost (lower) and score (higher), by rising cost."""
    order = sorted(range(len(costs)), key=lambda i: (costs[i], -scores[i]))
    front, best = [], -math.inf
    for i in order:
        if scores[i] > best:
            front.append(i)
            best = scores[i]
    return front


def _point_names(rows: pd.DataFrame) -> tuple[list[str], list[str]]:
    """Each row's name in a plot: its method, numbered where the method has several rows, whose settings a note
    each gives in full."""
    counts = Counter(rows.method)
    seen: Counter = Counter()
    names, notes = [], []
    for row in rows.itertuples():
        if counts[row.method] == 1:
            names.append(row.method)
            continue
        seen[row.method] += 1
        names.append(f"{row.method} #{seen[row.method]}")
        notes.append(f"{names[-1]}: {row.setting or '(defaults)'}")
    return names, notes


def pareto_plot(table: pd.DataFrame, out: Path) -> list[Path]:
    """Per model, data and scale of the runs table (:func:`qtrain.report.tables.summary_frame`): each configuration's
    mean test accuracy (a language model's: perplexity) ± std over seeds against its cost in % of float32, the
    Pareto frontier (no configuration both cheaper and better) drawn as a step line. Only configurations whose
    runs all completed are drawn (a run in progress has neither its final accuracy nor its whole cost)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for (model, data, scale), part in table[table.status == "completed"].groupby(["model", "data", "scale"], sort=False):
        language = part["test_ppl_mean"].notna().any()
        metric, what = ("test_ppl", "test perplexity (lower is better)") if language else ("test_acc", "test accuracy (%)")
        part = part[part[f"{metric}_mean"].notna() & part["percent_of_float32_mean"].notna()]
        if len(part) < 2:
            continue
        costs, means = part["percent_of_float32_mean"].tolist(), part[f"{metric}_mean"].tolist()
        front = pareto_front(costs, [-m if language else m for m in means])
        names, notes = _point_names(part)
        fig = Figure(figsize=(7.5, 5.0 + 0.14 * len(notes)), layout="constrained")
        axes = fig.add_subplot()
        offsets = _label_offsets(costs, means, language)
        for (_, row), cost, mean, name, offset in zip(part.iterrows(), costs, means, names, offsets):
            std = row[f"{metric}_std"]
            axes.errorbar([cost], [mean], yerr=None if math.isnan(std) else [std], fmt="o", capsize=3,
                          color=method_colour(row.method))
            axes.annotate(name, (cost, mean), textcoords="offset points", xytext=(4, offset), fontsize=7)
        if notes:
            axes.set_title("\n".join(notes), fontsize=6, loc="left")
        # each point on the frontier ringed, so that a frontier of one point shows too
        axes.step([costs[i] for i in front], [means[i] for i in front], where="post", color="black", linewidth=1,
                  alpha=0.6, marker="o", markersize=10, markerfacecolor="none", label="Pareto frontier")
        axes.set(xscale="log", xlabel="training cost, % of float32's effective MACs", ylabel=what,
                 **({"yscale": "log"} if language else {}))
        for axis in (axes.xaxis, axes.yaxis) if language else (axes.xaxis,):
            _readable_log_ticks(axis)
        axes.grid(alpha=0.3, which="both")
        axes.legend(fontsize=8)
        title = f"{model} on {data}" + ("" if scale == "paper" else f" at {scale} scale")
        fig.suptitle(f"accuracy against cost: {title}\n(point: mean over seeds, bar: ± std)", fontsize=10)
        name = f"{model}-{data}" + ("" if scale == "paper" else f"-{scale}")  # a plain run is at no scale's
        written.append(save(fig, out / f"pareto-{slug(name)}.png"))
    return written


def _readable_log_ticks(axis) -> None:
    """Labels at 1, 2 and 5 of each decade only: the minor ticks' own labels (2, 3, 4 ... x 10^k) collide."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def _label_offsets(costs: list[float], values: list[float], log_y: bool) -> list[int]:
    """Each point label's vertical offset in points: 3 above the point, moved down a line at a time while it would
    sit on a label already placed near it (within a twelfth of the log-cost range and a thirtieth of the values')."""
    xs = [math.log10(c) for c in costs]
    ys = [math.log10(v) for v in values] if log_y else list(values)
    x_span, y_span = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    placed: list[tuple[float, float, int]] = []
    offsets = []
    for x, y in zip(xs, ys):
        offset = 3
        while any(abs(x - px) < x_span / 12 and abs(y - py) < y_span / 30 and offset == po for px, py, po in placed):
            offset -= 9
        placed.append((x, y, offset))
        offsets.append(offset)
    return offsets
