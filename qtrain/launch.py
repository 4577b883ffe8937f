"""How runs use the machine: the torch threads of each job of a sweep under Hydra's launchers, its log lines' tag,
and the C allocator's setting every run takes (:func:`keep_freed_memory`).
docs/running.md ("Sweeps on many cores and on a cluster") gives the rule for each launcher."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping
from typing import Any

from qtrain.config.schema import is_integer
from qtrain.errors import ConfigError

# The thread pools torch and the BLAS libraries it may load size themselves from when they start.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def _positive_int(key: str, value: Any) -> int:
    if not is_integer(value) or value < 1:
        raise ConfigError(f"hydra.launcher.{key}={value!r} is not allowed: it must be an integer >= 1")
    return value


def job_threads(launcher: Mapping[str, Any], jobs: int | None, cores: int) -> int | None:
    """The torch threads of each job of a sweep, or None for torch's default.

    ``launcher`` is the sweep's ``hydra.launcher`` config, ``jobs`` the number of jobs in the sweep
    (None where unknown), ``cores`` the cores this machine gives the sweep.
    """
    if "n_jobs" in launcher:  # joblib
        n_jobs = launcher["n_jobs"]
        if not is_integer(n_jobs) or n_jobs == 0:
            raise ConfigError(f"hydra.launcher.n_jobs={n_jobs!r} is not allowed: it must be a number of jobs at a time "
                              "(>= 1) or -k for all cores but k-1 (-1: one job per core)")
        running = n_jobs if n_jobs > 0 else max(cores + 1 + n_jobs, 1)
        if jobs is not None:
            running = min(running, jobs)
        return max(1, cores // running)
    if launcher.get("cpus_per_task") is not None:  # submitit: SLURM or local
        return _positive_int("cpus_per_task", launcher["cpus_per_task"])
    return None


def machine_cores() -> int:
    """The cores this process may use: its CPU affinity and cgroup quota, as joblib counts them for ``n_jobs=-1``."""
    from joblib import cpu_count

    return cpu_count()


def use_threads(threads: int) -> None:
    """Run torch in this process with ``threads`` threads (set before its pools start where they have not yet)."""
    for var in THREAD_VARS:
        os.environ[var] = str(threads)
    import torch

    torch.set_num_threads(threads)


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the OS; True where it took effect.

    torch allocates CPU tensors with the C allocator. glibc maps a large block afresh and unmaps it when it is
    freed (above a threshold that adapts as the process runs), and trims its heap when the top is freed: a
    training step then takes a page fault for each 4 KiB of every activation and gradient it allocates again.
    On the 2-core development machine that was 133,000 faults a step of the small Transformer (batch 16 x 64
    tokens; float32's step 377 ms, 245 ms without them) and a few hundred to 37,000 a ResNet-20 step (batch 128),
    the count depending on where each process's heap happened to lie (the same SBM step took 349 to 526 ms in
    fresh processes). With no block mapped and the heap never trimmed, a step after the first takes almost none.
    The price: the resident size stays at the heap's high-water mark, which freed blocks can leave above the live
    tensors' (the Transformer's run peaked at 1.68 GB against 1.30 GB). Other C libraries (musl, macOS) have no
    such setting: nothing changes there.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no C library to load, or one without mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1


def job_tag(num: int, overrides: list[str], swept: set[str]) -> str:
    """A job's short name in the log: ``[3 method=dfq seed=1]``, its number and its values of the ``swept`` keys."""
    values = [text for text in overrides if text.partition("=")[0].lstrip("+~") in swept]
    return "[" + " ".join([str(num), *values]) + "]"


class _Tagged(logging.Formatter):
    """Another formatter's lines, each prefixed with a tag."""

    def __init__(self, tag: str, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.tag, self.inner = tag, inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(f"{self.tag} {line}" for line in self.inner.format(record).splitlines())


def tag_log_lines(tag: str) -> None:
    """Prefix every line this process logs through the root logger's handlers (Hydra's job logging) with ``tag``."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, _Tagged):
            handler.setFormatter(_Tagged(tag, handler.formatter))
