"""Paper mode: the published tables (``results/paper/*.csv``, schema in ``results/paper/README.md``) with our runs'
figures beside them (:func:`compare`), cut into their comparable and scale-bound parts (:func:`views`), and the cells
no run matches (:func:`missing`). docs/reports.md describes paper mode, docs/methods/adapt.md SU2's departure."""

from __future__ import annotations

import math
import re
import shlex
import statistics
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd

from qtrain import resources, sweeps
from qtrain.catalog import GATED
from qtrain.report.runs import ReportError, Run
from qtrain.report.tables import AGGREGATES, figure, run_frame, score

HEADER = ["paper", "table", "row", "column", "value", "method", "model", "data", "setting", "metric"]
UNMATCHED = ("train.epochs",)  # scales change the length of training, not which run a cell is


def paper_dir() -> Path:
    """The transcribed tables (:func:`qtrain.resources.paper_dir`); missing, a report error."""
    try:
        return resources.paper_dir()
    except FileNotFoundError as err:
        raise ReportError(str(err)) from None


def paper_tables() -> list[str]:
    return sorted(path.stem for path in paper_dir().glob("*.csv"))


def load_table(name: str) -> pd.DataFrame:
    """One transcribed table (``fractrain_table3``); an unknown name is an error listing the known ones."""
    path = paper_dir() / f"{name}.csv"
    if not path.is_file():
        raise ReportError(f"unknown paper table {name!r} (choose from: {', '.join(paper_tables())})")
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    if list(table.columns) != HEADER:
        raise ReportError(f"{path} does not have the header {','.join(HEADER)}")
    table["value"] = table["value"].astype(float)
    return table


@cache
def _parse_setting(text: str) -> tuple[tuple[str, Any], ...]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(text.split()) if text else []
    return tuple((o.key_or_group, o.value()) for o in parsed)


def _config_value(config: dict[str, Any], key: str) -> Any:
    """The value at dotted ``key`` of a nested ``config`` (a whole subtree where the key names one)."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(theirs, dict):
        return isinstance(ours, dict) and all(_same(ours.get(k, _MISSING), v) for k, v in theirs.items())
    if isinstance(theirs, list):
        return isinstance(ours, list) and len(ours) == len(theirs) and all(map(_same, ours, theirs))
    if isinstance(theirs, (int, float)) and isinstance(ours, (int, float)) and not isinstance(ours, bool):
        return math.isclose(ours, theirs)
    return ours == theirs


def matching(runs: list[Run], cell: pd.Series) -> list[Run]:
    """The runs that reproduce ``cell``: its method, model and data, and each override of its setting."""
    if not cell.method:
        return []
    setting = [(k, v) for k, v in _parse_setting(cell.setting) if k not in UNMATCHED]
    return [run for run in runs
            if (run.method, run.model, run.paper_data) == (cell.method, cell.model, cell.data)
            and run.status != "failed" and all(_same(_config_value(run.config, k), v) for k, v in setting)]


def _summary(run: Run, *path: str) -> float | None:
    node: Any = run.summary
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return None if node is None else float(node)


def _at_best(run: Run) -> float | None:
    metrics = run.metrics
    if metrics.empty or "test_acc" not in metrics or metrics.test_acc.isna().all():
        return None
    return float(metrics.effective_macs[metrics.test_acc.idxmax()])  # idxmax skips the epochs not evaluated


def _scaled(value: float | None, unit: float) -> float | None:
    return None if value is None else value / unit


def _average_bits(run: Run) -> float | None:
    value = _summary(run, "dynasty", "average_bits")
    if value is None and "dynasty_average_bits" in run.metrics:
        value = float(run.metrics.dynasty_average_bits.mean())
    return value


def _performance(*path: str) -> Callable[[Run], float | None]:
    return lambda run: _summary(run, run.method, "performance_model", *path)


def _su3_baseline(run: Run) -> str:
    """SU3 is against MuPPET's float32 baseline: AdaPT's ``muppet`` baseline, MuPPET's own ``same`` one."""
    return "same" if run.method == "muppet" else "muppet"


