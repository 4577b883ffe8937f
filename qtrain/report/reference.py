"""Runs against a reference learning curve (``qtrain-report RUN... --reference FILE``): a published training log as a
per-epoch CSV file, set beside the runs' epochs as tables of differences, a figure and the gates' option shares.
docs/reports.md ("Against a reference curve") says how the differences are counted."""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from qtrain.report.figure_style import SEEDS_NOTE, config_lines, epoch_ticks, legend, option_name, save, slug
from qtrain.report.runs import ReportError, Run

# (column, what it is, the scale from ours to the reference's unit, how a difference is counted): accuracies in
# points (ours are shares, the logs' percent), losses in percent of the reference's value, cp in percentage points
COLUMNS = (("train_loss", "training loss", 1.0, "relative"),
           ("train_acc", "training accuracy (%)", 100.0, "points"),
           ("test_loss", "test loss", 1.0, "relative"),
           ("test_acc", "test accuracy (%)", 100.0, "points"),
           ("cp", "computation (% of float32)", 1.0, "points"))
SHARE_BAND = 0.15  # how far a block's share of the reference's most chosen option may lie from the reference's
AGREEMENT = ("most chosen as the reference's", "majority skips as the reference's",  # the gates table's counts
             f"same and share within {SHARE_BAND:g}")
AGREEMENT_BETWEEN = ("most chosen the same", "majority skips the same",  # the same counts for any two sets of gates
                     f"same and share within {SHARE_BAND:g}")
OPTION = re.compile(r"opt\d+_(?:(skip)|fw([\d.]+)_bw([\d.]+))")


@dataclass
class Reference:
    """A reference curve: its per-epoch figures (indexed by epoch) and, where given, its gates' option shares; for
    several runs of one reference (its seeds), their means, with each run's own in ``seeds``."""

    name: str
    curve: pd.DataFrame
    shares: pd.DataFrame | None
    loss_with_cost: bool = False  # the logged training loss holds the gated runs' signed cost term
    seeds: list[Reference] = field(default_factory=list)


def _read(path: Path, what: str) -> pd.DataFrame:
    try:
        return pd.read_csv(path)
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ReportError(f"--reference {path} is not allowed: {what} cannot be read as CSV ({reason})") from None


def load_reference(paths: list[Path]) -> Reference:
    """The reference curve in ``paths`` (one file, or one file per seed of the reference's run: then each epoch's
    figures and each block's shares are the mean over the files that have them) and the gates file beside each.
    The files' format: :func:`_load_one`."""
    seeds = [_load_one(path) for path in paths]
    if len(seeds) == 1:
        return seeds[0]
    names = [seed.name for seed in seeds]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise ReportError(f"--reference {' '.join(map(str, paths))} is not allowed: two files are named "
                          f"{', '.join(twice)} (each seed's rows are told apart by its file's name)")
    if len({seed.loss_with_cost for seed in seeds}) > 1:
        raise ReportError(f"--reference {' '.join(map(str, paths))} is not allowed: the seeds of one reference must "
                          "all be gated runs' logs or none (their training loss is counted differently)")
    curve = pd.concat([seed.curve for seed in seeds]).groupby(level=0).mean()
    gated = [seed.shares for seed in seeds if seed.shares is not None]
    shares = pd.concat(gated).groupby(["epoch", "block", "option"], as_index=False).share.mean() if gated else None
    return Reference(f"mean of {', '.join(seed.name for seed in seeds)}", curve, shares, seeds[0].loss_with_cost, seeds)


