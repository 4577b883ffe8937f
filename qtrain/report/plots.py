"""The report's figures, as PNG files (matplotlib), each drawn from the run directories' CSV files.

Learning curves (loss and accuracy against the epoch), precision and sparsity per layer over time, accuracy
against cumulative cost and each hardware model's time, bit allocation per block, average bit-width, the training
loss with PFQ's turning points, and with ``--paper`` ours against the paper's cells. One method has one colour in
every figure (:func:`method_colour`), a configuration a shade and line style of it, a seed a marker shape
(:func:`seed_marker`). docs/reports.md ("Plots") lists the figures and how seeds and configurations are drawn.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pandas as pd
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from omegaconf import OmegaConf

from qtrain.catalog import ALLOCATING, HARDWARE, METHOD_NAMES
from qtrain.report.runs import Run
from qtrain.report.tables import run_frame, setting
from qtrain.resources import conf_dir

_PALETTE = colormaps["tab10"].colors + colormaps["Dark2"].colors  # tab10's first, so older figures keep their colours
OPERANDS = (("weight_bits", "weight"), ("act_bits", "activation"), ("grad_bits", "gradient"),
            ("grad_weight_bits", "weight-gradient"))


@dataclass
class Group:
    """Runs drawn in one figure: the same model, data and training config (a sweep over methods and seeds)."""

    runs: list[Run]
    title: str  # "resnet20 on cifar10" and the config that sets the group apart
    slug: str


def groups(runs: list[Run]) -> list[Group]:
    """The report's runs split by model, data, scale and the config keys that vary between them (``tables.run_frame``)."""
    frame = run_frame(runs)
    found = []
    for (model, data, scale, config), part in frame.groupby(["model", "data", "scale", "config"], sort=False):
        members = [runs[i] for i in part.index]
        title = f"{model} on {data}" + ("" if scale == "paper" else f" at {scale} scale") + (f", {config}" if config else "")
        digest = hashlib.sha256(f"{scale} {config}".encode()).hexdigest()[:6]
        found.append(Group(members, title, _slug(f"{model}-{data}-{digest}")))
    return found


def method_colour(method: str) -> tuple[float, float, float]:
    """The colour of ``method`` in every figure (a method qtrain does not know gets grey)."""
    return _PALETTE[METHOD_NAMES.index(method)] if method in METHOD_NAMES else (0.5, 0.5, 0.5)


def config_label(run: Run, peers: list[Run]) -> str:
    """A configuration's name in legends: its method and setting (among ``peers``, the figure's runs)."""
    return " ".join(part for part in (run.method, setting(run, peers)) if part)


def label(run: Run, peers: list[Run]) -> str:
    """A run's name in titles: its method, setting (among ``peers``) and seed."""
    return f"{config_label(run, peers)} seed {run.seed}"


SEED_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
SEEDS_NOTE = "\n(line: mean over seeds, band: min-max over seeds, marker shape: the seed)"


def seed_marker(i: int) -> str:
    """The marker of a configuration's ``i``-th seed (in seed order) in every figure."""
    return SEED_MARKERS[i % len(SEED_MARKERS)]


@cache
def _configured_options() -> tuple[tuple[float, float], ...]:
    """Every FW/BW option of the models' DFQ/FracTrain option lists (conf/model/*.yaml), skipping (0/0) aside."""
    found = set()
    for path in (conf_dir() / "model").glob("*.yaml"):
        options = OmegaConf.load(path).get("dfq_options")
        found.update((float(fw), float(bw)) for fw, bw in options or [] if fw or bw)
    return tuple(sorted(found))


def share_colour(option: str) -> tuple[float, ...]:
    """The colour of a precision option in every allocation plot: an ``FW4/BW12`` pair of the configured ones by
    its place among them, another by its bits; a DYNASTY width (``4 bits``) by its bits; skipped work grey."""
    if option == "skipped":
        return (0.85, 0.85, 0.85, 1.0)
    bits = [float(v) for v in re.findall(r"[\d.]+", option)]
    if len(bits) == 2:
        known = _configured_options()
        if tuple(bits) in known:
            return colormaps["tab10"](known.index(tuple(bits)) % 10)
        return colormaps["cividis"](min((bits[0] + bits[1]) / 48.0, 1.0))
    return colormaps["viridis"](min(bits[0] / 16.0, 1.0))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9=.-]+", "_", text).strip("_")[:120]


def _run_slug(run: Run) -> str:
    """A run's figures are named by its method, model, data and run id (its directory's digest where it has none)."""
    digest = run.run_id or hashlib.sha256(str(run.dir.resolve()).encode()).hexdigest()[:8]
    return f"{_slug(f'{run.method}-{run.model}-{run.data}')}-id={digest}"