def _quantized_macs(run: Run) -> float | None:
    """The effective MACs of the layers the run quantizes: the whole model's less its float32 layers' share."""
    share = _summary(run, "float32_layers", "share_of_cost")
    macs = figure(run, "effective_macs")
    return None if share is None or macs is None else macs * (1.0 - share)


def _speedup(baseline: Callable[[Run], str], formula: str) -> Callable[[Run], float | None]:
    return lambda run: _summary(run, run.method, "performance_model", "baselines", baseline(run), formula)


# One run's figure, per metric of the paper tables' vocabulary (results/paper/README.md).
FIGURES: dict[str, Callable[[Run], float | None]] = {
    "test_acc": lambda run: figure(run, "test_acc"),
    "best_test_acc": lambda run: figure(run, "best_test_acc"),
    "perplexity": lambda run: figure(run, "test_ppl"),
    "effective_macs": lambda run: figure(run, "effective_macs"),
    "quantized_macs": _quantized_macs,
    "effective_macs_at_best": _at_best,
    "energy_kj": lambda run: _scaled(figure(run, "bitfusion_joules"), 1000.0),
    "latency_min": lambda run: _scaled(figure(run, "bitfusion_seconds"), 60.0),
    "average_bits": _average_bits,
    "epochs": lambda run: float(run.epochs),
    "batch_size": lambda run: float(run.get("train.batch_size")),
    "memory_ratio": _performance("MEM"),
    "speedup_su1": _speedup(lambda run: "same", "SU"),
    "speedup_su3": _speedup(_su3_baseline, "SU"),
    "final_sparsity": _performance("sparsity", "final"),
    "average_sparsity": _performance("sparsity", "average"),
    "inference_size_ratio": _performance("inference", "SZ"),
    "inference_speedup": _performance("inference", "SU"),
}


# A second reading of a figure shown beside ours: (what it is, how to read it from a run).
BESIDE: dict[str, tuple[str, Callable[[Run], float | None]]] = {
    "speedup_su1": ("Sec. 4.1.2's formula", _speedup(lambda run: "same", "SU_printed")),
    "speedup_su3": ("Sec. 4.1.2's formula", _speedup(_su3_baseline, "SU_printed")),
    "final_sparsity": ("weighted by weight count", _performance("sparsity", "final_weighted")),
    "average_sparsity": ("weighted by weight count", _performance("sparsity", "average_weighted")),
}
# SU2 divides SU1 (either reading) by the share of the run that reached float32's accuracy (_iso_share).
BESIDE["speedup_su2"] = BESIDE["speedup_su1"]
SETUP_KEYS = ("train.batch_size", "train.accum_steps", "train.epochs", "train.batches_per_epoch")


def _difference(ours: float, baseline: float) -> float:
    return ours - baseline


def _saving(ours: float, baseline: float) -> float:
    return 100.0 * (1.0 - ours / baseline) if baseline else math.nan


# A figure relative to a baseline: (the baseline's method, the figures it may be read in, how to combine).
RELATIVE: dict[str, tuple[str, tuple[str, ...], Callable[[float, float], float]]] = {
    "acc_drop": ("float32", ("test_acc",), _difference),
    "acc_delta_vs_sbm": ("sbm", ("test_acc", "best_test_acc"), _difference),
    "perplexity_delta_vs_sbm": ("sbm", ("perplexity",), _difference),
    "savings_vs_sbm_percent": ("sbm", ("quantized_macs", "effective_macs", "effective_macs_at_best"), _saving),
    "energy_savings_vs_sbm_percent": ("sbm", ("energy_kj",), _saving),
    "latency_savings_vs_sbm_percent": ("sbm", ("latency_min",), _saving),
}


def _baseline_cell(table: pd.DataFrame, cell: pd.Series, method: str, metrics: tuple[str, ...]) -> pd.Series | None:
    """The cell of ``method`` and one of ``metrics`` that ``cell`` is measured against: same model and data, in the
    same row if there is one, and sharing the most of the cell's overrides outside ``method.`` (FracTrain Table 5's
    data halves)."""
    candidates = table[(table.method == method) & (table.model == cell.model) & (table.data == cell.data)
                       & table.metric.isin(metrics)]
    same_row = candidates[candidates.row == cell.row]
    chosen = same_row if len(same_row) else candidates
    if chosen.empty:
        return None
    ours = {token for token in cell.setting.split() if not token.startswith("method.")}
    shared = chosen.setting.map(lambda text: len(ours & set(text.split())))
    chosen = chosen[shared == shared.max()]
    if chosen[["setting", "metric"]].drop_duplicates().shape[0] != 1:
        return None  # several baselines the table does not tell apart
    return chosen.iloc[0]