def _load_one(path: Path) -> Reference:
    """The reference curve in ``path`` and its gates file (``<stem>_gates.csv`` beside it), if there is one.

    The curve's columns, in the logs' own units: ``epoch`` (1 for the first), and any of ``train_loss`` and
    ``train_acc`` (the epoch's own mean loss and top-1 in percent; where ``cp_source`` says ``logged``, a gated run's
    log, its loss holds the signed cost term, and ours is compared as ``train_loss + cost_term``), ``test_loss``,
    ``test_acc`` (percent) and ``cp`` (the epoch's computation in percent of float32's). The gates file's: ``epoch``,
    ``block`` (the gated blocks numbered from 0 in the network's order) and one column of shares per option,
    ``optK_skip`` or ``optK_fwA_bwB``.
    """
    raw = curve = _read(path, "it")
    known = [column for column, *_ in COLUMNS if column in curve]
    if "epoch" not in curve or not known:
        raise ReportError(f"--reference {path} is not allowed: it needs an epoch column and one of "
                          f"{', '.join(column for column, *_ in COLUMNS)} (it has: {', '.join(map(str, curve.columns))})")
    epochs = pd.to_numeric(curve.epoch, errors="coerce")
    if epochs.isna().any() or (epochs < 1).any() or (epochs % 1 != 0).any() or epochs.duplicated().any():
        raise ReportError(f"--reference {path} is not allowed: its epochs must be distinct whole numbers from 1")
    curve = curve.assign(epoch=epochs.astype(int)).set_index("epoch").sort_index()[known].apply(pd.to_numeric, errors="coerce")
    gates_path = path.with_name(f"{path.stem}_gates.csv")
    shares = None
    if gates_path.exists():
        gates = _read(gates_path, "its gates file")
        options = {column: "skipped" if m[1] else f"FW{m[2]}/BW{m[3]}"
                   for column in gates.columns if (m := OPTION.fullmatch(column))}
        if not {"epoch", "block"} <= set(gates) or not options:
            raise ReportError(f"--reference {gates_path} is not allowed: a gates file needs the columns epoch, block "
                              "and one optK_skip or optK_fwA_bwB column per option")
        shares = gates.melt(id_vars=["epoch", "block"], value_vars=list(options), var_name="option", value_name="share")
        shares["option"] = shares.option.map(options)
    gated = "cp_source" in raw and (raw.cp_source == "logged").any()
    return Reference(path.stem, curve, shares, loss_with_cost=bool(gated))


def _epoch_cp(metrics: pd.DataFrame) -> pd.Series | None:
    """Each epoch's own cost in percent of float32's: the method's ``cp`` where it records one (DFQ, FracTrain), else
    from the cumulative effective MACs and their percentage (the epoch's MACs over its float32 MACs)."""
    if "cp" in metrics:
        return metrics.set_index("epoch")["cp"]
    if not {"effective_macs", "percent_of_float32"} <= set(metrics):
        return None
    macs = metrics.set_index("epoch")["effective_macs"]
    float32 = macs * 100.0 / metrics.set_index("epoch")["percent_of_float32"]
    return 100.0 * macs.diff().fillna(macs) / float32.diff().fillna(float32)


def _per_run(runs: list[Run], column: str) -> pd.DataFrame:
    """A metrics column by epoch, one column per run that has it."""
    frames = [_epoch_cp(run.metrics) if column == "cp" else run.metrics.set_index("epoch")[column]
              for run in runs if "epoch" in run.metrics and (column in run.metrics or column == "cp")]
    frames = [frame for frame in frames if frame is not None]
    return pd.concat(frames, axis=1, ignore_index=True) if frames else pd.DataFrame()


def _ours(runs: list[Run], column: str) -> pd.Series:
    """The runs' mean of a metrics column by epoch (over the runs that have that epoch)."""
    frame = _per_run(runs, column)
    return frame.mean(axis=1) if not frame.empty else pd.Series(dtype=float)


