"""``--paper``'s figures: ours against the paper's, one point per table cell, and accuracy against cost with an arrow
from the paper's point to ours (:func:`write_paper_plots`). docs/reports.md ("Paper mode")."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from qtrain.report.figure_style import (
    PALETTE,
    save,
)


def _plottable(frame: pd.DataFrame) -> pd.DataFrame:
    """The cells of a comparison view with a finite value of the paper's and of ours."""
    return frame[frame.paper.abs().lt(math.inf) & frame.ours.abs().lt(math.inf)]  # NaN compares false


def paper_figure(frame: pd.DataFrame, title: str) -> Figure | None:
    """Ours against the paper's, one point per cell of a ``--paper`` comparison view (``paper.views``): one panel per
    figure (``figure``, or ``metric`` at paper scale: panels do not share units), the paper's value across, ours
    up with its seeds' standard deviation as a bar, the line on which ours equals the paper's, and each point
    numbered, the numbers' rows and columns listed under the panel. None when no cell has both values."""
    kind = "figure" if "figure" in frame else "metric"
    shown = _plottable(frame)
    if shown.empty:
        return None
    if kind == "figure":  # a difference in perplexity is not one in accuracy: a panel of its own
        shown = shown.assign(figure=[f"{figure} (perplexity)" if "perplexity" in metric else figure
                                     for figure, metric in zip(shown.figure, shown.metric)])
    panels = list(dict.fromkeys(shown[kind]))
    columns = min(len(panels), 3)
    rows = -(-len(panels) // columns)
    fig = Figure(figsize=(5.2 * columns, 6.0 * rows), layout="constrained")
    for i, name in enumerate(panels):
        axes = fig.add_subplot(rows, columns, i + 1)
        cells = shown[shown[kind] == name].reset_index(drop=True)
        std = cells.ours_std.fillna(0.0) if "ours_std" in cells else None
        axes.errorbar(cells.paper, cells.ours, yerr=std, fmt="o", color=PALETTE[0], ecolor="grey", capsize=3)
        low, high = min(cells.paper.min(), cells.ours.min()), max(cells.paper.max(), cells.ours.max())
        pad = 0.08 * (high - low) or 1.0
        near = ((cells[["paper", "ours"]] - low) / (high - low + 2 * pad) * 100).round()  # 1 % of the axes apart
        for _, same in cells.groupby([near.paper, near.ours], sort=False):  # one label for points that coincide
            axes.annotate(",".join(str(n + 1) for n in same.index), (same.paper.iloc[0], same.ours.iloc[0]),
                          fontsize=7, xytext=(4, 3), textcoords="offset points")
        axes.plot([low - pad, high + pad], [low - pad, high + pad], color="black", linestyle=":", linewidth=0.8,
                  label="ours = paper")
        axes.set(xlabel=f"paper: {name}", ylabel=f"qtrain: {name}", xlim=(low - pad, high + pad),
                 ylim=(low - pad, high + pad), aspect="equal")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7, loc="upper left")
        key = "\n".join(f"{n + 1}: {cell.row} | {cell.column}" for n, cell in cells.iterrows())
        axes.text(0.0, -0.16, key, transform=axes.transAxes, fontsize=6.5, va="top")
    fig.suptitle(f"{title}\n(bar: standard deviation over seeds; dotted: ours equal to the paper's)", fontsize=10)
    return fig


ACCURACY_FIGURES = ("test_acc", "best_test_acc", "acc_drop", "acc_delta_vs_sbm")  # a paper cell's metric


COST_FIGURES = ("quantized_macs", "effective_macs", "effective_macs_at_best", "savings_vs_sbm_percent")


def _setting(column: str) -> str:
    """The setting a paper column belongs to, where its table has several (``Adaptation / MACs``: ``Adaptation``)."""
    return column.rpartition(" / ")[0]