def _aggregate(found: list[tuple[Run, float]], aggregate: str) -> tuple[float, float]:
    """Mean and standard deviation of the runs' values, or (``best``) the value of the best run and no spread."""
    if not found:
        return math.nan, math.nan
    if aggregate == "best":
        return max(found, key=lambda pair: score(figure(pair[0], "test_acc"), figure(pair[0], "test_ppl")))[1], math.nan
    values = [value for _, value in found]
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def _read(runs: list[Run], read: Callable[[Run], float | None]) -> list[tuple[Run, float]]:
    return [(run, value) for run in runs if (value := read(run)) is not None]


def _data_keys(run: Run) -> dict[str, Any]:
    return {k: v for k, v in run.flat_config.items() if k.startswith("data.") and k not in ("data.root", "data.fold")}


def _same_setup(run: Run, other: Run) -> bool:
    """Same model and data, batch, accumulation, epochs, and data keys but the fold (so the same scale)."""
    return ((other.model, other.data, other.scale) == (run.model, run.data, run.scale) and _data_keys(other) == _data_keys(run)
            and all(other.get(key) == run.get(key) for key in SETUP_KEYS))


def float32_baselines(runs: list[Run], run: Run) -> list[Run]:
    """The float32 runs ``run`` is measured against for SU2: of the same setup (:func:`_same_setup`)."""
    return [other for other in runs if other.method == "float32" and other.status != "failed" and _same_setup(run, other)]


def _iso_share(run: Run, target: float) -> float:
    """The share of ``run``'s epochs up to the first whose test accuracy (%) reaches ``target``; 1 if none does."""
    metrics = run.metrics
    if metrics.empty or "test_acc" not in metrics or not run.epochs:
        return 1.0
    reached = (100.0 * metrics.test_acc >= target).to_numpy().nonzero()[0]
    return (reached[0] + 1) / run.epochs if len(reached) else 1.0


def _su2(runs: list[Run], aggregate: str, su1: Callable[[Run], float | None]) -> Callable[[Run], float | None]:
    """SU2 of a run from its SU1 reading ``su1`` and its float32 baseline runs' accuracy, aggregated."""
    def read(run: Run) -> float | None:
        target, _ = _aggregate(_read(float32_baselines(runs, run), lambda r: figure(r, "test_acc")), aggregate)
        value = su1(run)
        return None if value is None or math.isnan(target) else value / _iso_share(run, target)
    return read


def _configs(runs: list[Run]) -> dict[Path, tuple[str, str]]:
    """Each run's scale and training config as the runs table names them (``tables.run_frame``'s columns)."""
    frame = run_frame(runs)
    return dict(zip((run.dir for run in runs), zip(frame.scale, frame.config)))


def _reader(runs: list[Run], configs: dict[Path, tuple[str, str]], table: pd.DataFrame, cell: pd.Series,
            mine: list[Run], aggregate: str) -> Callable[[Run], float | None] | None:
    """How to read ``cell``'s figure from our runs ``mine``, of one scale and training config (None: no baseline to
    measure it against)."""
    if cell.metric in FIGURES:
        return FIGURES[cell.metric]
    if cell.metric == "speedup_su2":
        return _su2(runs, aggregate, FIGURES["speedup_su1"])
    reference = _baseline_cell(table, cell, *RELATIVE[cell.metric][:2]) if cell.metric in RELATIVE else None
    return None if reference is None else _against(runs, configs, reference, RELATIVE[cell.metric][2], mine, aggregate)