def difference_table(runs: list[Run], reference: Reference, first: int = 1) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per epoch, the runs' mean (over their seeds) beside the reference's, and the difference (ours minus the
    reference's: points of accuracy or cp, percent of the reference's loss); and per figure the mean and the largest
    size of the differences from epoch ``first`` on. Only the epochs both have count."""
    rows, summary = {}, []
    for column, _, scale, how in COLUMNS:
        if column not in reference.curve:
            continue
        if column == "train_loss" and reference.loss_with_cost:  # set ours on the same footing: loss + cost term
            ours = _ours([_with_objective(run) for run in runs], column)
        else:
            ours = _ours(runs, column)
        ours = ours.dropna()  # train.eval_every: the test columns of epochs not evaluated
        theirs = reference.curve[column].dropna()
        common = ours.index.intersection(theirs.index)
        if common.empty:
            continue
        a, b = ours[common] * scale, theirs[common]
        diff = (a - b) if how == "points" else 100.0 * (a - b) / b.abs()
        unit = "points" if how == "points" else "%"
        rows[f"{column} ours"], rows[f"{column} reference"], rows[f"{column} diff ({unit})"] = a, b, diff
        seeds = _per_run(runs, column).reindex(common) * scale
        if seeds.shape[1] > 1:  # the noise floor: how far the seeds lie apart (in the figure's own unit)
            rows[f"{column} seeds' range"] = _seeds_range(seeds)
        if reference.seeds:  # and the reference's own seeds
            rows[f"{column} reference seeds' range"] = _seeds_range(pd.concat(
                [seed.curve[column] for seed in reference.seeds if column in seed.curve], axis=1).reindex(common))
        counted = diff[diff.index >= first]
        if not counted.empty:
            summary.append({"figure": column, "difference": "ours - reference" + (" (points)" if how == "points" else
                                                                                 " (% of the reference's)"),
                            "epochs": f"{counted.index.min()}-{counted.index.max()}", "mean": counted.mean(),
                            "largest size": counted.abs().max()})
    if not rows:
        raise ReportError(f"--reference {reference.name}: the runs and the reference share no epoch of any figure")
    table = pd.DataFrame(rows).rename_axis("epoch").reset_index()
    return table, pd.DataFrame(summary)


def _network_order(name: str) -> list[int]:
    """A layer's place in the network from the numbers in its name (``layer2.10`` after ``layer2.9``)."""
    return [int(n) for n in re.findall(r"\d+", name)]


def _seeds_range(seeds: pd.DataFrame) -> pd.Series:
    """Per epoch (row), how far the seeds (columns) lie apart; none where fewer than two have the epoch."""
    return (seeds.max(axis=1) - seeds.min(axis=1)).where(seeds.notna().sum(axis=1) > 1)


def _block_shares(run: Run, epoch: int) -> tuple[pd.DataFrame, str, pd.Series] | None:
    """A run's option shares per gated block at ``epoch`` (rows: blocks in the network's order, numbered from 0 over
    every block the run records in any epoch; columns: ``FWa/BWg`` options and ``skipped``), what they are of:
    ``evaluation`` (the ``gates_eval`` rows: the gates' choices on the test split, as the reference's logs count
    them) where the run records them, else ``training`` (the epoch rows: the training epoch's mean), and each
    block's stage (``layer1`` for ``layer1.0``). Each block's first quantized layer in the record's (the model's)
    order, as the block's gate decides for all of its layers (never a downsampling block's shortcut, which also
    runs, in float32, for the samples that skip the block). A block with no row that epoch skipped every sample."""
    precision = run.precision
    if precision.empty or not {"layer", "share", "act_bits", "grad_bits"} <= set(precision) \
            or epoch not in set(precision.epoch):
        return None
    # a run's gated blocks are its ``<stage>.<index>.block`` modules, numbered from 0 in the network's order (as the
    # reference's gates file numbers its blocks)
    layers = [name for name in dict.fromkeys(precision.layer) if ".block." in str(name)]
    blocks = sorted({name.split(".block.")[0] for name in layers}, key=_network_order)
    if not blocks:
        return None
    rows = precision[(precision.epoch == epoch) & precision.share.notna()]
    events = rows.event if "event" in rows else pd.Series("epoch", index=rows.index)
    of = "evaluation" if (events == "gates_eval").any() else "training"
    rows = rows[events == ("gates_eval" if of == "evaluation" else "epoch")]
    rows = rows.assign(option=[option_name(a, g) for a, g in zip(rows.act_bits, rows.grad_bits)])
    found = []
    for block in blocks:
        first = next(name for name in layers if name.startswith(f"{block}.block.") and ".shortcut" not in name)
        shares = rows[rows.layer == first].groupby("option")["share"].sum()
        found.append({**shares.to_dict(), "skipped": max(0.0, 1.0 - float(shares.sum()))})
    stages = pd.Series([block.rsplit(".", 1)[0] for block in blocks]).rename_axis("block")
    return pd.DataFrame(found, index=range(len(blocks))).fillna(0.0).rename_axis("block"), of, stages