CAPTION_KEY = "Description"  # the PNG text field that holds a figure's caption (report.html shows it)


def _save(fig: Figure, path: Path) -> Path:
    """The figure as a PNG whose caption (its title: what it shows, of which runs) travels in the file."""
    text = " ".join(fig.get_suptitle().split())
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={CAPTION_KEY: text})
    return path


def caption(path: Path) -> str:
    """The caption :func:`_save` wrote into a PNG, or its file name."""
    from PIL import Image

    with Image.open(path) as image:
        return image.info.get(CAPTION_KEY) or path.stem


def _layer_lines(axes, frame: pd.DataFrame, y: str, layers: list[str]) -> ScalarMappable:
    """One line per layer of ``frame[y]`` over epochs, coloured by depth; returns the colour scale for a colour bar."""
    scale = ScalarMappable(Normalize(0, max(len(layers) - 1, 1)), colormaps["viridis"])
    for i, layer in enumerate(layers):
        part = frame[frame.layer == layer].sort_values("epoch")
        axes.plot(part.epoch, part[y], "-", marker=".", markersize=3, color=scale.to_rgba(i), linewidth=1.2)
    axes.xaxis.get_major_locator().set_params(integer=True, min_n_ticks=1)  # epochs: no tick at 1.2
    axes.grid(alpha=0.3)
    return scale


def _colour_bar(fig: Figure, scale: ScalarMappable, axes_list: list) -> None:
    fig.colorbar(scale, ax=axes_list, label="layer (0 = first)", shrink=0.9)


def _average_bits(precision: pd.DataFrame, column: str) -> pd.DataFrame:
    """Per (epoch, layer): the share-weighted bits of ``column``, work a layer skipped counting as 0 bits.

    The record's options cover the work a layer did; what they leave uncovered (DFQ's skipped blocks,
    DYNASTY's 0-bit blocks) cost nothing, so the mean is over all of the layer's work.
    """
    rows = precision[precision.event == "epoch"] if "event" in precision else precision
    rows = rows.dropna(subset=[column])
    share = rows["share"].fillna(1.0) if "share" in rows else pd.Series(1.0, index=rows.index)
    rows = rows.assign(bits=rows[column] * share)
    return rows.groupby(["epoch", "layer"], sort=False)["bits"].sum().reset_index()


def precision_plot(run: Run, out: Path, peers: list[Run]) -> Path | None:
    """Average bits per layer over epochs, one panel per operand (AdaPT's word length is its weight bits)."""
    precision = run.precision
    if precision.empty or "layer" not in precision:
        return None
    layers = list(dict.fromkeys(precision.layer))
    panels = [(_average_bits(precision, column), name) for column, name in OPERANDS if column in precision]
    panels = [(frame, name) for frame, name in panels if not frame.empty]
    if not panels or all(frame.bits.nunique() == 1 for frame, _ in panels):  # one width throughout: nothing to plot
        return None
    fig = Figure(figsize=(7.5, 2.4 * len(panels)), layout="constrained")
    axes_list = []
    for i, (frame, name) in enumerate(panels):
        axes = fig.add_subplot(len(panels), 1, i + 1)
        scale = _layer_lines(axes, frame, "bits", layers)
        axes.set_ylabel(f"{name} bits")
        axes_list.append(axes)
    axes.set_xlabel("epoch")
    _colour_bar(fig, scale, axes_list)
    fig.suptitle(f"precision per layer (average over each epoch's work): {label(run, peers)}, {run.model} on {run.data}",
                 fontsize=10)
    return _save(fig, out / f"precision-{_run_slug(run)}.png")


def sparsity_plot(run: Run, out: Path, peers: list[Run]) -> Path | None:
    """The share of zero weights in each layer at each epoch's end (only where some layer is sparse)."""
    precision = run.precision
    if precision.empty or "density" not in precision or not (precision.density.dropna() < 1).any():
        return None
    frame = precision.dropna(subset=["density"]).drop_duplicates(["epoch", "layer"], keep="last")
    frame = frame.assign(sparsity=100.0 * (1.0 - frame.density))
    fig = Figure(figsize=(7.5, 3), layout="constrained")
    axes = fig.add_subplot()
    _colour_bar(fig, _layer_lines(axes, frame, "sparsity", list(dict.fromkeys(precision.layer))), [axes])
    axes.set(xlabel="epoch", ylabel="sparsity (% zero weights)")
    fig.suptitle(f"sparsity per layer: {label(run, peers)}, {run.model} on {run.data}", fontsize=10)
    return _save(fig, out / f"sparsity-{_run_slug(run)}.png")


