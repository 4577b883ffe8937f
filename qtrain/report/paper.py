"""Paper mode: the published tables (``results/paper/*.csv``) with our runs' figures beside them.

Each CSV cell names the qtrain run that reproduces it (method, model, data and the overrides in
``setting``) and which figure it is (``metric``; the vocabulary is ``results/paper/README.md``'s). A cell
is matched by every run of that method, model and data whose config holds each override of its
setting, ``train.epochs`` excepted (a ``mini`` or ``smoke`` scale shortens training; ``smoke``'s synthetic data
names the dataset it stands in for in ``data.stand_in_for``); the mean and standard deviation over its
seeds and folds (``aggregate="mean"``), or the figure of its best run (``aggregate="best"``: highest final test
accuracy) are shown beside the paper's figure, with the difference ours − paper. The AdaPT tables are the
best of 10 cross-validation folds (lorenz0890/AdaPT, ``utils/cv.py``): runs with ``data.fold=0..9`` reported
with ``aggregate="best"`` follow that protocol; the other papers' tables, and the mean, compare seeds.

Figures relative to a baseline (``acc_drop``, the ``*_vs_sbm`` ones) use the table's own baseline cell:
the float32 or SBM cell of the same model and data, in the same row where the table has one there. AdaPT's
SU2 (``speedup_su2``) takes its float32 run from the report's runs instead (Table 3 has no float32 cell):
the float32 runs of the same model and data, batch, accumulation and epochs, and the same data keys but the
fold (so the same scale). That setup also pairs a relative figure with its baseline where no baseline run
has the same training config (AdaPT's float32 runs put L2 in the optimizer's weight decay, AdaPT in its loss).
SU2 is the run's SU1 over the share of its epochs it took to first reach float32's
final test accuracy (aggregated as the figures are; the whole run where it never does), as the reference
computes it (``utils/analytics.py``: ``su_own / iso_acc`` against the float32 accuracy in its config; it
logs the accuracy per validation batch, qtrain per epoch, so the share counts the epoch that reaches it).

Some figures have a second reading shown beside ours (``beside``): Sec. 4.1.2's printed speedup formula
beside the reference code's that the tables print, and the sparsity weighted by weight count beside
Table 5's mean over tensors.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd

from qtrain.report.runs import ReportError, Run
from qtrain.report.tables import AGGREGATES, figure, run_frame, score

HEADER = ["paper", "table", "row", "column", "value", "method", "model", "data", "setting", "metric"]
UNMATCHED = ("train.epochs",)  # scales change the length of training, not which run a cell is


def paper_dir() -> Path:
    """The transcribed tables: installed inside the package, or ``results/paper/`` in a source checkout."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "paper", here.parent / "results" / "paper"):
        if candidate.is_dir() and any(candidate.glob("*.csv")):
            return candidate
    raise ReportError(f"the paper tables (results/paper/*.csv) are missing beside {here}")


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


def _config_value(run: Run, key: str) -> Any:
    node: Any = run.config
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
            if (run.method, run.model, run.get("data.stand_in_for") or run.data) == (cell.method, cell.model, cell.data)
            and run.status != "failed" and all(_same(_config_value(run, k), v) for k, v in setting)]


def _summary(run: Run, *path: str) -> float | None:
    node: Any = run.summary
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return None if node is None else float(node)


def _at_best(run: Run) -> float | None:
    metrics = run.metrics
    if metrics.empty or "test_acc" not in metrics:
        return None
    return float(metrics.effective_macs[metrics.test_acc.idxmax()])


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


def _speedup(baseline: Callable[[Run], str], formula: str) -> Callable[[Run], float | None]:
    return lambda run: _summary(run, run.method, "performance_model", "baselines", baseline(run), formula)


# One run's figure, per metric of the paper tables' vocabulary (results/paper/README.md).
FIGURES: dict[str, Callable[[Run], float | None]] = {
    "test_acc": lambda run: figure(run, "test_acc"),
    "best_test_acc": lambda run: figure(run, "best_test_acc"),
    "perplexity": lambda run: figure(run, "test_ppl"),
    "effective_macs": lambda run: figure(run, "effective_macs"),
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
    "savings_vs_sbm_percent": ("sbm", ("effective_macs", "effective_macs_at_best"), _saving),
    "energy_savings_vs_sbm_percent": ("sbm", ("energy_kj",), _saving),
    "latency_savings_vs_sbm_percent": ("sbm", ("latency_min",), _saving),
}