def _reference_blocks(reference: Reference, epoch: int) -> pd.DataFrame:
    """The reference's option shares per gated block at ``epoch`` (a block the gates file leaves empty left out)."""
    # a sum of no share is no share (pivot_table then leaves the block out), not 0
    return reference.shares[reference.shares.epoch == epoch].pivot_table(
        index="block", columns="option", values="share", aggfunc=lambda shares: shares.sum(min_count=1)).fillna(0.0)


def shares_table(runs: list[Run], reference: Reference, epochs: list[int]) -> pd.DataFrame:
    """Each gated block's most chosen option and its share at ``epochs``, the runs' (mean over seeds) beside the
    reference's, with the difference of the reference's option's share and what our shares are of (``evaluation``
    or ``training``, :func:`_block_shares`)."""
    if reference.shares is None:
        return pd.DataFrame()
    rows = []
    for epoch in epochs:
        theirs = _reference_blocks(reference, epoch)
        found = [shares for run in runs if (shares := _block_shares(run, epoch)) is not None]
        if theirs.empty or not found:
            continue
        of = "/".join(sorted({kind for _, kind, _ in found}))
        ours = pd.concat([shares for shares, _, _ in found]).fillna(0.0).groupby(level=0).mean()  # a lacking option: 0
        for block in theirs.index.intersection(ours.index):
            mine, ref = ours.loc[block], theirs.loc[block]
            top_ours, top_ref = mine.idxmax(), ref.idxmax()
            rows.append({"epoch": epoch, "block": block, "ours: most chosen": top_ours, "share": mine.max(),
                         "reference: most chosen": top_ref, "reference share": ref.max(),
                         "same": top_ours == top_ref,
                         "share diff (reference's option)": mine.get(top_ref, 0.0) - ref.max(), "ours: of": of})
    return pd.DataFrame(rows)


def _bits(option: str) -> list[float]:
    """An option's place in a table's columns: ``skipped`` first, then by its bits (FW6/BW8 before FW6/BW12)."""
    return [float(bits) for bits in re.findall(r"\d+(?:\.\d+)?", option)]


def _agreement(ours: pd.DataFrame, theirs: pd.DataFrame) -> list[str]:
    """Over the blocks of ``theirs`` (ours has them, with the same option columns): how many choose most often the
    option ``theirs`` does; are skipped by most samples, or run by most, as theirs are; and both choose its option
    most often and give it a share within SHARE_BAND of theirs (results/reference_runs' gate target). Each count is
    the same whichever of two runs is ``theirs``."""
    top = theirs.idxmax(axis=1)
    same = ours.idxmax(axis=1) == top
    share = pd.Series([ours.at[block, option] for block, option in top.items()], index=theirs.index)
    within = same & ((share - theirs.max(axis=1)).abs() <= SHARE_BAND + 1e-9)  # a share on the band's edge is in it
    skips = (ours.skipped > 0.5) == (theirs.skipped > 0.5)
    return [f"{int(count.sum())}/{len(theirs)}" for count in (same, skips, within)]


