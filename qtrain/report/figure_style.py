"""How every figure of the report draws: one colour per method (:func:`method_colour`), a shade and line style of it
per configuration (:func:`config_style`), a marker shape per seed (:func:`seed_marker`), the runs grouped into
figures (:func:`groups`) and named, and each PNG saved with its caption (:func:`save`). docs/reports.md ("Plots")."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from qtrain.catalog import METHOD_NAMES
from qtrain.report.runs import Run
from qtrain.report.tables import other_keys, run_frame, setting
from qtrain.resources import conf_dir

PALETTE = colormaps["tab10"].colors + colormaps["Dark2"].colors  # tab10's first, so older figures keep their colours


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
        found.append(Group(members, title, slug(f"{model}-{data}-{digest}")))
    return found


def method_colour(method: str) -> tuple[float, float, float]:
    """The colour of ``method`` in every figure (a method qtrain does not know gets grey)."""
    return PALETTE[METHOD_NAMES.index(method)] if method in METHOD_NAMES else (0.5, 0.5, 0.5)


def config_label(run: Run, peers: list[Run]) -> str:
    """A configuration's name in legends: its method, setting and the other keys that set it apart (among ``peers``,
    the figure's runs: the runs table's setting and config)."""
    return " ".join(part for part in (run.method, setting(run, peers), other_keys(run, peers)) if part)


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


def option_name(act_bits: float, grad_bits: float) -> str:
    """A per-sample precision option's name in tables and legends: ``FW4/BW12``."""
    return f"FW{act_bits:g}/BW{grad_bits:g}"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9=.-]+", "_", text).strip("_")[:120]


def run_slug(run: Run) -> str:
    """A run's figures are named by its method, model, data and run id (its directory's digest where it has none)."""
    digest = run.run_id or hashlib.sha256(str(run.dir.resolve()).encode()).hexdigest()[:8]
    return f"{slug(f'{run.method}-{run.model}-{run.data}')}-id={digest}"


CAPTION_KEY = "Description"  # the PNG text field that holds a figure's caption (report.html shows it)


def save(fig: Figure, path: Path) -> Path:
    """The figure as a PNG whose caption (its title: what it shows, of which runs) travels in the file."""
    text = " ".join(fig.get_suptitle().split())
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={CAPTION_KEY: text})
    return path


def caption(path: Path) -> str:
    """The caption :func:`save` wrote into a PNG, or its file name."""
    from PIL import Image

    with Image.open(path) as image:
        return image.info.get(CAPTION_KEY) or path.stem


def epoch_ticks(axes) -> None:
    """Whole epochs on the x axis: no tick at 1.5."""
    axes.xaxis.get_major_locator().set_params(integer=True, min_n_ticks=1)


def legend(fig: Figure, axes_list: list) -> None:
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


def config_lines(runs: list[Run], axes, x: str, y: str, scale_y: float = 1.0) -> bool:
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