def _against(runs: list[Run], configs: dict[Path, tuple[str, str]], reference: pd.Series,
             combine: Callable[[float, float], float], mine: list[Run], aggregate: str) -> Callable[[Run], float | None] | None:
    """A run's figure of ``reference``'s metric combined with that of the runs of the baseline cell ``reference``
    (None: no such run): those of the same scale and training config, else (an AdaPT run's float32 baseline may train
    with another weight decay, as the reference's configs do) those of the same setup."""
    read = FIGURES[reference.metric]
    candidates = matching(runs, reference)
    same = [run for run in candidates if configs[run.dir] == configs[mine[0].dir]]
    base, _ = _aggregate(_read(same or [run for run in candidates if _same_setup(mine[0], run)], read), aggregate)
    if math.isnan(base):
        return None
    return lambda run: None if (value := read(run)) is None else combine(value, base)


# Absolute figures, bound to the run's scale (length of training, data sampled), each with the relative figure
# that compares across scales: its difference to, or its saving against, the table's baseline cell.
DERIVED: dict[str, Callable[[float, float], float]] = {
    "test_acc": _difference, "best_test_acc": _difference, "perplexity": _difference,
    "effective_macs": _saving, "quantized_macs": _saving, "effective_macs_at_best": _saving, "energy_kj": _saving,
    "latency_min": _saving,
}
SCALE_BOUND = (*DERIVED, "epochs", "batch_size")
NAMES = {"sbm": "SBM", "float32": "float32"}


def _relative_is(combine: Callable[[float, float], float], baseline: str) -> str:
    name = NAMES.get(baseline, baseline)
    return f"difference to {name}" if combine is _difference else f"% saved against {name}"


def table_baseline(table: pd.DataFrame) -> str | None:
    """The method the table measures its relative figures against (SBM in FracTrain's, float32 in AdaPT's and
    DYNASTY's), or None where it has none or several."""
    methods = {RELATIVE[metric][0] for metric in table.metric if metric in RELATIVE}
    return methods.pop() if len(methods) == 1 else None


def _ours(runs: list[Run], configs: dict[Path, tuple[str, str]], table: pd.DataFrame, cell: pd.Series,
          aggregate: str) -> list[dict[str, Any]]:
    """One entry per scale and training config among the runs matching ``cell``: our figure and its spread, the
    figure beside it where there is one, the relative figure of a scale-bound one (:data:`DERIVED`), and how many
    runs there are."""
    groups: dict[tuple[str, str, str], list[Run]] = {}
    for run in matching(runs, cell):
        groups.setdefault((*configs[run.dir], run.data if run.data != cell.data else ""), []).append(run)
    baseline = table_baseline(table)
    reference = (_baseline_cell(table, cell, baseline, (cell.metric,))
                 if baseline is not None and cell.metric in DERIVED else None)
    if reference is not None and (reference.row, reference.column) == (cell.row, cell.column):
        reference = None  # the baseline's own cell
    found = []
    for (scale, config, stand_in), mine in groups.items():
        read = _reader(runs, configs, table, cell, mine, aggregate)
        value, std = _aggregate(_read(mine, read), aggregate) if read else (math.nan, math.nan)
        beside, what = math.nan, ""
        if cell.metric in BESIDE:
            what, other = BESIDE[cell.metric]
            if cell.metric == "speedup_su2":
                other = _su2(runs, aggregate, other)
            beside = _aggregate(_read(mine, other), aggregate)[0]
        relative = {"relative_is": "", "relative_paper": math.nan, "relative": math.nan, "relative_std": math.nan}
        if reference is not None:
            combine = DERIVED[cell.metric]
            against = _against(runs, configs, reference, combine, mine, aggregate)
            ours, spread = _aggregate(_read(mine, against), aggregate) if against else (math.nan, math.nan)
            relative = {"relative_is": _relative_is(combine, baseline), "relative_paper": combine(cell.value, reference.value),
                        "relative": ours, "relative_std": spread}
        found.append({"scale": scale, "stand_in": stand_in, "config": config, "ours": value, "ours_std": std, "beside": beside,
                      "beside_is": what, "runs": len(mine), **relative})
    return found


COLUMNS = ["row", "column", "metric", "scale", "stand_in", "config", "paper", "ours", "ours_std", "difference", "beside",
           "beside_is", "relative_is", "relative_paper", "relative", "relative_std", "runs"]