@dataclass
class _GateEpoch:
    """One epoch's gate shares of the reference and of each run that has them, over the blocks that all of them have
    (rows) and every option any of them takes (columns, ``skipped`` first), with each block's stage."""

    epoch: int
    reference: pd.DataFrame
    runs: list[tuple[Run, pd.DataFrame, str]]  # (run, its shares, what they are of: :func:`_block_shares`)
    stages: pd.Series
    reference_seeds: list[tuple[str, pd.DataFrame]]  # a reference of several seeds: each one's (name, shares)


def _gate_epochs(runs: list[Run], reference: Reference, every: int = 1) -> list[_GateEpoch]:
    """Each epoch that the reference's gates file and at least one run have shares for, in order: of those, the
    multiples of ``every`` and the last."""
    if reference.shares is None:
        return []
    epochs = []
    for epoch in sorted(set(reference.shares.epoch)):
        theirs = _reference_blocks(reference, epoch)
        found = [(run, *shares) for run in runs if (shares := _block_shares(run, epoch)) is not None]
        if theirs.empty or not found:
            continue
        seeds = [(seed.name, shares) for seed in reference.seeds if seed.shares is not None
                 and not (shares := _reference_blocks(seed, epoch)).empty]
        blocks = theirs.index
        for ours in [ours for _, ours, _, _ in found] + [theirs for _, theirs in seeds]:
            blocks = blocks.intersection(ours.index)
        options = sorted({"skipped", *theirs.columns, *(c for _, ours, _, _ in found for c in ours.columns)}, key=_bits)
        epochs.append(_GateEpoch(epoch, theirs.reindex(index=blocks, columns=options, fill_value=0.0),
                                 [(run, ours.reindex(index=blocks, columns=options, fill_value=0.0), of)
                                  for run, ours, of, _ in found],
                                 found[0][3].loc[blocks],  # the runs are one configuration: one set of blocks
                                 [(name, shares.reindex(index=blocks, columns=options, fill_value=0.0))
                                  for name, shares in seeds]))
    return [gates for gates in epochs if gates.epoch % every == 0 or gates is epochs[-1]]


def _run_label(run: Run) -> str:
    return f"seed {run.seed}" if run.seed is not None else run.dir.name


def gates_table(runs: list[Run], reference: Reference, every: int = 1) -> pd.DataFrame:
    """Per epoch both have gate shares for (every ``every``-th and the last), each run's gates summed up beside the
    reference's (and, for a reference of several seeds, each seed's), over the blocks that the reference and every
    run have: the share of the samples that skip each stage's blocks (mean over its blocks) and each option's share
    over every block's samples, the blocks that run for under 0.1 % of the samples; for the runs, how many blocks
    agree with the reference's (:func:`_agreement`)."""
    rows = []
    for gates in _gate_epochs(runs, reference, every):
        blocks = gates.reference.index
        # (label, shares, what they are of, agreement with the reference's): its own rows have none
        sides = [("reference", gates.reference, "", [""] * len(AGREEMENT))]
        sides += [(f"reference: {name}", shares, "", [""] * len(AGREEMENT)) for name, shares in gates.reference_seeds]
        sides += [(_run_label(run), shares, of, _agreement(shares, gates.reference)) for run, shares, of in gates.runs]
        for label, shares, of, agreement in sides:
            row = {"epoch": gates.epoch, "run": label, "of": of}
            row.update({f"skipped: {stage}": share
                        for stage, share in shares.skipped.groupby(gates.stages.to_numpy(), sort=False).mean().items()})
            row.update({f"{option}: all blocks": shares[option].mean() for option in shares.columns})
            # a gate stuck on skipping: the blocks that run for under 0.1 % of the samples
            row["blocks skipped by over 99.9 %"] = " ".join(map(str, blocks[shares.skipped > 0.999]))
            rows.append({**row, **dict(zip(AGREEMENT, agreement))})
    return pd.DataFrame(rows)


