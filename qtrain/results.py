"""Run outputs (DESIGN.md, "Results"): metrics.csv, precision.csv, cost.csv, summary.json, checkpoint.pt.

Every file is written to a temporary name in the run directory and renamed over the old one, so a
kill at any moment leaves either the previous complete file or the new complete file, never half.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch

METRICS, PRECISION, COST, SUMMARY, CHECKPOINT = "metrics.csv", "precision.csv", "cost.csv", "summary.json", "checkpoint.pt"


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunFiles:
    """The result files of one run directory."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)

    def write_table(self, name: str, table: pd.DataFrame) -> None:
        atomic_write(self.dir / name, lambda tmp: table.to_csv(tmp, index=False))

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write(self.dir / SUMMARY, lambda tmp: tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n"))

    def read_summary(self) -> dict[str, Any] | None:
        path = self.dir / SUMMARY
        return json.loads(path.read_text()) if path.is_file() else None

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        atomic_write(self.dir / CHECKPOINT, lambda tmp: torch.save(state, tmp))

    def load_checkpoint(self) -> dict[str, Any] | None:
        path = self.dir / CHECKPOINT
        return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None

    def clear(self) -> None:
        """Remove the results and checkpoint of an earlier attempt (for ``force=true``)."""
        for name in (METRICS, PRECISION, COST, SUMMARY, CHECKPOINT):
            (self.dir / name).unlink(missing_ok=True)