def compare(runs: list[Run], name: str, aggregate: str = "mean") -> tuple[pd.DataFrame, pd.DataFrame]:
    """The cells of paper table ``name`` that our runs reproduce: paper, ours (mean and std over seeds and folds,
    or the best run's), the difference, a second reading beside ours where a figure has one, and for a
    scale-bound figure the relative one that compares across scales (``relative_is``, the paper's and ours).

    A cell that runs of several scales or training configs match gets a row per scale and config. Returns the
    frame and the table's cells no run matched (:func:`missing`).
    """
    if aggregate not in AGGREGATES:
        raise ReportError(f"--aggregate {aggregate} is not allowed (choose from: {', '.join(AGGREGATES)})")
    table = load_table(name)
    configs = _configs(runs)
    rows, unmatched = [], []
    for _, cell in table.iterrows():
        found = _ours(runs, configs, table, cell, aggregate)
        if not found:
            unmatched.append(cell)
        for entry in found:
            rows.append({"row": cell.row, "column": cell.column, "metric": cell.metric, "paper": cell.value,
                         "difference": entry["ours"] - cell.value, **entry})
    comparison = pd.DataFrame(rows, columns=COLUMNS)
    scales = comparison.scale.value_counts()
    stand_ins = {run.stands_in_for: run.data for run in runs if run.stands_in_for}
    return comparison, missing(name, pd.DataFrame(unmatched, columns=HEADER), scales.index[0] if len(scales) else None,
                               stand_ins)