def noise_floor_table(runs: list[Run], reference: Reference, every: int = 1) -> pd.DataFrame:
    """The gate target's noise floor, per epoch of :func:`gates_table`: the reference's gates against its own at the
    epoch before, each pair of the reference's seeds' (where it has several) and each pair of runs' against each
    other, counted as :func:`_agreement` counts, over the blocks that table counts (and, for the reference against
    its previous epoch, its files have at both epochs)."""
    rows = []
    for gates in _gate_epochs(runs, reference, every):
        pairs = [(f"its epoch {gates.epoch - 1}", _reference_blocks(reference, gates.epoch - 1),
                  "the reference", gates.reference)]
        pairs += [(first, theirs, second, ours)
                  for (first, theirs), (second, ours) in itertools.combinations(gates.reference_seeds, 2)]
        pairs += [(_run_label(first), theirs, _run_label(second), ours)
                  for (first, theirs, _), (second, ours, _) in itertools.combinations(gates.runs, 2)]
        for first, theirs, second, ours in pairs:
            blocks = ours.index.intersection(theirs.index)
            if blocks.empty:
                continue
            options = ours.columns.union(theirs.columns)
            counts = _agreement(ours.reindex(index=blocks, columns=options, fill_value=0.0),
                                theirs.reindex(index=blocks, columns=options, fill_value=0.0))
            rows.append({"epoch": gates.epoch, "compared": f"{second} against {first}",
                         **dict(zip(AGREEMENT_BETWEEN, counts))})
    return pd.DataFrame(rows)


def _with_objective(run: Run) -> Run:
    """A copy of ``run`` whose ``train_loss`` holds its loss plus its cost term (where it records one)."""
    if "cost_term" not in run.metrics:
        return run
    objective = copy.copy(run)
    objective.__dict__["metrics"] = run.metrics.assign(train_loss=run.metrics.train_loss + run.metrics.cost_term.fillna(0.0))
    return objective


def reference_plot(runs: list[Run], reference: Reference, out: Path) -> Path | None:
    """The runs' curves (mean and band over seeds) with the reference's over them, one panel a figure."""
    panels = [(column, name, scale) for column, name, scale, _ in COLUMNS
              if column in reference.curve and column != "cp" and any(column in run.metrics for run in runs)]
    if not panels:
        return None
    fig = Figure(figsize=(4.2 * len(panels), 4.0), layout="constrained")
    drawn = []
    last = max(int(run.metrics.epoch.max()) for run in runs if "epoch" in run.metrics)
    for i, (column, name, scale) in enumerate(panels):
        axes = fig.add_subplot(1, len(panels), i + 1)
        theirs = reference.curve[column].dropna().loc[:last]  # the reference over the runs' epochs only
        axes.plot(theirs.index, theirs, color="black", linestyle="--", linewidth=1.2, marker="x", markersize=4,
                  label=f"reference: {reference.name}" + (" (band: its seeds' range)" if reference.seeds else ""))
        seeds = [seed.curve[column] for seed in reference.seeds if column in seed.curve]
        if seeds:  # the reference's seeds' band, as ours
            spread = pd.concat(seeds, axis=1).reindex(theirs.index)
            axes.fill_between(theirs.index, spread.min(axis=1), spread.max(axis=1), color="black", alpha=0.12,
                              linewidth=0)
        mine = [run for run in runs if column in run.metrics]
        if column == "train_loss" and reference.loss_with_cost:  # as the table: loss + cost term, the log's footing
            mine = [_with_objective(run) for run in mine]
            name = f"{name} + cost term"
        config_lines(mine, axes, "epoch", column, scale)
        axes.set(xlabel="epoch", ylabel=name, xlim=(0.5, last + 0.5))
        epoch_ticks(axes)
        axes.grid(alpha=0.3)
        drawn.append(axes)
    legend(fig, drawn)
    fig.suptitle(f"against the reference curve {reference.name} (dashed){SEEDS_NOTE}", fontsize=10)
    return save(fig, out / f"reference-{slug(reference.name)}.png")