def _axis_name(cells: list[pd.Series], kind: str) -> str:
    """An axis's name: the column its cells share, else the figure after each one's setting (``Adaptation / MACs``
    and ``Fine-tuning / MACs``: ``MACs``), then their unit (``kind``)."""
    columns = list(dict.fromkeys(cell.column for cell in cells))
    names = columns if len(columns) == 1 else list(dict.fromkeys(column.rpartition(" / ")[2] for column in columns))
    return f"{' | '.join(names)}: {cells[0][kind]}"


def paper_accuracy_cost_figure(frame: pd.DataFrame, title: str) -> Figure | None:
    """Accuracy against training cost, the paper's point and ours for each row of a ``--paper`` comparison view
    that has both (at a reduced scale each against the table's baseline: accuracy difference, cost saved): the
    paper's hollow, ours filled in the row's colour, an arrow from the paper's to ours. A row whose figures are an
    earlier row's again (FracTrain's "Improv." row: FracTrain against SBM, at a reduced scale) is drawn once, as the
    earlier row; in a table of several settings each point names its setting. None when no row has both."""
    shown = _plottable(frame)
    kind = "figure" if "figure" in shown else "metric"
    points = []
    for (row, config), cells in shown.groupby(["row", shown.scale + " " + shown.config.fillna("")], sort=False):
        accuracy = cells[cells.metric.isin(ACCURACY_FIGURES)]
        cost = cells[cells.metric.isin(COST_FIGURES)]
        if len(accuracy) and len(cost):
            name = config if shown.scale.nunique() > 1 else config.split(" ", 1)[1]  # the scale where several are
            points.append((row, name, cost.iloc[0], accuracy.iloc[0]))
    if not points:
        return None
    # one pair of units on the axes: the most common (a paper-scale table's absolute rows beside its relative ones)
    units = [(cost[kind], accuracy[kind]) for _, _, cost, accuracy in points]
    common = Counter(units).most_common(1)[0][0]
    points = [point for point, pair in zip(points, units) if pair == common]
    ours = [(name, cost.ours, accuracy.ours) for _, name, cost, accuracy in points]
    points = [point for i, point in enumerate(points) if ours[i] not in ours[:i]]
    several = len({_setting(cost.column) for _, _, cost, _ in points}) > 1
    fig = Figure(figsize=(7.5, 5.5), layout="constrained")
    axes = fig.add_subplot()
    for i, (row, name, cost, accuracy) in enumerate(points):
        colour = PALETTE[i % len(PALETTE)]
        heading = f"{row} / {_setting(cost.column)}" if several else row
        axes.plot(cost.paper, accuracy.paper, "o", markerfacecolor="none", markeredgecolor=colour, markersize=9)
        axes.plot(cost.ours, accuracy.ours, "o", color=colour, markersize=7, label=f"{heading} {name}".strip())
        axes.annotate("", (cost.ours, accuracy.ours), (cost.paper, accuracy.paper),
                      arrowprops={"arrowstyle": "->", "color": colour, "alpha": 0.6})
    axes.set(xlabel=_axis_name([cost for _, _, cost, _ in points], kind),
             ylabel=_axis_name([accuracy for _, _, _, accuracy in points], kind))
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.suptitle(f"{title}\n(hollow: the paper's, filled: qtrain's, arrow: from the paper's to ours)", fontsize=10)
    return fig


def write_paper_plots(name: str, parts: list[tuple[str, str, pd.DataFrame]], out: Path) -> list[Path]:
    """The paper figures of table ``name``'s comparison views (``parts``: kind, heading, frame) as PNG files in
    ``out``, ``paper-NAME-VIEW.png`` and ``paper-NAME-VIEW-accuracy-cost.png``; a reduced scale's absolute figures
    (the "scale-bound" view) are not compared with the paper's."""
    written = []
    for kind, heading, frame in parts:
        if kind == "scale-bound":
            continue
        stem = f"paper-{name}-{kind.replace(' ', '-')}"
        for draw, suffix in ((paper_figure, ""), (paper_accuracy_cost_figure, "-accuracy-cost")):
            fig = draw(frame, heading)
            if fig is not None:
                written.append(save(fig, out / f"{stem}{suffix}.png"))
    return written
