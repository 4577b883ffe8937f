"""The runs' figures, drawn from their CSV files: per group of runs, learning curves, accuracy against cumulative cost
and each hardware model's time, DYNASTY's average bit-width, PFQ's turning points; per run, precision and sparsity
per layer over time and the bit allocation per block (:func:`write_plots`). docs/reports.md ("Plots")."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from qtrain.catalog import ALLOCATING, HARDWARE
from qtrain.report.figure_style import (
    SEEDS_NOTE,
    Group,
    by_config,
    config_lines,
    epoch_ticks,
    groups,
    label,
    legend,
    method_colour,
    option_name,
    run_slug,
    save,
    seed_marker,
    share_colour,
)
from qtrain.report.runs import Run

OPERANDS = (("weight_bits", "weight"), ("act_bits", "activation"), ("grad_bits", "gradient"),
            ("grad_weight_bits", "weight-gradient"))


def _layer_lines(axes, frame: pd.DataFrame, y: str, layers: list[str]) -> ScalarMappable:
    """One line per layer of ``frame[y]`` over epochs, coloured by depth; returns the colour scale for a colour bar."""
    scale = ScalarMappable(Normalize(0, max(len(layers) - 1, 1)), colormaps["viridis"])
    for i, layer in enumerate(layers):
        part = frame[frame.layer == layer].sort_values("epoch")
        axes.plot(part.epoch, part[y], "-", marker=".", markersize=3, color=scale.to_rgba(i), linewidth=1.2)
    epoch_ticks(axes)
    axes.grid(alpha=0.3)
    return scale


def _colour_bar(fig: Figure, scale: ScalarMappable, axes_list: list) -> None:
    bar = fig.colorbar(scale, ax=axes_list, label="layer (0 = first)", shrink=0.9)
    bar.locator = MaxNLocator(integer=True)  # layers are counted, not measured
    bar.update_ticks()


def _epoch_rows(precision: pd.DataFrame) -> pd.DataFrame:
    """The rows of what each epoch trained at, without a method's event rows (a file from before events: all)."""
    return precision[precision.event == "epoch"] if "event" in precision else precision


def _average_bits(precision: pd.DataFrame, column: str) -> pd.DataFrame:
    """Per (epoch, layer): the share-weighted bits of ``column``, work a layer skipped counting as 0 bits.

    The record's options cover the work a layer did; what they leave uncovered (DFQ's skipped blocks,
    DYNASTY's 0-bit blocks) cost nothing, so the mean is over all of the layer's work.
    """
    rows = _epoch_rows(precision).dropna(subset=[column])
    share = rows["share"].fillna(1.0) if "share" in rows else pd.Series(1.0, index=rows.index)
    rows = rows.assign(bits=rows[column] * share)
    # rounded: shares adding up to 1 at one width sum to within a few ulps of it (8 x (0.2 + 0.7 + 0.1) is not 8)
    return rows.groupby(["epoch", "layer"], sort=False)["bits"].sum().round(6).reset_index()


def _layer_order(precision: pd.DataFrame) -> list[str]:
    """The layers in the model's order, as the epoch rows give them (a method's event rows come first in a file)."""
    return list(dict.fromkeys(_epoch_rows(precision).layer))


def precision_plot(run: Run, out: Path, peers: list[Run]) -> Path | None:
    """Average bits per layer over epochs, one panel per operand (AdaPT's word length is its weight bits)."""
    precision = run.precision
    if precision.empty or "layer" not in precision:
        return None
    layers = _layer_order(precision)
    panels = [(_average_bits(precision, column), name) for column, name in OPERANDS if column in precision]
    panels = [(frame, name) for frame, name in panels if not frame.empty]
    # an operand at one width in every layer and epoch is a flat line: named in the title, not drawn
    widths = {name: frame.bits.unique() for frame, name in panels}
    fixed = ", ".join(f"{name} {found[0]:g}" for name, found in widths.items() if len(found) == 1)
    panels = [(frame, name) for frame, name in panels if len(widths[name]) > 1]
    if not panels:
        return None
    fig = Figure(figsize=(7.5, 2.4 * len(panels) + (0.4 if fixed else 0)), layout="constrained")
    axes_list = []
    for i, (frame, name) in enumerate(panels):
        axes = fig.add_subplot(len(panels), 1, i + 1)
        scale = _layer_lines(axes, frame, "bits", layers)
        axes.set_ylabel(f"{name} bits")
        axes_list.append(axes)
    axes.set_xlabel("epoch")
    _colour_bar(fig, scale, axes_list)
    title = f"precision per layer (average over each epoch's work): {label(run, peers)}, {run.model} on {run.data}"
    fig.suptitle(title + (f"\nbits in every layer and epoch: {fixed}" if fixed else ""), fontsize=10)
    return save(fig, out / f"precision-{run_slug(run)}.png")


