"""One run: config -> data, model, method, trainer -> results; resume from the run directory.

:func:`run` first does every check that needs no data (:func:`preflight`), then locks the run directory and
reads what it holds: nothing (a new run, or a finished twin under another name reported), another identity
(a one-line error), a finished or diverged run (reported again), a failed sweep job (redone, from its checkpoint
if it has one) or a checkpoint alone (resumed). It writes the results and a checkpoint after every epoch, and the
summary at the end. Under ``torchrun`` rank 0 decides and writes, and the other ranks follow its decision.
docs/running.md describes the run directory, the identity and resuming; docs/design.md the run lifecycle.
"""

from __future__ import annotations

import logging
import math
import platform
import random
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from qtrain import distributed
from qtrain.checkpoint import Checkpoint, rng_state
from qtrain.config import digest, first_difference, identity, validate
from qtrain.cost import CostMeter, float32_layers_of, float32_share, gemm_layers, to_target
from qtrain.data import DATASETS, data_task, load_data
from qtrain.data.base import Periods, Stream
from qtrain.errors import ConfigError, DivergedError, QtrainError, RunDirError
from qtrain.launch import keep_freed_memory
from qtrain.methods import Method, RunFacts, build_method
from qtrain.models import build_model, model_task
from qtrain.optim import build_optimizer, build_scheduler, build_step_schedule
from qtrain.precision import precision_rows
from qtrain.quant.rounding import set_fused
from qtrain.results import COST, METRICS, PRECISION, SUMMARY, RunFiles, check_writable, loss_explosion
from qtrain.task import Task
from qtrain.train import Diverged, Progress, Trainer

log = logging.getLogger(__name__)


def _versions() -> dict[str, str]:
    names = ("qtrain", "torch", "torchvision", "hydra-core", "omegaconf", "numpy", "pandas")
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return {"python": platform.python_version(), **found}


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


@dataclass
class Preflight:
    """What the checks before any data is loaded give the run."""

    device: torch.device
    method: Method
    initial: dict[str, torch.Tensor] | None  # model weights from train.init_from


def preflight(cfg: DictConfig, run_dir: str | Path) -> Preflight:
    """Every check that needs no data: the run's and the method's values, ``train.init_from``, the directory."""
    validate(cfg)
    task, needs = DATASETS[cfg.data.name], model_task(cfg.model.name)
    if task != needs:
        fits = sorted(name for name, t in DATASETS.items() if t == needs)
        raise ConfigError(f"model={cfg.model.name} is not allowed with data={cfg.data.name}: the data is for "
                          f"{task.name.replace('_', ' ')} and the model for {needs.name.replace('_', ' ')} "
                          f"(its datasets: {', '.join(fits)})")
    device = distributed.check_launch(_device(cfg.device))
    method = build_method(cfg.method)
    initial = None if cfg.train.init_from is None else initial_weights(cfg.train.init_from)
    check_writable(run_dir)
    return Preflight(device, method, initial)


def _earlier_identity(files: RunFiles, summary: dict[str, Any] | None) -> tuple[dict | None, dict | None]:
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


def _foreign(files: RunFiles, earlier: dict | None, ident: dict[str, Any]) -> str:
    difference = "" if earlier is None else first_difference(earlier, ident)
    return difference and (f"{files.dir} holds another run ({difference}): pass force=true to replace it, "
                           "or choose another directory with hydra.run.dir=DIR")


def data_sizes(data: Any) -> dict[str, Any]:
    """What a run trained and was tested on: each split's samples (tokens of a corpus) and the model's input sizes
    (a corpus's vocabulary size)."""
    unit = "tokens" if data.task.name == "language_model" else "samples"
    inputs = {key: list(value) if isinstance(value, tuple) else value for key, value in data.model_inputs().items()}
    return {f"train_{unit}": len(data.train), f"test_{unit}": len(data.test), **inputs}


