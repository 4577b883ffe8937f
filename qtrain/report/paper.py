"""Paper mode: the published tables (``results/paper/*.csv``) with our runs' figures beside them.

Each CSV cell names the qtrain run that reproduces it (method, model, data and the overrides in
``setting``) and which figure it is (``metric``; the vocabulary is ``results/paper/README.md``'s). A cell
is matched by every run of that method, model and data whose config holds each override of its
setting, ``train.epochs`` excepted (a ``mini`` or ``smoke`` scale shortens training; ``smoke``'s synthetic data
names the dataset it stands in for in ``data.stand_in_for``); the seeds' mean
and standard deviation are shown beside the paper's figure, with the difference ours − paper.

Figures relative to a baseline (``acc_drop``, the ``*_vs_sbm`` ones) use the table's own baseline cell:
the float32 or SBM cell of the same model and data, in the same row where the table has one there.
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
from qtrain.report.tables import figure, run_frame

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


def _speedup_su3(run: Run) -> float | None:
    """SU3 is against MuPPET's float32 baseline: AdaPT's ``muppet`` baseline, MuPPET's own ``same`` one."""
    baseline = "same" if run.method == "muppet" else "muppet"
    return _summary(run, run.method, "performance_model", "baselines", baseline, "SU")


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
    "speedup_su1": _performance("baselines", "same", "SU"),
    "speedup_su2": _performance("baselines", "iso", "SU"),
    "speedup_su3": _speedup_su3,
    "final_sparsity": _performance("sparsity", "final"),
    "average_sparsity": _performance("sparsity", "average"),
    "inference_size_ratio": _performance("inference", "SZ"),
    "inference_speedup": _performance("inference", "SU"),
}


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


def _stats(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def _configs(runs: list[Run]) -> dict[Path, str]:
    """Each run's training config as the runs table names it (``tables.run_frame``'s config column)."""
    frame = run_frame(runs)
    return dict(zip((run.dir for run in runs), frame.config))


def _ours(runs: list[Run], configs: dict[Path, str], table: pd.DataFrame, cell: pd.Series) -> list[dict[str, Any]]:
    """One entry per training config among the runs matching ``cell``: our figures (one per seed) and the runs.

    A relative figure takes its baseline from the runs of the baseline cell with the same training config.
    """
    groups: dict[str, list[Run]] = {}
    for run in matching(runs, cell):
        groups.setdefault(configs[run.dir], []).append(run)
    reference = _baseline_cell(table, cell) if cell.metric in RELATIVE else None
    found = []
    for config, mine in groups.items():
        values: list[float] = []
        if cell.metric in FIGURES:
            values = [v for v in map(FIGURES[cell.metric], mine) if v is not None]
        elif reference is not None:
            read, combine = FIGURES[reference.metric], RELATIVE[cell.metric][2]
            base = [v for v in (read(run) for run in matching(runs, reference) if configs[run.dir] == config)
                    if v is not None]
            if base:
                values = [combine(v, statistics.fmean(base)) for v in map(read, mine) if v is not None]
        found.append({"config": config, "values": values, "runs": len(mine)})
    return found


def compare(runs: list[Run], name: str) -> tuple[pd.DataFrame, int]:
    """The cells of paper table ``name`` that our runs reproduce: paper, ours (mean, std over seeds), difference.

    A cell that runs of several training configs match gets a row per config. Returns the frame and the
    number of the table's cells that no run matched.
    """
    table = load_table(name)
    configs = _configs(runs)
    rows, unmatched = [], 0
    for _, cell in table.iterrows():
        found = _ours(runs, configs, table, cell)
        unmatched += not found
        for entry in found:
            mean, std = _stats(entry["values"])
            rows.append({"row": cell.row, "column": cell.column, "metric": cell.metric, "config": entry["config"],
                         "paper": cell.value, "ours": mean, "ours_std": std, "difference": mean - cell.value,
                         "runs": entry["runs"]})
    columns = ["row", "column", "metric", "config", "paper", "ours", "ours_std", "difference", "runs"]
    return pd.DataFrame(rows, columns=columns), unmatched
