"""What a run directory holds and what that means for a run: nothing, the same run (finished, diverged, failed or
resumable from its checkpoint), a finished twin under another name, or another run; and a failed sweep job's record."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from qtrain.config import digest, first_difference, identity
from qtrain.errors import DivergedError, QtrainError, RunDirError
from qtrain.results import SUMMARY, RunFiles
from qtrain.summary import versions

log = logging.getLogger(__name__)


def earlier_identity(files: RunFiles, summary: dict[str, Any] | None) -> tuple[dict | None, dict | None]:
    """The identity of the run the directory holds (from its summary, else its checkpoint), and the checkpoint."""
    checkpoint = None if summary is not None and summary["status"] != "failed" else files.load_checkpoint()
    if checkpoint is not None:
        return checkpoint["identity"], checkpoint
    if summary is not None:
        if isinstance(summary.get("identity"), dict):
            return summary["identity"], None
        if isinstance(summary.get("config"), dict):
            return identity(summary["config"]), None
        raise RunDirError(f"{files.dir / SUMMARY} is not a qtrain summary (it names no config)")
    return None, None


def finished_twin(run_dir: str | Path, ident: dict[str, Any]) -> Path | None:
    """A directory beside ``run_dir``, under another name, that holds a completed run of identity ``ident``."""
    run_dir = Path(run_dir)
    suffix = f"id={digest(ident)}"
    for other in sorted(run_dir.parent.glob(f"*{suffix}")):
        if other == run_dir or not other.name.endswith(suffix) or not other.is_dir():
            continue
        try:
            summary = RunFiles(other).read_summary()
        except RunDirError:
            continue
        if summary is not None and summary["status"] == "completed" and summary.get("identity") == ident:
            return other
    return None


def foreign(files: RunFiles, earlier: dict | None, ident: dict[str, Any]) -> str:
    difference = "" if earlier is None else first_difference(earlier, ident)
    return difference and (f"{files.dir} holds another run ({difference}): pass force=true to replace it, "
                           "or choose another directory with hydra.run.dir=DIR")


def record_failure(cfg: DictConfig, run_dir: str | Path, error: str) -> None:
    """Record a failed sweep job in its directory: a ``failed`` summary with the one-line error and the config.

    Nothing is written where the directory holds another run, a finished one, or is in use or unwritable.
    """
    files = RunFiles(run_dir)
    ident = identity(cfg)
    try:
        with files.lock():
            summary = files.read_summary()
            if summary is not None and summary["status"] != "failed":
                return
            earlier, _ = earlier_identity(files, summary)
            if foreign(files, earlier, ident):
                return
            files.write_summary({"status": "failed", "error": error, "method": cfg.method.name, "model": cfg.model.name,
                                 "data": cfg.data.name, "seed": cfg.seed, "versions": versions(),
                                 "run_id": digest(ident), "identity": ident,
                                 "config": OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)})
    except QtrainError:
        return


def decide(cfg: DictConfig, files: RunFiles, device: torch.device) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """What the locked directory holds for this run: (a finished run's summary, or None; the checkpoint to resume, or None)."""
    files.remove_stale_temps()
    if cfg.force:
        files.clear()
    try:
        summary = files.read_summary()
        earlier, checkpoint = earlier_identity(files, summary)
    except RunDirError as err:
        raise RunDirError(f"{err}: pass force=true to replace it, or choose another directory with hydra.run.dir=DIR") \
            from None
    mismatch = foreign(files, earlier, identity(cfg))
    if mismatch:
        raise RunDirError(mismatch)
    if summary is not None and summary["status"] == "completed":
        log.info("%s already holds a finished run (force=true reruns it)", files.dir)
        return summary, None
    twin = None if summary is not None or checkpoint is not None or cfg.force else finished_twin(files.dir, identity(cfg))
    if twin is not None:
        log.info("%s already holds this run, finished (the same identity under another name): it is not trained again",
                 twin)
        return RunFiles(twin).read_summary(), None
    if summary is not None and summary["status"] == "diverged":
        where = summary.get("diverged") if isinstance(summary.get("diverged"), dict) else {}
        raise DivergedError(f"{files.dir} holds a run that diverged (the loss became {where.get('loss', '?')} at epoch "
                            f"{where.get('epoch', '?')}, step {where.get('step', '?')}): force=true starts it over")
    if checkpoint is not None and checkpoint["device_type"] != device.type:
        raise RunDirError(f"{files.dir} holds a run trained on {checkpoint['device_type']}, and device={cfg.device} "
                          f"is {device.type} here: resume it on {checkpoint['device_type']}, or pass force=true")
    return None, checkpoint