def summarize(cfg: DictConfig, progress: Progress, meter: CostMeter, method: Method, status: str, device: torch.device,
              diverged: Diverged | None = None, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    task = data_task(cfg.data)
    last = progress.history[-1] if progress.history else {}
    report = method.report(progress.epoch)
    f32 = meter.float32_total()
    ident = identity(cfg)

    def evaluated(figure: str) -> list[float]:
        """The figure of each epoch evaluated (``train.eval_every``: the others' test accuracy is NaN)."""
        return [row[figure] for row in progress.history if not math.isnan(row["test_acc"])]

    return {
        "status": status,
        "method": cfg.method.name, "model": cfg.model.name, "data": cfg.data.name, "seed": cfg.seed,
        "epochs_completed": progress.epoch, "steps": progress.step,
        "stopped_early": None if method.stopped() is None else {"by": cfg.method.name, "rule": method.stopped(),
                                                                "epoch": progress.epoch},
        "task": task.name, "data_sizes": sizes,
        "final": {f"{split}_{figure}": last.get(f"{split}_{figure}") for split in ("train", "test") for figure in task.figures},
        "best_test_acc": max(evaluated("test_acc"), default=None),
        **({f"best_{task.score}": task.best(evaluated(task.score))} if task.score != "test_acc" else {}),
        "cost": {
            "effective_macs": meter.total(),
            "bit_macs": meter.total() * 1024,
            "float32_effective_macs": f32,
            "percent_of_float32": meter.percent_of_float32(),
            "savings_percent": 100.0 - meter.percent_of_float32() if f32 else 0.0,
        },
        "float32_layers": meter.float32_layers() if progress.step else None,
        "hardware": _hardware(cfg, progress, meter),
        **({method.name: report} if report else {}),
        "diverged": None if diverged is None else {"epoch": diverged.epoch + 1, "step": diverged.step,
                                                   "loss": str(diverged.loss)},  # nan or inf: JSON has neither
        "loss_exploded": loss_explosion([row.get("train_loss") for row in progress.history]),
        "wall_seconds": progress.elapsed,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "world_size": distributed.world_size(),
        "versions": _versions(),
        "run_id": digest(ident),
        "identity": ident,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def _hardware(cfg: DictConfig, progress: Progress, meter: CostMeter) -> dict[str, Any] | None:
    """Each hardware model's totals and, where ``hardware.target_acc`` is set and reached, the figures at that epoch."""
    if meter.hardware is None:
        return None
    totals = meter.hardware.totals()
    target = cfg.hardware.target_acc
    reached = None if target is None else to_target(progress.history, target, list(totals))
    return {"models": totals, "target_acc": target, "to_target": reached}


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
            earlier, _ = _earlier_identity(files, summary)
            if _foreign(files, earlier, ident):
                return
            files.write_summary({"status": "failed", "error": error, "method": cfg.method.name, "model": cfg.model.name,
                                 "data": cfg.data.name, "seed": cfg.seed, "versions": _versions(),
                                 "run_id": digest(ident), "identity": ident,
                                 "config": OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)})
    except QtrainError:
        return


def run(cfg: DictConfig, run_dir: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Train (or resume, or just report) the run that ``cfg`` describes in ``run_dir``; return its summary.

    ``overrides`` (the command line's) are written to ``.hydra/overrides.yaml`` beside the config.
    """
    plan = preflight(cfg, run_dir)
    keep_freed_memory()
    distributed.setup(plan.device)
    files = RunFiles(run_dir)
    if not distributed.is_writer():
        return _follow(cfg, files, plan)
    lock = files.lock()
    try:
        lock.acquire()
        finished, checkpoint = _decide(cfg, files, plan)
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


def _decide(cfg: DictConfig, files: RunFiles, plan: Preflight) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """What the locked directory holds for this run: (a finished run's summary, or None; the checkpoint to resume, or None)."""
    files.remove_stale_temps()
    if cfg.force:
        files.clear()
    try:
        summary = files.read_summary()
        earlier, checkpoint = _earlier_identity(files, summary)
    except RunDirError as err:
        raise RunDirError(f"{err}: pass force=true to replace it, or choose another directory with hydra.run.dir=DIR") \
            from None
    mismatch = _foreign(files, earlier, identity(cfg))
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
    if checkpoint is not None and checkpoint["device_type"] != plan.device.type:
        raise RunDirError(f"{files.dir} holds a run trained on {checkpoint['device_type']}, and device={cfg.device} "
                          f"is {plan.device.type} here: resume it on {checkpoint['device_type']}, or pass force=true")
    return None, checkpoint


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
    optimizer = build_optimizer(cfg.optim, model)
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
        files.write_config(cfg, overrides)
    end_epoch = _EpochEnd(cfg, files, trainer, saver, gemm_layers(model), precision_log)
    if checkpoint is not None and distributed.is_writer():
        end_epoch.write_tables(progress)  # a run stopped between its checkpoint and its tables has them again
    return _fit(cfg, files, trainer, end_epoch, plan.device, sizes)


def _model(cfg: DictConfig, plan: Preflight, inputs: dict[str, Any]) -> nn.Module:
    """The model on the run's device, with ``train.init_from``'s weights where given, prepared by the method."""
    model = build_model(cfg.model.name, cfg.model, **inputs).to(plan.device)
    if plan.initial is not None:
        ours = model.state_dict()
        if plan.initial.keys() != ours.keys() or any(plan.initial[k].shape != ours[k].shape for k in ours):
            sizes = ", ".join(f"{key} {value}" for key, value in inputs.items())
            raise ConfigError(f"train.init_from={cfg.train.init_from} is not allowed: its weights do not fit this model "
                              f"({cfg.model.name}, {sizes}; pre-train a float32 run of the same model on data of the "
                              "same sizes)")
        model.load_state_dict(plan.initial)
    return plan.method.prepare(model).to(plan.device)  # what prepare added (quantizer buffers, gates) joins the model's device


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
        self.precision_log.extend(method.drain_switch_rows())
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
