"""One run: config -> data, model, method, trainer -> results. :func:`run` checks what needs no data
(:func:`preflight`), locks the run directory, then reports, resumes or trains it (rank 0 decides under torchrun).
docs/running.md describes the run directory, the identity and resuming; docs/design.md the run lifecycle."""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from qtrain import distributed
from qtrain.checkpoint import Checkpoint, rng_state
from qtrain.config import identity, recorded, validate, with_keys_added_since
from qtrain.cost import CostMeter, float32_layers_of, float32_share, gemm_layers
from qtrain.data import DATASETS, load_data
from qtrain.data.base import Periods, Stream
from qtrain.errors import ConfigError, DivergedError, RunDirError
from qtrain.launch import keep_freed_memory
from qtrain.methods import Method, RunFacts, build_method
from qtrain.models import build_model, model_task
from qtrain.optim import build_optimizer, build_scheduler, build_step_schedule
from qtrain.precision import precision_rows
from qtrain.quant.rounding import set_fused
from qtrain.results import (
    CHECKPOINT,
    COST,
    METRICS,
    PRECISION,
    SUMMARY,
    RunFiles,
    check_writable,
    load_state,
    load_summary,
    recorded_config,
)
from qtrain.run_state import decide
from qtrain.summary import data_sizes, summarize
from qtrain.task import Task
from qtrain.train import Diverged, Progress, Trainer

log = logging.getLogger(__name__)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda is not allowed here: no CUDA device is available (choose from: auto, cpu)")
    return torch.device(name)


def float32_kernels() -> None:
    """On CUDA, cuDNN's deterministic algorithms (no benchmarking race between them) and no TF32: convolutions and
    matmuls take float32 inputs as they are. Nothing changes on the CPU."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False


def seed_everything(seed: int) -> None:
    """Every generator seeded, and :func:`float32_kernels`."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    float32_kernels()


def initial_weights(run_dir: str) -> dict[str, torch.Tensor]:
    """The final model weights of the finished run in ``run_dir`` (``train.init_from``)."""
    files = RunFiles(run_dir)
    try:
        summary = files.read_summary() if files.dir.is_dir() else None
        if summary is None or summary["status"] != "completed":
            raise ConfigError(f"train.init_from={run_dir} is not allowed: it holds no finished run (run the pre-training "
                              "first)")
        checkpoint = files.load_checkpoint()
    except RunDirError as err:
        raise ConfigError(f"train.init_from={run_dir} is not allowed: {err}") from None
    if checkpoint is None:
        raise ConfigError(f"train.init_from={run_dir} is not allowed: its run has no checkpoint to start from")
    return checkpoint["model"]


def at_checkpoint(run_dir: Path, data_root: str | None = None) -> tuple[DictConfig, Any, Method, nn.Module, dict]:
    """A run's recorded config (with the keys added since it ran), its data (from ``data_root`` where given), and its
    method and model as its checkpoint left them, with the checkpoint: for the scripts that read a run's state."""
    config = recorded_config(run_dir, load_summary(run_dir / SUMMARY) or {})
    if config is None or not (run_dir / CHECKPOINT).is_file():
        raise ConfigError(f"{run_dir} is not allowed: give a run directory with {CHECKPOINT} and its config")
    cfg = OmegaConf.create(with_keys_added_since(config))
    if data_root is not None:
        cfg.data.root = data_root
    set_fused(cfg.fused)  # the kernels the run trained with
    data = load_data(cfg.data)
    method = build_method(cfg.method)
    model = method.prepare(build_model(cfg.model.name, cfg.model, **data.model_inputs()))
    state = load_state(run_dir / CHECKPOINT)
    method.load_state_dict(state["method"])  # first: a method's stage may decide which quantizers the model holds
    model.load_state_dict(state["model"])
    return cfg, data, method, model, state


@dataclass
class Preflight:
    """What the checks before any data is loaded give the run."""

    device: torch.device
    method: Method
    initial: dict[str, torch.Tensor] | None  # the model state to start from: train.init_from's, or run(initial=)


def preflight(cfg: DictConfig, run_dir: str | Path, initial: dict[str, torch.Tensor] | None = None) -> Preflight:
    """Every check that needs no data: the run's and the method's values, ``train.init_from`` (unless ``initial`` is
    the state it names, read by the caller), the directory."""
    validate(cfg)
    task, needs = DATASETS[cfg.data.name], model_task(cfg.model.name)
    if task != needs:
        fits = sorted(name for name, t in DATASETS.items() if t == needs)
        raise ConfigError(f"model={cfg.model.name} is not allowed with data={cfg.data.name}: the data is for "
                          f"{task.name.replace('_', ' ')} and the model for {needs.name.replace('_', ' ')} "
                          f"(its datasets: {', '.join(fits)})")
    device = distributed.check_launch(_device(cfg.device))
    method = build_method(cfg.method)
    if initial is None and cfg.train.init_from is not None:
        initial = initial_weights(cfg.train.init_from)
    check_writable(run_dir)
    return Preflight(device, method, initial)


