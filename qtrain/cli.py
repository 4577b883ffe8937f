"""Entry point ``qtrain``: the Hydra app over ``conf/`` (:func:`main`) and its callback :class:`RunCallback`, which
checks a run before its directory exists and records a sweep's jobs and prints its tables.
docs/running.md describes the errors and sweeps; docs/design.md the run lifecycle."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from qtrain import distributed
from qtrain.config import GROUPS, check_command_line, group_options, run_dir_name, sweep_size, swept_keys, validate
from qtrain.errors import ConfigError, DivergedError, QtrainError, RunDirError
from qtrain.launch import job_tag, job_threads, machine_cores, tag_log_lines, use_threads
from qtrain.resources import conf_dir

_new_dirs: list[Path] = []  # the folders of this single run's directory that did not exist before it


def config_groups(configs: Path) -> str:
    """The groups a user chooses from, one line each, for ``--help`` (not the ``scale/*`` files the scales compose)."""
    return "\n".join(f"{group}: {', '.join(group_options(configs, group))}" for group in GROUPS)


def _fail(err: QtrainError) -> NoReturn:
    print(f"qtrain: error: {err}", file=sys.stderr)
    sys.exit(err.exit_code)


def _task_config(config: DictConfig) -> DictConfig:
    return OmegaConf.masked_copy(config, [key for key in config.keys() if key != "hydra"])


def runs_table(run_dirs: list[str | Path]) -> str:
    """The closing table of a run or a sweep: ``qtrain-report``'s, one row per configuration, seeds averaged."""
    from qtrain.report.runs import Run
    from qtrain.report.tables import display_frame, run_frame, summary_frame

    runs = [Run.load(Path(d)) for d in run_dirs]
    return display_frame(summary_frame(run_frame(runs))).to_string(index=False)


def sweep_table(jobs: list[dict[str, Any]]) -> str:
    """The jobs of a sweep: number, status and directory (the figures are in :func:`runs_table`)."""
    import pandas as pd

    rows = [{"job": job["num"], "status": job["status"], "directory": os.path.relpath(job["dir"])}
            for job in sorted(jobs, key=lambda j: j["num"])]
    return pd.DataFrame(rows).to_string(index=False)


class RunCallback(Callback):
    """Hydra callbacks: the checks before a single run's directory exists; a sweep's record and closing table."""

    def __init__(self) -> None:
        # A sweep's record: a folder with one JSON file per job, written where the job runs (appends to one
        # shared file are not atomic on the network filesystems a cluster's jobs share).
        self.manifest: Path | None = None
        self.threads: int | None = None  # torch threads of each job of a sweep (qtrain.launch)
        self.swept: set[str] | None = None  # the keys a parallel sweep varies: its jobs tag their log lines with them

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        HydraConfig.instance().set_config(config)
        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
        _new_dirs[:] = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
        task = _task_config(config)
        try:
            validate(task)  # every group's values, the method's and model's too, first: no torch import needed
            from qtrain.run import preflight

            preflight(task, run_dir)
        except QtrainError as err:
            _fail(err)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        overrides = list(config.hydra.overrides.task)
        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        try:
            self.threads = job_threads(config.hydra.launcher, sweep_size(overrides), machine_cores())
            from qtrain.results import check_writable

            check_writable(sweep_dir, "sweep directory")
        except QtrainError as err:
            _fail(err)
        if "n_jobs" in config.hydra.launcher:  # joblib: the jobs share this terminal (submitit's log to files of their own)
            self.swept = swept_keys(overrides)
        self.manifest = sweep_dir / f".qtrain-sweep-{os.getpid()}-{time.time_ns()}"

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.threads is not None:  # in the job's own process, before its run imports torch
            use_threads(self.threads)
        if self.swept is not None:
            tag_log_lines(job_tag(config.hydra.job.num, list(config.hydra.overrides.task), self.swept))

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if self.manifest is None:
            return
        if job_return.status == JobStatus.COMPLETED:
            outcome = job_return.return_value
        else:
            outcome = {"status": "failed", "error": f"{type(job_return._return_value).__name__}: {job_return._return_value}"}
        record = {"num": config.hydra.job.num, "dir": config.hydra.runtime.output_dir, **outcome}
        from qtrain.results import atomic_write, strict_json

        try:
            atomic_write(self.manifest / f"{record['num']}.json", lambda tmp: tmp.write_text(strict_json(record)))
        except OSError as err:  # a full disk: the sweep's end counts the job as unrecorded
            print(f"qtrain: error: job {record['num']}: cannot record its outcome in {self.manifest}: "
                  f"{err.strerror or err}", file=sys.stderr)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.manifest is None:
            return
        jobs = [json.loads(path.read_text()) for path in self.manifest.glob("*.json")] if self.manifest.is_dir() else []
        shutil.rmtree(self.manifest, ignore_errors=True)
        launched = sweep_size(list(config.hydra.overrides.task))
        missing = (launched or 0) - len(jobs)
        if not jobs and not missing:
            return
        print(sweep_table(jobs))
        finished = [job["dir"] for job in jobs if job["status"] != "failed" and (Path(job["dir"]) / "summary.json").is_file()]
        if finished:
            print(runs_table(finished))
        bad = [job for job in sorted(jobs, key=lambda j: j["num"]) if job["status"] != "completed"]
        for job in bad:
            print(f"qtrain: error: job {job['num']} {job['status']}: {job['error']}", file=sys.stderr)
        if missing > 0:
            print(f"qtrain: error: {missing} of the sweep's {launched} jobs left no record (a full disk, or a job killed "
                  "from outside): rerun the sweep to resume them", file=sys.stderr)
        if bad or missing > 0:
            sys.exit(1)


def _remove_new_dirs() -> None:
    """Remove the folders this single run made, with the config it wrote, unless it saved an epoch's checkpoint."""
    if _new_dirs and not (_new_dirs[0] / "checkpoint.pt").exists():  # an error in the first epoch (a bad image)
        shutil.rmtree(_new_dirs[0] / ".hydra", ignore_errors=True)
    for path in _new_dirs:  # deepest first; a folder something else wrote into stays
        try:
            path.rmdir()
        except OSError:
            return


def _task(cfg: DictConfig) -> dict[str, Any]:
    from qtrain.run import run
    from qtrain.run_state import record_failure

    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    if not distributed.is_writer():  # rank 0 tells the story once
        logging.getLogger("qtrain").setLevel(logging.WARNING)
    sweep = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        summary = run(cfg, run_dir, list(hydra_cfg.overrides.task))
    except QtrainError as err:
        if not sweep:
            _remove_new_dirs()
            _fail(err)
        print(f"qtrain: error: {err}", file=sys.stderr)
        if not isinstance(err, (DivergedError, RunDirError)):
            record_failure(cfg, run_dir, str(err))
        return {"status": "diverged" if isinstance(err, DivergedError) else "failed", "error": str(err)}
    except Exception as err:  # noqa: BLE001 - in a sweep one job's crash is recorded and the others go on
        if not sweep:
            raise
        traceback.print_exc()
        error = f"{type(err).__name__}: {err}".splitlines()[0]
        record_failure(cfg, run_dir, error)
        return {"status": "failed", "error": error}
    twin = None
    if distributed.is_writer() and not (Path(run_dir) / "summary.json").is_file():  # reported from a finished twin
        from qtrain.config import identity
        from qtrain.run_state import finished_twin

        twin = finished_twin(run_dir, identity(cfg))
        with contextlib.suppress(OSError):  # the directory made for it, empty
            Path(run_dir).rmdir()
    shown = str(twin or run_dir)
    if not sweep and distributed.is_writer():
        print(runs_table([shown]))
        print(f"results: {shown}")
    return {"status": summary["status"], **({"dir": shown} if twin else {})}


class Terminated(BaseException):
    """SIGTERM (a cluster's preemption, ``kill``): stop as Ctrl-C does. Raised in the main process, it unwinds a
    parallel sweep's launcher, which then stops its worker processes; every run keeps its last complete epoch."""


def _terminate(signum: int, frame: Any) -> NoReturn:
    raise Terminated


class _QuietCudaProbe(logging.Filter):
    """Drop torch's ``No CUDA runtime is found`` notice: on a CPU-only machine there is nothing to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


def main() -> None:
    """``qtrain``: check the command line, then hand over to Hydra."""
    configs = conf_dir()
    args = get_args_parser().parse_args()
    try:
        if args.multirun and distributed.active():
            raise ConfigError(f"a sweep (-m) cannot run under torchrun (WORLD_SIZE={distributed.world_size()}): start "
                              "each job with torchrun, or the sweep on one process")
        for given, flag in ((args.config_path, "-cp/--config-path"), (args.config_name, "-cn/--config-name"),
                            (args.config_dir, "-cd/--config-dir")):
            if given:  # every check and the run's identity read qtrain's own config tree
                raise ConfigError(f"{flag} {given} is not allowed: qtrain composes its own config tree (set keys on "
                                  "the command line, or choose experiment=NAME)")
        if args.experimental_rerun:
            raise ConfigError(f"--experimental-rerun {args.experimental_rerun} is not allowed: it unpickles the file it "
                              "is given (rerun a run with the command line in its .hydra/overrides.yaml)")
        if not args.shell_completion:
            check_command_line(args.overrides, configs, args.multirun)
    except QtrainError as err:
        _fail(err)
    OmegaConf.register_new_resolver("qtrain.run_dir_name", run_dir_name, replace=True)
    OmegaConf.register_new_resolver("qtrain.config_groups", lambda: config_groups(configs), replace=True)
    logging.getLogger("torch._inductor").setLevel(logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").addFilter(_QuietCudaProbe())
    signal.signal(signal.SIGTERM, _terminate)
    # a parallel sweep stopped by a signal leaves joblib's semaphores to the resource tracker, which would warn of them
    os.environ.setdefault("PYTHONWARNINGS", "ignore:resource_tracker:UserWarning")
    try:
        hydra.main(config_path=str(configs), config_name="config", version_base="1.3")(_task)()
    except (KeyboardInterrupt, Terminated) as stop:  # the runs keep their last complete epoch; the user knows what to do
        how, code = ("terminated", 143) if isinstance(stop, Terminated) else ("interrupted", 130)
        if distributed.is_writer():  # once, not from every torchrun rank
            print(f"qtrain: {how}: each run keeps its last complete epoch (rerun the same command to resume)",
                  file=sys.stderr)
        sys.exit(code)


if __name__ == "__main__":
    main()