def _legend(fig: Figure, axes_list: list) -> None:
    """One legend below the figure for the lines of every panel."""
    entries: dict[str, object] = {}
    for axes in axes_list:
        for handle, text in zip(*axes.get_legend_handles_labels()):
            entries.setdefault(text, handle)
    fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=min(3, len(entries)), fontsize=8)


def by_config(runs: list[Run]) -> dict[str, list[Run]]:
    """The runs by configuration (:func:`config_label`), each configuration's in seed order."""
    found: dict[str, list[Run]] = {}
    for run in runs:
        found.setdefault(config_label(run, runs), []).append(run)
    return {name: sorted(members, key=lambda run: (run.seed is None, run.seed or 0)) for name, members in found.items()}


LINE_STYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))


def config_style(method: str, name: str, configs: dict[str, list[Run]]) -> tuple[tuple[float, ...], object]:
    """The colour and line style of configuration ``name`` among ``configs``: its method's colour, shaded from dark
    to light over the method's configurations (a sweep of one method), each with a line style of its own."""
    mine = [other for other, members in configs.items() if members[0].method == method]
    k, n = mine.index(name), len(mine)
    shade = 0.0 if n == 1 else -0.45 + 0.9 * k / (n - 1)  # below 0 towards black, above towards white
    base = method_colour(method)
    colour = tuple(c * (1 + shade) if shade < 0 else c + (1 - c) * shade for c in base)
    return colour, LINE_STYLES[k % len(LINE_STYLES)]


def _config_lines(runs: list[Run], axes, x: str, y: str, scale_y: float = 1.0) -> bool:
    """Per configuration, in its method's colour (:func:`config_style`): the mean over its seeds of ``metrics[y]``
    over ``metrics[x]`` (epoch by epoch) as a line, the min-max band over the seeds, and each seed's points in its
    marker; a configuration of one seed is its line. False if no run has both columns."""
    drawn, seeds = False, 0
    configs = by_config(runs)
    for name, members in configs.items():
        frames = [run.metrics[[x, y]].assign(at=run.metrics.epoch).dropna().assign(seed=i) for i, run in enumerate(members)
                  if not run.metrics.empty and {"epoch", x, y} <= set(run.metrics)]
        frames = [frame for frame in frames if not frame.empty]
        if not frames:
            continue
        colour, style = config_style(members[0].method, name, configs)
        for frame in frames:
            axes.plot(frame[x], frame[y] * scale_y, linestyle="none", marker=seed_marker(int(frame.seed.iloc[0])),
                      markersize=4, color=colour, alpha=0.8)
        epochs = pd.concat(frames).groupby("at")
        mean, low, high = epochs[[x, y]].mean(), epochs[y].min(), epochs[y].max()
        many = len(frames) > 1
        axes.plot(mean[x], mean[y] * scale_y, linestyle=style, color=colour, linewidth=1.5,
                  label=f"{name} (mean of {len(frames)} seeds)" if many else f"{name} seed {members[0].seed}")
        if many:
            axes.fill_between(mean[x], low * scale_y, high * scale_y, color=colour, alpha=0.2, linewidth=0)
        seeds = max(seeds, len(frames))
        drawn = True
    for i in range(seeds if seeds > 1 else 0):  # what each marker shape stands for, once
        axes.plot([], [], linestyle="none", marker=seed_marker(i), color="black", markersize=4,
                  label=f"seed #{i + 1} of a configuration")
    return drawn


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
        if _config_lines(group.runs, axes, "epoch", y, scale):
            axes.set(xlabel="epoch", ylabel=name, **({"yscale": "log"} if y == "test_ppl" else {}))
            axes.xaxis.get_major_locator().set_params(integer=True, min_n_ticks=1)
            axes.grid(alpha=0.3)
            drawn.append(axes)
    if not drawn:
        return None
    _legend(fig, drawn)
    fig.suptitle(f"learning curves: {group.title}{SEEDS_NOTE}", fontsize=10)
    return _save(fig, out / f"learning-curves-{group.slug}.png")


