"""Run directories as the report reads them (:class:`Run`): each run's summary, config, metrics, precision trace,
status and notes; :func:`find_runs` finds them, :func:`one_per_identity` keeps one directory per identity.
docs/reports.md describes statuses and scales; docs/running.md the files (written by ``results.py``)."""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from qtrain.config import OMITTED_AT, digest, identity
from qtrain.errors import QtrainError
from qtrain.results import CHECKPOINT, HYDRA_DIR, LOCK, METRICS, PRECISION, SUMMARY, load_summary, loss_explosion, recorded_config

MARKERS = (SUMMARY, CHECKPOINT, METRICS)


class ReportError(QtrainError):
    """A report asked of something that is not there (no runs, an unknown paper table, a bad selector)."""


class _Damaged(Exception):
    """A run file that cannot be read; the message says which and why."""


def _read_csv(path: Path) -> pd.DataFrame:
    if not path.is_file() or path.stat().st_size == 0:
        return pd.DataFrame()
    try:
        return pd.read_csv(path)
    except (UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise _Damaged(f"{path.name}: {type(err).__name__}: {str(err).strip().splitlines()[0]}") from None


def _read_summary(run_dir: Path) -> dict[str, Any]:
    try:
        return load_summary(run_dir / SUMMARY) or {}
    except ValueError as err:
        raise _Damaged(f"{SUMMARY}: {err}") from None


def _read_config(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    try:
        config = recorded_config(run_dir, summary)
    except Exception as err:  # noqa: BLE001 - YAML and OmegaConf raise assorted errors on a damaged file
        raise _Damaged(f"{HYDRA_DIR}/config.yaml: {type(err).__name__}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise _Damaged(f"its config is a {type(config).__name__}, not a mapping")
    return config


def _locked(run_dir: Path) -> bool:
    """Whether a live process holds the run's lock (the kernel drops the lock of a dead one)."""
    path = run_dir / LOCK
    if not path.is_file():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``; lists stay values."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat


@dataclass
class Run:
    """One run directory, read once."""

    dir: Path
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    damage: str = ""  # the first file found unreadable, and why
    stands_in_for: str = ""  # the dataset a report reads this run's data as (``qtrain-report --stand-in``)

    @classmethod
    def load(cls, run_dir: Path) -> Run:
        summary: dict[str, Any] = {}
        try:
            summary = _read_summary(run_dir)
            return cls(run_dir, summary, _read_config(run_dir, summary))
        except _Damaged as err:
            return cls(run_dir, {}, {}, str(err))

    def _table(self, name: str) -> pd.DataFrame:
        try:
            return _read_csv(self.dir / name)
        except _Damaged as err:
            self.damage = self.damage or str(err)
            return pd.DataFrame()

    @cached_property
    def metrics(self) -> pd.DataFrame:
        return self._table(METRICS)

    @cached_property
    def precision(self) -> pd.DataFrame:
        return self._table(PRECISION)

    @cached_property
    def status(self) -> str:
        _ = self.metrics, self.precision  # reading them finds them damaged, if they are
        if self.damage:
            return f"damaged: {self.damage}"
        if self.summary:
            return self.summary["status"]
        return "running" if _locked(self.dir) else "stopped"

    @cached_property
    def notes(self) -> str:
        """What its status does not say: a run file of its epochs missing, a training loss that exploded."""
        notes = [f"no {name}" for name in (METRICS, PRECISION) if self.epochs and not (self.dir / name).is_file()]
        losses = self.metrics["train_loss"].tolist() if "train_loss" in self.metrics else []
        exploded = self.summary.get("loss_exploded") or loss_explosion(losses)
        if exploded:
            notes.append(f"loss exploded: {exploded['train_loss']:.3g} at epoch {exploded['epoch']} "
                         f"(epoch 1: {exploded['first_epoch_train_loss']:.3g})")
        return "; ".join(notes)

    @cached_property
    def run_id(self) -> str | None:
        """The digest of the run's identity: its summary's, else the one its directory's name ends in, else its
        config's (a copy of a run directory under another name)."""
        found = re.search(r"id=([0-9a-f]{8})$", self.dir.name)
        if self.summary.get("run_id"):
            return self.summary["run_id"]
        if found:
            return found.group(1)
        return digest(identity(self.config)) if self.config else None

    @cached_property
    def flat_config(self) -> dict[str, Any]:
        """The config by dotted key, without the keys that a run made before them lacks, where they are at the
        value such a run had (:data:`qtrain.config.OMITTED_AT`)."""
        return {key: value for key, value in flatten(self.config).items()
                if key not in OMITTED_AT or value != OMITTED_AT[key]}

    def get(self, key: str, default: Any = None) -> Any:
        """A config value by dotted key (``method.target_bits``)."""
        return self.flat_config.get(key, default)

    @property
    def method(self) -> str:
        return self.summary.get("method") or self.get("method.name", "?")

    @property
    def model(self) -> str:
        return self.summary.get("model") or self.get("model.name", "?")

    @property
    def data(self) -> str:
        return self.summary.get("data") or self.get("data.name", "?")

    @property
    def paper_data(self) -> str:
        """The dataset whose papers' cells this run is matched with: the one it stands in for, else its own."""
        return self.stands_in_for or self.get("data.stand_in_for") or self.data

    @property
    def seed(self) -> int | None:
        return self.summary.get("seed", self.get("seed"))

    @property
    def epochs(self) -> int:
        if "epochs_completed" in self.summary:
            return self.summary["epochs_completed"]
        return len(self.metrics)

    def last(self, column: str) -> float | None:
        """The last epoch's value of a ``metrics.csv`` column (None when the run has no such column or epoch)."""
        if column not in self.metrics or self.metrics[column].dropna().empty:
            return None
        return float(self.metrics[column].dropna().iloc[-1])

    @cached_property
    def scale(self) -> str:
        """``paper``, ``mini`` or ``smoke``: the scale choice on the run's recorded command line (module docstring)."""
        try:
            overrides = yaml.safe_load((self.dir / HYDRA_DIR / "overrides.yaml").read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):  # none recorded, or unreadable: the fallbacks below
            overrides = None
        for text in overrides if isinstance(overrides, list) else []:
            key, sep, value = str(text).lstrip("+~").partition("=")
            if sep and key == "scale":
                return value
        return "smoke" if self.get("data.stand_in_for") else "paper"


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Every run directory at or under ``paths``, sorted by path; a path that holds none is an error."""
    runs: list[Run] = []
    for path in map(Path, paths):
        if not path.exists():
            raise ReportError(f"{path} does not exist: give run directories or folders that hold them")
        found = sorted({marker.parent for name in MARKERS for marker in path.rglob(name)
                        if HYDRA_DIR not in marker.parts})
        if not found:
            raise ReportError(f"{path} holds no qtrain run (no {', '.join(MARKERS)} under it)")
        runs.extend(Run.load(run_dir) for run_dir in found)
    return sorted({run.dir.resolve(): run for run in runs}.values(), key=lambda run: str(run.dir))


def one_per_identity(runs: list[Run]) -> tuple[list[Run], list[Run]]:
    """The runs with each identity once (a completed one first, then the most epochs), and the others."""
    best: dict[str, Run] = {}
    for run in runs:
        held = best.get(run.run_id) if run.run_id else None
        if held is None or (run.status == "completed", run.epochs) > (held.status == "completed", held.epochs):
            best[run.run_id or str(run.dir)] = run
    kept = {id(run) for run in best.values()}
    return [run for run in runs if id(run) in kept], [run for run in runs if id(run) not in kept]