def sparsity_plot(run: Run, out: Path, peers: list[Run]) -> Path | None:
    """The share of zero weights in each layer at each epoch's end (only where some layer is sparse)."""
    precision = run.precision
    if precision.empty or "density" not in precision or not (precision.density.dropna() < 1).any():
        return None
    frame = precision.dropna(subset=["density"]).drop_duplicates(["epoch", "layer"], keep="last")
    frame = frame.assign(sparsity=100.0 * (1.0 - frame.density))
    fig = Figure(figsize=(7.5, 3), layout="constrained")
    axes = fig.add_subplot()
    _colour_bar(fig, _layer_lines(axes, frame, "sparsity", _layer_order(precision)), [axes])
    axes.set(xlabel="epoch", ylabel="sparsity (% zero weights)")
    fig.suptitle(f"sparsity per layer: {label(run, peers)}, {run.model} on {run.data}", fontsize=10)
    return save(fig, out / f"sparsity-{run_slug(run)}.png")


# the panels of a learning curve: (metrics column, axis label, scale); a panel is drawn where a run has its column
CURVE_PANELS = (("train_loss", "training loss (the epoch's mean)", 1.0), ("test_loss", "test loss", 1.0),
                ("train_acc", "training accuracy (%)", 100.0), ("test_acc", "test accuracy (%)", 100.0),
                ("test_ppl", "test perplexity", 1.0))


def learning_curve_plot(group: Group, out: Path) -> Path | None:
    """Loss and accuracy (a language model's: perplexity), training and test, against the epoch."""
    panels = [(y, name, scale) for y, name, scale in CURVE_PANELS if any(y in run.metrics for run in group.runs)]
    if not panels:
        return None
    fig = Figure(figsize=(4.2 * len(panels), 4.0), layout="constrained")
    drawn = []
    for i, (y, name, scale) in enumerate(panels):
        axes = fig.add_subplot(1, len(panels), i + 1)
        if config_lines(group.runs, axes, "epoch", y, scale):
            axes.set(xlabel="epoch", ylabel=name, **({"yscale": "log"} if y == "test_ppl" else {}))
            epoch_ticks(axes)
            axes.grid(alpha=0.3)
            drawn.append(axes)
    if not drawn:
        return None
    legend(fig, drawn)
    fig.suptitle(f"learning curves: {group.title}{SEEDS_NOTE}", fontsize=10)
    return save(fig, out / f"learning-curves-{group.slug}.png")


def accuracy_cost_plot(group: Group, out: Path) -> Path | None:
    """Test accuracy (a language model's: perplexity) against cumulative effective MACs and each hardware model's time."""
    xs = [("effective_macs", "cumulative effective MACs (float32-equivalent)")] + [
        (f"{model}_seconds", f"cumulative {name} time (s)") for model, name in HARDWARE]
    # a hardware model leaves float formats unpriced (NaN): a panel where no run has a figure is left out
    xs = [(x, name) for x, name in xs if any(x in run.metrics and run.metrics[x].notna().any() for run in group.runs)]
    if not xs:
        return None
    language = any("test_ppl" in run.metrics for run in group.runs)
    score, scale, what = ("test_ppl", 1.0, "test perplexity (lower is better)") if language else \
        ("test_acc", 100.0, "test accuracy (%)")
    fig = Figure(figsize=(5.5 * len(xs), 4.4), layout="constrained")
    panels = []
    for i, (x, name) in enumerate(xs):
        axes = fig.add_subplot(1, len(xs), i + 1)
        if not config_lines(group.runs, axes, x, score, scale):
            return None
        axes.set(xscale="log", xlabel=name, ylabel=what, **({"yscale": "log"} if language else {}))
        axes.grid(alpha=0.3, which="both")
        panels.append(axes)
    legend(fig, panels)
    fig.suptitle(f"{'perplexity' if language else 'accuracy'} against training cost: {group.title}{SEEDS_NOTE}", fontsize=10)
    return save(fig, out / f"accuracy-cost-{group.slug}.png")


def _option_shares(precision: pd.DataFrame) -> tuple[pd.DataFrame, str] | None:
    """The last epoch's share of each precision option per layer (rows: layers), and what the shares are of.

    DYNASTY's ``bitmap`` rows give each block width's share of the weight map's work; the per-option rows
    of a method that mixes precisions per sample (DFQ, FracTrain) give each FW/BW option's share of the
    samples, the rest being skipped blocks.
    """
    last = precision[precision.epoch == precision.epoch.max()]
    if "event" in last:  # the training epoch's shares, not the evaluation's or the gates' probabilities
        last = last[~last.event.astype(str).str.startswith("gates_")]
    if "event" in last and (last.event == "bitmap").any():
        maps = last[(last.event == "bitmap") & (last.operand == "weight")].set_index("layer")
        columns = sorted((c for c in maps if re.fullmatch(r"share_\d+bit", c)), key=lambda c: int(c[6:-3]))
        shares = maps[columns].rename(columns=lambda c: f"{c[6:-3]} bits")
        return shares, "share of the weight blocks' work (%)"
    if "share" not in last or "act_bits" not in last:
        return None
    rows = last[(last.format != "float32") & last.share.notna()].dropna(subset=["act_bits", "grad_bits"])
    if rows.empty or rows.groupby("layer").size().max() < 2:  # one precision per layer: nothing is allocated
        return None
    rows = rows.assign(option=[option_name(a, g) for a, g in zip(rows.act_bits, rows.grad_bits)])
    shares = rows.pivot_table(index="layer", columns="option", values="share", aggfunc="sum", sort=False).fillna(0.0)
    shares = shares[sorted(shares.columns, key=lambda o: [float(v) for v in re.findall(r"[\d.]+", o)])]
    shares["skipped"] = (1.0 - shares.sum(axis=1)).clip(lower=0.0)
    return shares, "share of samples (%)"