def _baseline_cell(table: pd.DataFrame, cell: pd.Series) -> pd.Series | None:
    """The cell a relative figure is measured against: same model and data, in the same row if there is one, and
    sharing the most of the cell's overrides outside ``method.`` (FracTrain Table 5's data halves)."""
    method, metrics, _ = RELATIVE[cell.metric]
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
    return ((other.model, other.data) == (run.model, run.data) and _data_keys(other) == _data_keys(run)
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


def _configs(runs: list[Run]) -> dict[Path, str]:
    """Each run's training config as the runs table names it (``tables.run_frame``'s config column)."""
    frame = run_frame(runs)
    return dict(zip((run.dir for run in runs), frame.config))


def _reader(runs: list[Run], configs: dict[Path, str], table: pd.DataFrame, cell: pd.Series, mine: list[Run],
            aggregate: str) -> Callable[[Run], float | None] | None:
    """How to read ``cell``'s figure from our runs ``mine``, of one training config (None: no baseline to measure
    it against). A relative figure takes its baseline from the runs of the baseline cell with that config, else
    (AdaPT's float32 runs put its L2 in the optimizer, AdaPT in its loss) those of the same setup."""
    if cell.metric in FIGURES:
        return FIGURES[cell.metric]
    if cell.metric == "speedup_su2":
        return _su2(runs, aggregate, FIGURES["speedup_su1"])
    reference = _baseline_cell(table, cell) if cell.metric in RELATIVE else None
    if reference is None:
        return None
    read, combine = FIGURES[reference.metric], RELATIVE[cell.metric][2]
    candidates = matching(runs, reference)
    same = [run for run in candidates if configs[run.dir] == configs[mine[0].dir]]
    base, _ = _aggregate(_read(same or [run for run in candidates if _same_setup(mine[0], run)], read), aggregate)
    if math.isnan(base):
        return None
    return lambda run: None if (value := read(run)) is None else combine(value, base)


def _ours(runs: list[Run], configs: dict[Path, str], table: pd.DataFrame, cell: pd.Series,
          aggregate: str) -> list[dict[str, Any]]:
    """One entry per training config among the runs matching ``cell``: our figure and its spread, the figure
    beside it where there is one, and how many runs there are."""
    groups: dict[str, list[Run]] = {}
    for run in matching(runs, cell):
        groups.setdefault(configs[run.dir], []).append(run)
    found = []
    for config, mine in groups.items():
        read = _reader(runs, configs, table, cell, mine, aggregate)
        value, std = _aggregate(_read(mine, read), aggregate) if read else (math.nan, math.nan)
        beside, what = math.nan, ""
        if cell.metric in BESIDE:
            what, other = BESIDE[cell.metric]
            if cell.metric == "speedup_su2":
                other = _su2(runs, aggregate, other)
            beside = _aggregate(_read(mine, other), aggregate)[0]
        found.append({"config": config, "ours": value, "ours_std": std, "beside": beside, "beside_is": what,
                      "runs": len(mine)})
    return found


def compare(runs: list[Run], name: str, aggregate: str = "mean") -> tuple[pd.DataFrame, int]:
    """The cells of paper table ``name`` that our runs reproduce: paper, ours (mean and std over seeds and folds,
    or the best run's), the difference, and a second reading beside ours where a figure has one.

    A cell that runs of several training configs match gets a row per config. Returns the frame and the
    number of the table's cells that no run matched.
    """
    if aggregate not in AGGREGATES:
        raise ReportError(f"--aggregate {aggregate} is not allowed (choose from: {', '.join(AGGREGATES)})")
    table = load_table(name)
    configs = _configs(runs)
    rows, unmatched = [], 0
    for _, cell in table.iterrows():
        found = _ours(runs, configs, table, cell, aggregate)
        unmatched += not found
        for entry in found:
            rows.append({"row": cell.row, "column": cell.column, "metric": cell.metric, "config": entry["config"],
                         "paper": cell.value, "ours": entry["ours"], "ours_std": entry["ours_std"],
                         "difference": entry["ours"] - cell.value, "beside": entry["beside"],
                         "beside_is": entry["beside_is"], "runs": entry["runs"]})
    columns = ["row", "column", "metric", "config", "paper", "ours", "ours_std", "difference", "beside", "beside_is",
               "runs"]
    return pd.DataFrame(rows, columns=columns), unmatched