def views(comparison: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """The comparison as it is read: ``("paper scale", ...)``, the rows of paper-scale runs as they are; at a reduced
    scale, ``("comparable", ...)``, what compares across scales (each scale-bound figure as its difference to, or
    saving against, the table's baseline; the figures that are relative already), and ``("scale-bound", ...)``,
    the absolute figures, context only (no difference to the paper's). Views with no row are left out."""
    at_paper = comparison[(comparison.scale == "paper") & (comparison.stand_in == "")]
    reduced = comparison.drop(at_paper.index)
    bound = reduced.metric.isin(SCALE_BOUND)
    derived = reduced[bound & (reduced.relative_is != "")].assign(
        figure=lambda f: f.relative_is, paper=lambda f: f.relative_paper, ours=lambda f: f.relative,
        ours_std=lambda f: f.relative_std)
    printed = reduced[~bound].assign(figure=lambda f: [_figure_is(m) for m in f.metric])
    comparable = pd.concat([derived, printed]).sort_index(kind="stable")
    comparable = comparable.assign(difference=comparable.ours - comparable.paper)
    shown = ["row", "column", "figure", "metric", "scale", "stand_in", "config", "paper", "ours", "ours_std", "difference",
             "beside", "beside_is", "runs"]
    found = [("paper scale", at_paper.drop(columns=["relative_is", "relative_paper", "relative", "relative_std"])),
             ("comparable", comparable[shown]),
             ("scale-bound", reduced[bound][["row", "column", "metric", "scale", "stand_in", "config", "paper", "ours",
                                             "ours_std", "runs"]])]
    return [(kind, frame.reset_index(drop=True)) for kind, frame in found if len(frame)]


def _figure_is(metric: str) -> str:
    """What a figure that compares across scales as it is measures."""
    if metric in RELATIVE:
        method, _, combine = RELATIVE[metric]
        return _relative_is(combine, method)
    return metric


# Why qtrain produces no run for a cell of the transcribed tables whose run is not named (results/paper/README.md),
# by what its row and column labels hold; the first that matches.
NOT_PRODUCED = (
    (r"(WAGEUBN|DoReFa)", "{0} is not a qtrain method"),
    (r"\(range (?:low|high)\)", "the range's end that is a saving over WAGEUBN or DoReFa, not over SBM "
                                "(neither is a qtrain method)"),
)


def _not_produced(cell: pd.Series) -> str | None:
    """Why qtrain cannot produce ``cell``, or None where a qtrain run would."""
    if not cell.method:
        labels = f"{cell.row} {cell.column}"
        for pattern, why in NOT_PRODUCED:
            if (found := re.search(pattern, labels)) is not None:
                return why.format(*found.groups())
        return "no qtrain run reproduces it"
    if not cell.metric:
        return f"a setting the paper prints, not a figure qtrain reports for {cell.method}"
    if cell.method in GATED and _model_file(cell.model).get("dfq_options") is None:
        return (f"{cell.method} gates residual blocks with the model's precision options, and conf/model/{cell.model}.yaml "
                "has none (dfq_options: null)")
    return None


@cache
def _model_file(model: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    path = resources.conf_dir() / "model" / f"{model}.yaml"
    return OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}


@cache
def _composed(overrides: tuple[str, ...]) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from qtrain.config.command_line import compose_config

    return OmegaConf.to_container(compose_config(resources.conf_dir(), list(overrides)), resolve=True, throw_on_missing=False)


def _narrowed(words: tuple[str, ...], cell: pd.Series, scale: str | None) -> list[str] | None:
    """``words`` (a sweep's command) cut to the one run of ``cell``: a sweep over a key the cell names gives the cell's
    value (None where it holds none of it), the scale is ``scale`` where one is given."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from qtrain.config.command_line import override_values

    wanted = {"method": cell.method, "model": cell.model, "data": cell.data, **dict(_parse_setting(cell.setting))}
    tokens = {"method": f"method={cell.method}", "model": f"model={cell.model}", "data": f"data={cell.data}",
              **{token.partition("=")[0]: token for token in cell.setting.split()}}
    narrowed = []
    for word in words:
        if word == "-m":
            continue
        override = OverridesParser.create().parse_overrides([word])[0]
        key = override.key_or_group
        if key == "scale" and scale is not None:
            narrowed.append(f"scale={scale}")
        elif override.is_sweep_override() and key in wanted:
            if not any(_same(value, wanted[key]) for value in override_values(override)):
                return None
            narrowed.append(tokens[key])
        else:
            narrowed.append(word)
    return narrowed


def _makes(overrides: list[str], cell: pd.Series) -> bool:
    """Whether the run ``overrides`` compose (their sweeps and Hydra's keys aside) is ``cell``'s."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    config = _composed(tuple(o.input_line for o in parsed if not o.is_sweep_override() and not o.is_hydra_override()))
    data = config["data"].get("stand_in_for") or config["data"]["name"]
    return ((config["method"]["name"], config["model"]["name"], data) == (cell.method, cell.model, cell.data)
            and all(_same(_config_value(config, key), value) for key, value in _parse_setting(cell.setting)
                    if key not in UNMATCHED))


def command(name: str, cell: pd.Series, scale: str | None = None) -> str:
    """The command that makes ``cell``'s run: the first of the table's sweeps (conf/sweeps/) that does, cut to that run
    (at ``scale`` where given); else the cell's method, model, data and setting on qtrain's defaults."""
    for program, *words in sweeps.commands(name) or ():
        if program != "qtrain":
            continue
        narrowed = _narrowed(tuple(words), cell, scale)
        if narrowed is not None and _makes(narrowed, cell):
            return shlex.join(["qtrain", *(["-m"] if words[0] == "-m" else []), *narrowed])
    scale_word = [] if scale in (None, "paper") else [f"scale={scale}"]
    plain = shlex.join(["qtrain", f"method={cell.method}", f"model={cell.model}", f"data={cell.data}",
                        *cell.setting.split(), *scale_word])
    return f"{plain} (no command in conf/sweeps/{name}.yaml makes it: the paper's schedule is not set)"


MISSING_COLUMNS = ["row", "column", "group", "why"]
NOT_PRODUCED_GROUP, NOT_RUN_GROUP = "not produced by qtrain", "not run yet"


def missing(name: str, cells: pd.DataFrame, scale: str | None = None,
            stand_ins: dict[str, str] | None = None) -> pd.DataFrame:
    """The table's cells without a run, each in one of two groups: ``not produced by qtrain`` (``why``: the reason)
    and ``not run yet`` (``why``: the command that makes it, at ``scale`` where given, on the dataset that
    ``stand_ins`` (paper data: run data) has stand in for the cell's)."""
    rows = []
    for _, cell in cells.iterrows():
        why = _not_produced(cell)
        made = cell
        if stand_ins and cell.get("data") in stand_ins:
            made = cell.copy()
            made["data"] = stand_ins[cell.data]
        rows.append({"row": cell.row, "column": cell.column, "group": NOT_PRODUCED_GROUP if why else NOT_RUN_GROUP,
                     "why": why or command(name, made, scale)})
    return pd.DataFrame(rows, columns=MISSING_COLUMNS)