def bit_allocation_plot(run: Run, out: Path, peers: list[Run]) -> Path | None:
    """The last epoch's share of each precision option per layer, skipped work included (FracTrain Fig. 8).

    Drawn for the methods that allocate precision per sample or per block; a method that switches in time
    (AdaPT, MuPPET, PFQ) mixes options within an epoch too, which the precision plot shows instead.
    """
    found = None if run.method not in ALLOCATING or run.precision.empty else _option_shares(run.precision)
    if found is None:
        return None
    shares, what = found
    fig = Figure(figsize=(max(6.0, 0.3 * len(shares) + 2), 4.4), layout="constrained")
    axes = fig.add_subplot()
    bottom = pd.Series(0.0, index=shares.index)
    for option in shares.columns:
        axes.bar(range(len(shares)), 100.0 * shares[option], bottom=100.0 * bottom, color=share_colour(option),
                 label=option)
        bottom += shares[option]
    axes.set_xticks(range(len(shares)), shares.index, rotation=90, fontsize=7)
    axes.set(ylabel=what, xlabel="layer", ylim=(0, 100))
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"bit allocation per layer, epoch {int(run.precision.epoch.max())}: {label(run, peers)}, "
                 f"{run.model} on {run.data}", fontsize=10)
    return save(fig, out / f"allocation-{run_slug(run)}.png")


def average_bits_plot(group: Group, out: Path) -> Path | None:
    """DYNASTY's average bit-width per epoch, with each run's target dotted (DYNASTY Fig. 5)."""
    fig = Figure(figsize=(6.5, 4), layout="constrained")
    axes = fig.add_subplot()
    chosen = [run for run in group.runs if "dynasty_average_bits" in run.metrics]
    if not config_lines(chosen, axes, "epoch", "dynasty_average_bits"):
        return None
    for target in sorted({run.get("method.target_bits") for run in chosen} - {None}):
        axes.axhline(target, color="black", linestyle=":", linewidth=0.8)
    axes.set(xlabel="epoch", ylabel="average bits per block (weights x activations)")
    epoch_ticks(axes)
    axes.grid(alpha=0.3)
    legend(fig, [axes])  # below the panel: a configuration's label can be wider than the panel
    fig.suptitle(f"average bit-width over epochs (dotted: targets): {group.title}{SEEDS_NOTE}", fontsize=10)
    return save(fig, out / f"average-bits-{group.slug}.png")


def turning_points_plot(group: Group, out: Path) -> Path | None:
    """The training loss per epoch of PFQ/FracTrain runs, a vertical line where the precision stage rose."""
    chosen = [run for run in group.runs if "stage" in run.metrics and not run.metrics.empty]
    if not chosen:
        return None
    fig = Figure(figsize=(6.5, 4), layout="constrained")
    axes = fig.add_subplot()
    config_lines(chosen, axes, "epoch", "train_loss")
    for members in by_config(chosen).values():
        for i, run in enumerate(members):
            metrics = run.metrics
            rises = metrics[metrics.stage.diff() > 0]
            axes.plot(rises.epoch, rises.train_loss, linestyle="none", marker=seed_marker(i), markersize=11,
                      markerfacecolor="none", markeredgewidth=1.6, color=method_colour(run.method))
    axes.set(xlabel="epoch", ylabel="training loss")
    epoch_ticks(axes)
    axes.grid(alpha=0.3)
    legend(fig, [axes])
    fig.suptitle(f"training loss (large hollow marker: the first epoch of a new precision stage, in the seed's "
                 f"shape): {group.title}{SEEDS_NOTE}", fontsize=10)
    return save(fig, out / f"loss-turning-points-{group.slug}.png")


PER_RUN: tuple[Callable[[Run, Path, list[Run]], Path | None], ...] = (precision_plot, sparsity_plot, bit_allocation_plot)


ACROSS_RUNS: tuple[Callable[[Group, Path], Path | None], ...] = (learning_curve_plot, accuracy_cost_plot,
                                                                      average_bits_plot, turning_points_plot)


def write_plots(runs: list[Run], out: Path) -> list[Path]:
    """Every figure the runs have data for, as PNG files in ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = [plot(group, out) for group in groups(runs) for plot in ACROSS_RUNS]
    written += [plot(run, out, runs) for run in runs for plot in PER_RUN]
    return [path for path in written if path is not None]
