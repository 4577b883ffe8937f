"""The runs table as pandas frames: each run's configuration and figures (:func:`run_frame`), one row per
configuration with its seeds averaged (:func:`summary_frame`), formatted for reading (:func:`display_frame`).
docs/reports.md ("The runs table") says what a row's setting and config hold."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

import pandas as pd
from omegaconf import OmegaConf

from qtrain.catalog import GATE_OPTIONS, GATED, HARDWARE
from qtrain.config import NOT_CONFIGURATION, OMITTED_AT
from qtrain.report.runs import ReportError, Run, flatten
from qtrain.resources import conf_dir

# Keys that never make two runs different configurations (seeds and folds are aggregated; paths and plumbing
# change nothing).
# A run's figures (percentages in points), then the hardware models' cumulative seconds and joules.
SCORES = ("test_acc", "best_test_acc", "test_ppl", "effective_macs", "percent_of_float32")
HARDWARE_FIGURES = tuple(f"{model}_{unit}" for model, _ in HARDWARE for unit in ("seconds", "joules"))
FIGURES = (*SCORES, *HARDWARE_FIGURES)
LABELS = {
    "test_acc": "test acc %", "best_test_acc": "best acc %", "test_ppl": "test ppl (lower is better)",
    "effective_macs": "eff. MACs", "percent_of_float32": "% of float32", "savings": "savings % vs baseline",
    "paired": "Δ vs baseline, same seed", "better": "better on",
    **{f"{model}_{unit}": f"{label} {'s' if unit == 'seconds' else 'J'}"
       for model, label in HARDWARE for unit in ("seconds", "joules")},
}


@cache
def _method_defaults(name: str, scale: str) -> dict[str, Any]:
    """The method's config file, with what the scale's file for the method sets (config.yaml's defaults list)."""
    paths = (conf_dir() / "method" / f"{name}.yaml", conf_dir() / "scale" / "method" / f"{scale}_{name}.yaml")
    found = [OmegaConf.load(path) for path in paths if path.is_file()]
    return flatten(OmegaConf.to_container(OmegaConf.merge(*found))) if found else {}


def _text(value: Any) -> str:
    return str(value).replace(" ", "") if isinstance(value, list) else str(value)


def setting(run: Run, peers: Iterable[Run] = ()) -> str:
    """The method's keys that differ from its config file's defaults at the run's scale, and those whose value
    differs between the run's ``peers`` of the same method, model, data and scale (so a sweep's row at the default
    value is named too), as ``key=value`` (FracTrain's FW/BW lists...)."""
    defaults = _method_defaults(run.method, run.scale)
    ours = {key.removeprefix("method."): value for key, value in run.flat_config.items() if key.startswith("method.")}
    kind = (run.method, run.model, run.data, run.scale)
    swept = _differing([peer for peer in peers if (peer.method, peer.model, peer.data, peer.scale) == kind],
                       lambda key: key.startswith("method."))
    return " ".join(f"{key}={_text(value)}" for key, value in sorted(ours.items()) if key != "name" and (
        f"method.{key}" in swept or defaults.get(key, value) != value and "${" not in str(defaults.get(key))))


def figure(run: Run, name: str) -> float | None:
    """One figure of a run: from its summary where it has one, else its last ``metrics.csv`` row (a run in progress)."""
    summary = run.summary
    if name in ("test_acc", "best_test_acc"):
        value = (summary.get("final") or {}).get("test_acc") if name == "test_acc" else summary.get("best_test_acc")
        if value is None and not run.metrics.empty and "test_acc" in run.metrics:
            series = run.metrics["test_acc"].dropna()  # train.eval_every: epochs between evaluations have none
            value = None if series.empty else series.iloc[-1] if name == "test_acc" else series.max()
        return None if value is None else 100.0 * float(value)
    if name == "test_ppl":
        return run.last("test_ppl")
    if name in ("effective_macs", "percent_of_float32"):
        cost = summary.get("cost") or {}
        return cost[name] if name in cost else run.last(name)
    model, _, unit = name.rpartition("_")
    totals = ((summary.get("hardware") or {}).get("models") or {}).get(model)
    return totals[unit] if totals else run.last(name)


def _reads(run: Run, key: str) -> bool:
    """Whether the run's method reads config key ``key`` (the gate options only the gated methods read)."""
    return key != GATE_OPTIONS or run.method in GATED


def _differing(runs: list[Run], wanted: Callable[[str], bool]) -> list[str]:
    """The config keys (dotted, those ``wanted``) whose values differ between the ``runs`` that read them."""
    keys = set().union(*(run.flat_config for run in runs))
    return sorted(k for k in keys if wanted(k) and len({_text(run.get(k)) for run in runs if _reads(run, k)}) > 1)


def _varying(runs: list[Run]) -> dict[str, list[str]]:
    """Per (model, data, scale): the config keys outside ``method.`` whose values differ between its runs."""
    groups: dict[tuple[str, str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.model, run.data, run.scale), []).append(run)
    return {"/".join(key): _differing(members, lambda k: not k.startswith(("method.", "hydra.")) and k not in NOT_CONFIGURATION)
            for key, members in groups.items()}


def _config_text(run: Run, varying: list[str]) -> str:
    """The run's ``varying`` keys and those a run made before the key existed lacks (:data:`OMITTED_AT`'s outside
    the method, and ``world_size``, which a run on one process lacks) where it holds them: ``flat_config`` holds
    those only at another value than such a run had, so a run alone in its report still names them."""
    added = [k for k in run.flat_config if k == "world_size" or (k in OMITTED_AT and not k.startswith("method."))]
    keys = sorted({*varying, *added})
    return " ".join(f"{k}={_text(run.get(k))}" for k in keys if run.get(k) is not None and _reads(run, k))


def other_keys(run: Run, peers: list[Run]) -> str:
    """The run's keys outside the method whose values differ between ``peers`` of its model, data and scale, or
    that a run made before them lacks (the runs table's *config*: ``train.epochs=4``, ``world_size=4``,
    ``model.classifier_init=normal_in_out``), as ``key=value``."""
    return _config_text(run, _varying(peers).get("/".join((run.model, run.data, run.scale)), []))


def run_frame(runs: list[Run]) -> pd.DataFrame:
    """One row per run: its configuration columns, seed, status, epochs, every figure, and its directory."""
    if not runs:
        raise ReportError("no runs to report")
    varying = _varying(runs)
    rows = []
    for run in runs:
        keys = varying["/".join((run.model, run.data, run.scale))]
        rows.append({
            "method": run.method, "model": run.model, "data": run.data, "scale": run.scale, "setting": setting(run, runs),
            "config": _config_text(run, keys),
            "seed": run.seed, "fold": run.get("data.fold"), "status": run.status, "notes": run.notes,
            "epochs": run.epochs, **{name: figure(run, name) for name in FIGURES}, "dir": str(run.dir),
        })
    return pd.DataFrame(rows)


CONFIG_COLUMNS = ["method", "model", "data", "scale", "setting", "config"]
AGGREGATES = ("mean", "best")


def score(accuracy: float | None, perplexity: float | None) -> float:
    """How good a run is, for picking the best: its final test accuracy, else its negated perplexity."""
    for value, sign in ((accuracy, 1.0), (perplexity, -1.0)):
        if value is not None and not math.isnan(value):
            return sign * value
    return -math.inf


def best_of(runs: pd.DataFrame) -> pd.DataFrame:
    """``run_frame`` cut to each configuration's best run (:func:`score`)."""
    scores = [score(a, p) for a, p in zip(runs.test_acc, runs.test_ppl)]
    ranked = runs.assign(_score=scores).sort_values("_score", ascending=False, kind="stable")
    return ranked.drop_duplicates(CONFIG_COLUMNS).drop(columns="_score").sort_index()


def _status(values: pd.Series) -> str:
    counts = values.value_counts()
    return counts.index[0] if len(counts) == 1 else ", ".join(f"{n} {s}" for s, n in counts.items())


def _notes(values: pd.Series) -> str:
    return "; ".join(dict.fromkeys(note for note in values if note))


FINISHED = ("completed", "diverged")


def _finished_figures(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` with the figures blanked of the runs a configuration's means leave out: where it has finished runs,
    the unfinished ones (a run still training counts in its row's runs and status, not its figures); else the runs
    short of its furthest epoch, so that seeds stopped at different epochs are not averaged together. A note on each
    such run says whose figures the row shows."""
    finished = runs.status.isin(FINISHED)
    grouped = runs.assign(_finished=finished).groupby(CONFIG_COLUMNS, sort=False, dropna=False)
    any_finished = grouped["_finished"].transform("any")
    furthest = grouped["epochs"].transform("max")
    kept = finished | (~any_finished & (runs.epochs == furthest))
    shown = kept.groupby([runs[c] for c in CONFIG_COLUMNS], sort=False, dropna=False).transform("sum")
    notes = runs.notes.copy()
    for i in runs.index[~kept]:
        runs_ = "run" if shown[i] == 1 else "runs"
        whose = f"finished {runs_}" if any_finished[i] else f"{runs_} at epoch {int(furthest[i])}"
        notes[i] = "; ".join(filter(None, (notes[i], f"figures: the {shown[i]} {whose}")))
    return runs.assign(notes=notes, **{name: runs[name].where(kept) for name in FIGURES})


def summary_frame(runs: pd.DataFrame, baseline: dict[str, str] | None = None, aggregate: str = "mean") -> pd.DataFrame:
    """``run_frame`` grouped by configuration: runs, status, epochs, each figure's mean and std over seeds and
    folds (``aggregate="best"``: the best run's figures, std empty). Where a configuration has finished runs
    (completed or diverged), its figures are theirs alone; else those of its runs that got furthest (their last
    epoch), with a note on how many.

    ``baseline`` (``{"method": "sbm"}``, keys of the configuration columns) adds ``savings_mean``: 100·(1 − this
    row's effective MACs / the baseline row's) for the baseline row of the same model and data; and, aggregating
    by mean, ``paired_mean``/``paired_std``/``better``: the row's final perplexity (a language model's; else its
    accuracy in points) minus the baseline's seed by seed, and on how many seeds it is the better one. Runs of one
    seed share their initial weights and data order across methods, so these differences show an effect smaller
    than the seeds' spread.
    """
    if aggregate not in AGGREGATES:
        raise ReportError(f"--aggregate {aggregate} is not allowed (choose from: {', '.join(AGGREGATES)})")
    counts = runs.groupby(CONFIG_COLUMNS, sort=False, dropna=False).size()
    runs = _finished_figures(runs)
    if aggregate == "best":
        runs = best_of(runs)
    grouped = runs.groupby(CONFIG_COLUMNS, sort=False, dropna=False)
    table = grouped.agg(runs=("status", "size"), status=("status", _status), notes=("notes", _notes),
                        epochs=("epochs", "max")).reset_index()
    table["runs"] = [counts[key] for key in table[CONFIG_COLUMNS].itertuples(index=False, name=None)]
    for name in FIGURES:
        stats = grouped[name].agg(["mean", "std"]).reset_index(drop=True)
        table[f"{name}_mean"], table[f"{name}_std"] = stats["mean"].to_numpy(), stats["std"].to_numpy()
    if baseline:
        for key, value in baseline.items():
            if key not in CONFIG_COLUMNS:
                raise ReportError(f"--baseline {key}={value} is not allowed: choose keys from {', '.join(CONFIG_COLUMNS)}")
        chosen = [_baseline_row(table, row, baseline) for _, row in table.iterrows()]
        table["savings_mean"] = [_savings(row, base) for (_, row), base in zip(table.iterrows(), chosen)]
        table["savings_std"] = math.nan
        if aggregate == "mean":
            paired = [_paired(runs, row, base) for (_, row), base in zip(table.iterrows(), chosen)]
            table["paired_mean"], table["paired_std"], table["better"] = zip(*paired)
    return table


def _baseline_row(table: pd.DataFrame, row: pd.Series, baseline: dict[str, str]) -> pd.Series | None:
    """The baseline row of this row's model and data (and its config, where that leaves one); None if not one."""
    chosen = table[(table.model == row.model) & (table.data == row.data)]
    for key, value in baseline.items():
        chosen = chosen[chosen[key].astype(str) == value]
    if len(chosen) > 1:
        chosen = chosen[chosen.config == row.config]
    return chosen.iloc[0] if len(chosen) == 1 else None


def _savings(row: pd.Series, base: pd.Series | None) -> float:
    if base is None or not base.effective_macs_mean:
        return math.nan
    return 100.0 * (1.0 - row.effective_macs_mean / base.effective_macs_mean)


def _paired(runs: pd.DataFrame, row: pd.Series, base: pd.Series | None) -> tuple[float, float, str]:
    """This row's final test perplexity (a language model's), else its final test accuracy, minus the baseline row's,
    run by run over the seeds (and folds) both have: the differences' mean and std, and on how many this row is
    the better one."""
    if base is None or all(row[c] == base[c] for c in CONFIG_COLUMNS):
        return math.nan, math.nan, ""
    name = "test_ppl" if not math.isnan(row.test_ppl_mean) else "test_acc"

    def scores(config: pd.Series) -> pd.Series:
        mine = runs[(runs[CONFIG_COLUMNS] == config[CONFIG_COLUMNS]).all(axis=1)]
        # runs of one seed and fold in several folders count once, as their mean
        return mine.groupby([mine.seed, mine.fold.fillna(-1)])[name].mean().dropna()

    ours, theirs = scores(row).align(scores(base), join="inner")
    differences = ours - theirs
    if differences.empty:
        return math.nan, math.nan, ""
    better = (differences > 0) if name == "test_acc" else (differences < 0)
    return differences.mean(), differences.std(), f"{int(better.sum())}/{len(differences)}"


SI_PREFIXES = ("", "k", "M", "G", "T", "P", "E")


def si(value: float) -> str:
    """``value`` to 3 significant figures with an SI prefix: ``8.19 G`` for 8.19e9, ``0`` for zero."""
    if value == 0 or not math.isfinite(value):
        return format(value, "g")
    power = min(max(int(math.floor(math.log10(abs(value)) / 3)), 0), len(SI_PREFIXES) - 1)
    scaled = float(f"{value / 1000 ** power:.3g}")
    if abs(scaled) >= 1000 and power < len(SI_PREFIXES) - 1:  # 999.6 rounds up into the next prefix
        power, scaled = power + 1, scaled / 1000
    return f"{scaled:.3g} {SI_PREFIXES[power]}".rstrip()


def _number(value: float, fmt: str) -> str:
    return si(value) if fmt == "si" else format(value, fmt)


def _shown(mean: float, std: float, fmt: str) -> str:
    if mean is None or math.isnan(mean):
        return "-"
    if std is None or math.isnan(std):
        return _number(mean, fmt)
    return f"{_number(mean, fmt)} ± {'0' if std == 0 else _number(std, fmt)}"


FORMATS = {"effective_macs": "si", **{f"{model}_{unit}": ".3g" for model, _ in HARDWARE for unit in ("seconds", "joules")}}


def display_frame(table: pd.DataFrame) -> pd.DataFrame:
    """``summary_frame`` for reading: ``mean ± std`` cells, labelled columns, columns no row fills dropped (the
    scale where every run is at paper scale)."""
    shown = table[[*CONFIG_COLUMNS, "runs", "status", "notes", "epochs"]].copy()
    for name in (*SCORES, "savings", "paired", *HARDWARE_FIGURES):
        if f"{name}_mean" not in table or table[f"{name}_mean"].isna().all():
            continue
        fmt = FORMATS.get(name, ".2f")
        shown[LABELS[name]] = [_shown(m, s, fmt) for m, s in zip(table[f"{name}_mean"], table[f"{name}_std"])]
        if name == "paired":
            shown[LABELS["better"]] = table["better"]
    for column, plain in (("scale", "paper"), ("setting", ""), ("config", ""), ("notes", "")):
        if (shown[column] == plain).all():
            shown = shown.drop(columns=column)
    return shown