def accuracy_cost_plot(group: Group, out: Path) -> Path | None:
    """Test accuracy (a language model's: perplexity) against cumulative effective MACs and each hardware model's time."""
    xs = [("effective_macs", "cumulative effective MACs (float32-equivalent)")] + [
        (f"{model}_seconds", f"cumulative {name} time (s)") for model, name in HARDWARE]
    xs = [(x, name) for x, name in xs if any(x in run.metrics for run in group.runs)]
    if not xs:
        return None
    language = any("test_ppl" in run.metrics for run in group.runs)
    score, scale, what = ("test_ppl", 1.0, "test perplexity (lower is better)") if language else \
        ("test_acc", 100.0, "test accuracy (%)")
    fig = Figure(figsize=(5.5 * len(xs), 4.4), layout="constrained")
    panels = []
    for i, (x, name) in enumerate(xs):
        axes = fig.add_subplot(1, len(xs), i + 1)
        if not _config_lines(group.runs, axes, x, score, scale):
            return None
        axes.set(xscale="log", xlabel=name, ylabel=what, **({"yscale": "log"} if language else {}))
        axes.grid(alpha=0.3, which="both")
        panels.append(axes)
    _legend(fig, panels)
    fig.suptitle(f"{'perplexity' if language else 'accuracy'} against training cost: {group.title}{SEEDS_NOTE}", fontsize=10)
    return _save(fig, out / f"accuracy-cost-{group.slug}.png")


def option_name(act_bits: float, grad_bits: float) -> str:
    """A per-sample precision option's name in tables and legends: ``FW4/BW12``."""
    return f"FW{act_bits:g}/BW{grad_bits:g}"


def _option_shares(precision: pd.DataFrame) -> tuple[pd.DataFrame, str] | None:
    """The last epoch's share of each precision option per layer (rows: layers), and what the shares are of.

    DYNASTY's ``bitmap`` rows give each block width's share of the weight map's work; the per-option rows
    of a method that mixes precisions per sample (DFQ, FracTrain) give each FW/BW option's share of the
    samples, the rest being skipped blocks.
    """
    last = precision[precision.epoch == precision.epoch.max()]
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
    return _save(fig, out / f"allocation-{_run_slug(run)}.png")


def average_bits_plot(group: Group, out: Path) -> Path | None:
    """DYNASTY's average bit-width per epoch, with each run's target dotted (DYNASTY Fig. 5)."""
    fig = Figure(figsize=(6.5, 4), layout="constrained")
    axes = fig.add_subplot()
    chosen = [run for run in group.runs if "dynasty_average_bits" in run.metrics]
    if not _config_lines(chosen, axes, "epoch", "dynasty_average_bits"):
        return None
    for target in sorted({run.get("method.target_bits") for run in chosen} - {None}):
        axes.axhline(target, color="black", linestyle=":", linewidth=0.8)
    axes.set(xlabel="epoch", ylabel="average bits per block (weights x activations)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    fig.suptitle(f"average bit-width over epochs (dotted: targets): {group.title}{SEEDS_NOTE}", fontsize=10)
    return _save(fig, out / f"average-bits-{group.slug}.png")


def turning_points_plot(group: Group, out: Path) -> Path | None:
    """The training loss per epoch of PFQ/FracTrain runs, a vertical line where the precision stage rose."""
    chosen = [run for run in group.runs if "stage" in run.metrics and not run.metrics.empty]
    if not chosen:
        return None
    fig = Figure(figsize=(6.5, 4), layout="constrained")
    axes = fig.add_subplot()
    _config_lines(chosen, axes, "epoch", "train_loss")
    for members in by_config(chosen).values():
        for i, run in enumerate(members):
            metrics = run.metrics
            rises = metrics[metrics.stage.diff() > 0]
            axes.plot(rises.epoch, rises.train_loss, linestyle="none", marker=seed_marker(i), markersize=11,
                      markerfacecolor="none", markeredgewidth=1.6, color=method_colour(run.method))
    axes.set(xlabel="epoch", ylabel="training loss")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    fig.suptitle(f"training loss (large hollow marker: the first epoch of a new precision stage, in the seed's "
                 f"shape): {group.title}{SEEDS_NOTE}", fontsize=10)
    return _save(fig, out / f"loss-turning-points-{group.slug}.png")


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
        axes.errorbar(cells.paper, cells.ours, yerr=std, fmt="o", color=_PALETTE[0], ecolor="grey", capsize=3)
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
        colour = _PALETTE[i % len(_PALETTE)]
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
                written.append(_save(fig, out / f"{stem}{suffix}.png"))
    return written


PER_RUN: tuple[Callable[[Run, Path, list[Run]], Path | None], ...] = (precision_plot, sparsity_plot, bit_allocation_plot)
ACROSS_RUNS: tuple[Callable[[Group, Path], Path | None], ...] = (learning_curve_plot, accuracy_cost_plot,
                                                                      average_bits_plot, turning_points_plot)


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
        written.append(_save(fig, out / f"pareto-{_slug(name)}.png"))
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


def write_plots(runs: list[Run], out: Path) -> list[Path]:
    """Every figure the runs have data for, as PNG files in ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = [plot(group, out) for group in groups(runs) for plot in ACROSS_RUNS]
    written += [plot(run, out, runs) for run in runs for plot in PER_RUN]
    return [path for path in written if path is not None]
