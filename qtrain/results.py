"""Run outputs: metrics.csv, precision.csv, cost.csv, summary.json, checkpoint.pt, each written atomically
(:func:`atomic_write`), and the run lock (:class:`RunLock`).
docs/running.md ("Run directories and results") describes each file and the lock."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import socket
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from qtrain.errors import RunDirError

if TYPE_CHECKING:
    import pandas as pd

METRICS, PRECISION, COST, SUMMARY, CHECKPOINT = "metrics.csv", "precision.csv", "cost.csv", "summary.json", "checkpoint.pt"
HYDRA_DIR, LOCK = ".hydra", ".qtrain.lock"
TMP_SUFFIX = ".tmp"
STATUSES = ("completed", "diverged", "failed")  # a summary's status
# What every checkpoint holds (qtrain.checkpoint.Checkpoint writes them all; rank_rng only under torchrun).
CHECKPOINT_KEYS = ("identity", "device_type", "model", "optimizer", "scheduler", "method", "step_schedule", "meter",
                   "progress", "precision_log", "rng")


def file_mode() -> int:
    """The mode a new file gets under the process's umask (``mkstemp`` alone gives 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    try:
        os.fchmod(fd, file_mode())
    finally:
        os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a folder made read-only meanwhile keeps it: the next run removes it
            Path(tmp).unlink(missing_ok=True)
        raise


def check_writable(run_dir: str | Path, what: str = "run directory") -> None:
    """Raise RunDirError unless ``run_dir`` (a ``what``) exists as a writable folder or can be created; leaves nothing
    behind."""
    run_dir = Path(run_dir)
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise RunDirError(f"cannot create the {what} {run_dir}: {existing} is not a directory")
    try:
        Path(tempfile.mkdtemp(dir=existing, prefix=".qtrain-probe-")).rmdir()
    except OSError as err:
        raise RunDirError(f"cannot write to the {what} {run_dir}: {err.strerror} in {existing}") from None


class _RecordingWriter:
    """A file's ``write`` and ``flush`` that remember the OSError a write raised."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def save_state(state: dict[str, Any], path: Path) -> None:
    """``torch.save(state, path)``, a refused write raised as the OSError it is (torch's own writer turns a full
    disk into ``RuntimeError: ... unexpected pos``), streamed to the file (no copy of the state in memory)."""
    import torch

    with open(path, "wb") as file:
        writer = _RecordingWriter(file)
        try:
            torch.save(state, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise


def load_state(path: Path) -> dict[str, Any]:
    """A checkpoint's contents, read as tensors and plain Python values only (``weights_only=True``)."""
    import torch  # here, not above: qtrain-report reads run directories without torch

    try:
        with warnings.catch_warnings():  # torch warns of a foreign pickle protocol before refusing it: the error says it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - unpickling raises assorted errors on foreign or damaged files
        raise RunDirError(f"{path} cannot be read as a qtrain checkpoint of plain tensors ({type(err).__name__}); "
                          "it was written by an older qtrain or by something else") from None
    missing = [key for key in CHECKPOINT_KEYS if key not in state] if isinstance(state, dict) else None
    if missing is None or missing:
        held = f"it lacks {', '.join(missing)}" if missing else f"it holds a {type(state).__name__}, not a dict"
        raise RunDirError(f"{path} is not a qtrain checkpoint ({held}); it was written by an older qtrain or by "
                          "something else")
    return state


# A completed run whose training loss ends this many times its first epoch's, and above EXPLODED_LOSS (no model at
# chance has a cross-entropy that high: log(vocabulary) is under 12 for 100,000 classes), learned nothing usable.
EXPLOSION_FACTOR, EXPLODED_LOSS = 100.0, 100.0


def loss_explosion(train_losses: list[float]) -> dict[str, Any] | None:
    """The epoch (from 1) at which the training loss first exceeded both bounds, with the losses; None if it never did."""
    finite = [(epoch, loss) for epoch, loss in enumerate(train_losses, 1) if loss is not None and math.isfinite(loss)]
    if not finite:
        return None
    first = finite[0][1]
    for epoch, loss in finite[1:]:
        if loss > EXPLODED_LOSS and loss > EXPLOSION_FACTOR * first:
            return {"epoch": epoch, "train_loss": loss, "first_epoch_train_loss": first}
    return None


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def strict_json(value: Any, **options: Any) -> str:
    """``value`` as JSON that strict parsers read: NaN and ±inf (which JSON lacks) written as null."""
    return json.dumps(_finite(value), allow_nan=False, default=str, **options)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# the figures a report reads from a summary: (section or None for the top level, key), each a number or null
SUMMARY_FIGURES = ((None, "best_test_acc"), (None, "epochs_completed"), ("final", "test_acc"), ("final", "test_loss"),
                   ("final", "test_ppl"), ("cost", "effective_macs"), ("cost", "percent_of_float32"))