def run(cfg: DictConfig, run_dir: str | Path, overrides: list[str] | None = None,
        initial: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Train (or resume, or just report) the run that ``cfg`` describes in ``run_dir``; return its summary.

    ``overrides`` (the command line's) are written to ``.hydra/overrides.yaml`` beside the config. ``initial``: the
    model state to start from where no qtrain run holds it (``scripts/crossover.py``: another code's state), in place
    of ``train.init_from``'s, which then only names where it came from.
    """
    plan = preflight(cfg, run_dir, initial)
    keep_freed_memory()
    distributed.setup(plan.device)
    files = RunFiles(run_dir)
    if not distributed.is_writer():
        return _follow(cfg, files, plan)
    lock = files.lock()
    try:
        lock.acquire()
        finished, checkpoint = decide(cfg, files, plan.device)
    except (RunDirError, DivergedError) as err:  # the other ranks raise it too
        lock.release()
        distributed.broadcast(("error", type(err).__name__, str(err)))
        raise
    try:
        if finished is not None:
            distributed.broadcast(("done", finished))
            return finished
        distributed.broadcast(("train", checkpoint is not None))
        return _train(cfg, files, plan, checkpoint, overrides or [])
    finally:
        lock.release()


def _follow(cfg: DictConfig, files: RunFiles, plan: Preflight) -> dict[str, Any]:
    """A rank other than 0: do what rank 0 decided, training from the checkpoint it found."""
    decision = distributed.broadcast(None)
    if decision[0] == "error":
        raise {"RunDirError": RunDirError, "DivergedError": DivergedError}[decision[1]](decision[2])
    if decision[0] == "done":
        return decision[1]
    checkpoint = files.load_checkpoint() if decision[1] else None  # rank 0 writes none before all ranks train an epoch
    return _train(cfg, files, plan, checkpoint, [])


def _train(cfg: DictConfig, files: RunFiles, plan: Preflight, checkpoint: dict[str, Any] | None,
           overrides: list[str]) -> dict[str, Any]:
    seed_everything(cfg.seed)
    set_fused(cfg.fused)
    data = load_data(cfg.data)
    sizes = data_sizes(data)
    log.info("data %s: %s", cfg.data.name, ", ".join(f"{key} {value}" for key, value in sizes.items()))
    model = _model(cfg, plan, data.model_inputs())
    train_batches, test_batches = _streams(cfg, data, plan.device)
    sample = train_batches.example(2)
    meter = CostMeter(plan.method.profile(model, sample), plan.method.operand_sizes(model, sample))
    optimizer = build_optimizer(cfg.optim, plan.method.parameter_groups(model))
    scheduler = build_scheduler(cfg.sched, optimizer, cfg.train.epochs)
    plan.method.attach(optimizer, RunFacts(cfg.train.batch_size, cfg.train.accum_steps, train_batches.samples,
                                           -(-cfg.train.batch_size // distributed.world_size()), len(train_batches)))
    step_schedule = build_step_schedule(cfg.sched, optimizer, -(-len(train_batches) // cfg.train.accum_steps))
    saver = Checkpoint(identity(cfg), plan.device, model, optimizer, scheduler, step_schedule, plan.method, meter)
    progress, precision_log = _resume(cfg, files, saver, checkpoint)
    trainer = Trainer(
        model=distributed.wrap(model, plan.device, plan.method.skips_layers), method=plan.method, optimizer=optimizer,
        scheduler=scheduler, meter=meter, train_batches=train_batches, test_batches=test_batches, task=data.task,
        epochs=cfg.train.epochs, accum_steps=cfg.train.accum_steps, show_progress=cfg.progress and distributed.is_writer(),
        step_schedule=step_schedule, progress=progress, eval_every=cfg.train.eval_every,
    )
    if distributed.is_writer():
        _log_float32_layers(cfg, meter, plan.method)
        files.write_config(recorded(cfg), overrides)
    end_epoch = _EpochEnd(cfg, files, trainer, saver, gemm_layers(model), precision_log)
    if checkpoint is not None and distributed.is_writer():
        end_epoch.write_tables(progress)  # a run stopped between its checkpoint and its tables has them again
    return _fit(cfg, files, trainer, end_epoch, plan.device, sizes)


def _model(cfg: DictConfig, plan: Preflight, inputs: dict[str, Any]) -> nn.Module:
    """The model on the run's device, prepared by the method, with ``train.init_from``'s weights where given: a float32
    run's load before the method prepares the model, a run's of the same method (its gates and quantizers' state with
    its weights) after."""
    model = build_model(cfg.model.name, cfg.model, **inputs).to(plan.device)
    initial = plan.initial
    if initial is not None and _fits(initial, model):
        model.load_state_dict(initial)
        initial = None
    model = plan.method.prepare(model).to(plan.device)  # what prepare added (quantizer buffers, gates) joins the device
    if initial is not None:
        if not _fits(initial, model):
            sizes = ", ".join(f"{key} {value}" for key, value in inputs.items())
            raise ConfigError(f"train.init_from={cfg.train.init_from} is not allowed: its weights do not fit this model "
                              f"({cfg.model.name}, {sizes}; pre-train a float32 run of the same model on data of the "
                              f"same sizes, or a {cfg.method.name} run of it)")
        model.load_state_dict(initial)
    return model


def _fits(state: dict[str, torch.Tensor], model: nn.Module) -> bool:
    ours = model.state_dict()
    return state.keys() == ours.keys() and all(state[k].shape == ours[k].shape for k in ours)


def _streams(cfg: DictConfig, data: Any, device: torch.device) -> tuple[Stream, Stream]:
    """This rank's training and test batches, the training ones cut to ``train.batches_per_epoch`` where set."""
    world = distributed.world_size()
    train_batches, test_batches = data.streams(cfg, device, distributed.rank(), world)
    if cfg.train.batches_per_epoch is not None:
        train_batches = Periods(train_batches, cfg.train.batches_per_epoch)
    if train_batches.smallest_part() < 1:
        last = train_batches.global_size(len(train_batches) - 1)
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is not allowed on {world} processes: the "
                          f"{train_batches.samples} training samples leave a batch of {last}, fewer than one sample per "
                          f"process (choose one whose last batch holds at least {world} samples)")
    return train_batches, test_batches


def _resume(cfg: DictConfig, files: RunFiles, saver: Checkpoint,
            checkpoint: dict[str, Any] | None) -> tuple[Progress, list[dict]]:
    """Where training starts: the checkpoint's progress and precision log restored, else none and this rank's seed."""
    if checkpoint is None:
        if distributed.rank():
            seed_everything(cfg.seed + 1_000_003 * distributed.rank())  # rank 0 keeps the one-process stream
        return Progress(), []
    progress, precision_log = saver.restore(checkpoint)
    log.info("resuming %s after epoch %d", files.dir, progress.epoch)
    return progress, precision_log


def _log_float32_layers(cfg: DictConfig, meter: CostMeter, method: Method) -> None:
    kept = float32_layers_of(meter.macs, method.precision())
    if kept and len(kept) < len(meter.macs):
        log.info("float32 layers (method %s): %s: %.1f%% of float32's cost", cfg.method.name, ", ".join(kept),
                 100.0 * float32_share(meter.macs, kept))


@dataclass
class _EpochEnd:
    """What follows every epoch: the precision log extended, and on the writing rank the tables, the checkpoint and
    the epoch's log line."""

    cfg: DictConfig
    files: RunFiles
    trainer: Trainer
    saver: Checkpoint
    layers: list[str]
    precision_log: list[dict]

    def __call__(self, progress: Progress) -> None:
        method = self.trainer.method
        self.precision_log.extend(method.drain_event_rows())
        self.precision_log.extend(precision_rows(progress.epoch, progress.step, self.trainer.epoch_precision.record(),
                                                 self.layers, method.layer_columns()))
        rank_rngs = distributed.all_gather(rng_state()) if distributed.active() else None
        if not distributed.is_writer():
            return
        # the checkpoint first: a kill or a full disk between the writes leaves tables that describe no epoch the
        # checkpoint lacks, and a resumed run rewrites them from it (write_tables)
        self.saver.save(self.files, progress, self.precision_log, rank_rngs)
        self.write_tables(progress)
        _log_epoch(self.cfg, self.trainer.task, progress.history[-1])

    def write_tables(self, progress: Progress) -> None:
        """metrics.csv, precision.csv and cost.csv as the epochs up to ``progress`` left them."""
        self.files.write_table(METRICS, pd.DataFrame(progress.history))
        self.files.write_table(PRECISION, pd.DataFrame(self.precision_log))
        self.files.write_table(COST, self.trainer.meter.table())


def _log_epoch(cfg: DictConfig, task: Task, row: dict[str, Any]) -> None:
    shown = [task.score.removeprefix("test_"), *(["bpc"] if task.per_character else [])]
    train, test = (f"{split} loss {row[f'{split}_loss']:.4f}  "
                   + "  ".join(f"{name} {row[f'{split}_{name}']:.4f}" for name in shown) for split in ("train", "test"))
    if math.isnan(row["test_acc"]):
        test = f"not evaluated (every {cfg.train.eval_every} epochs)"
    log.info("epoch %d/%d  %s | %s | cost %.2f%% of float32 | %.1fs", row["epoch"], cfg.train.epochs, train, test,
             row["percent_of_float32"], row["epoch_seconds"])


def _fit(cfg: DictConfig, files: RunFiles, trainer: Trainer, end_epoch: _EpochEnd, device: torch.device,
         sizes: dict[str, Any]) -> dict[str, Any]:
    """Train to the end; the summary, written (a diverged run's too, before its error goes on up)."""
    writer = distributed.is_writer()
    try:
        trainer.fit(end_epoch)
    except Diverged as err:
        if writer:
            files.write_summary(summarize(cfg, trainer.progress, trainer.meter, trainer.method, "diverged", device, err,
                                          sizes))
        raise
    summary = summarize(cfg, trainer.progress, trainer.meter, trainer.method, "completed", device, sizes=sizes)
    if writer:
        files.write_summary(summary)
    return summary