def summary_problem(summary: Any) -> str:
    """What makes a parsed ``summary.json`` unusable (``""`` where nothing does): not an object, an unknown status,
    or a figure the report reads that is not a number."""
    if not isinstance(summary, dict):
        return f"it holds a JSON {type(summary).__name__}, not an object"
    if summary.get("status") not in STATUSES:
        return f"its status is {summary.get('status', '(absent)')!r}, not one of {', '.join(STATUSES)}"
    for section in ("final", "cost", "hardware"):
        if summary.get(section) is not None and not isinstance(summary[section], dict):
            return f"its {section} is a JSON {type(summary[section]).__name__}, not an object"
    for section, key in SUMMARY_FIGURES:
        value = (summary if section is None else summary.get(section) or {}).get(key)
        if value is not None and not _is_number(value):
            return f"its {key if section is None else f'{section}.{key}'} is {value!r}, not a number"
    return ""


def _refuse_constant(name: str) -> None:
    raise ValueError(f"it holds {name}, which JSON lacks")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"it holds {text}, beyond float range")
    return value


def recorded_config(run_dir: Path, summary: dict[str, Any]) -> Any:
    """The config a run recorded: its ``summary``'s, else its ``.hydra/config.yaml`` with interpolations resolved
    (YAML and OmegaConf raise assorted errors on a damaged file); None where it has neither."""
    if "config" in summary:
        return summary["config"]
    path = run_dir / HYDRA_DIR / "config.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf  # here, not above: as torch in load_state

    import qtrain.config  # noqa: F401 - registers the resolvers a run's .hydra/config.yaml may hold
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def load_summary(path: Path) -> dict[str, Any] | None:
    """The ``summary.json`` at ``path`` (None where there is none); ValueError saying why where it is unusable."""
    if not path.is_file():
        return None
    try:  # strictly: NaN, Infinity and numbers past float range are not JSON (qtrain writes them as null)
        summary = json.loads(path.read_text(), parse_constant=_refuse_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"it is not JSON ({type(err).__name__})") from None
    problem = summary_problem(summary)
    if problem:
        raise ValueError(problem)
    return summary


class RunLock:
    """An exclusive lock on a run directory, held from :meth:`acquire` to :meth:`release` (or exit)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise RunDirError naming its holder; creates the directory if needed."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, file_mode())
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "starting up"
                    os.close(fd)
                    raise RunDirError(f"{self.path.parent} is in use by another qtrain run ({holder}): wait for it "
                                      "to end, or choose another directory with hydra.run.dir=DIR") from None
                try:  # the last holder removes the file on release: lock the file that is still there
                    current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    current = False
                if current:
                    break
                os.close(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                      .encode(), 0)
        except OSError as err:
            raise RunDirError(f"cannot write to the run directory {self.path.parent}: {err.strerror}") from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


class RunFiles:
    """The result files of one run directory."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)

    def lock(self) -> RunLock:
        return RunLock(self.dir)

    def _write(self, path: Path, write: Callable[[Path], None]) -> None:
        """``atomic_write``, a refused write (a full disk, a folder made read-only) said in one line."""
        try:
            atomic_write(path, write)
        except OSError as err:
            raise RunDirError(f"cannot write {path}: {err.strerror or err} (the run keeps its last complete epoch: "
                              "rerun the same command to resume once it can be written)") from None

    def write_table(self, name: str, table: pd.DataFrame) -> None:
        self._write(self.dir / name, lambda tmp: table.to_csv(tmp, index=False))

    def write_summary(self, summary: dict[str, Any]) -> None:
        self._write(self.dir / SUMMARY, lambda tmp: tmp.write_text(strict_json(summary, indent=2) + "\n"))

    def read_summary(self) -> dict[str, Any] | None:
        path = self.dir / SUMMARY
        try:
            return load_summary(path)
        except ValueError as err:
            raise RunDirError(f"{path} is not a qtrain summary ({err})") from None

    def write_config(self, config: DictConfig, overrides: list[str]) -> None:
        """``.hydra/config.yaml`` and ``.hydra/overrides.yaml``: the run's config and its command-line overrides."""
        for name, content in (("config.yaml", config), ("overrides.yaml", OmegaConf.create(overrides))):
            self._write(self.dir / HYDRA_DIR / name, lambda tmp, c=content: tmp.write_text(OmegaConf.to_yaml(c)))

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        self._write(self.dir / CHECKPOINT, lambda tmp: save_state(state, tmp))

    def load_checkpoint(self) -> dict[str, Any] | None:
        path = self.dir / CHECKPOINT
        return load_state(path) if path.is_file() else None

    def remove_stale_temps(self) -> None:
        """Remove the temporary files of writes that a kill interrupted (call while holding the lock)."""
        for folder in (self.dir, self.dir / HYDRA_DIR):
            for path in folder.glob(f".*{TMP_SUFFIX}"):
                path.unlink(missing_ok=True)

    def clear(self) -> None:
        """Remove the results and checkpoint of an earlier attempt (for ``force=true``)."""
        for name in (METRICS, PRECISION, COST, SUMMARY, CHECKPOINT):
            (self.dir / name).unlink(missing_ok=True)
