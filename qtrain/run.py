"""One run: config -> data, model, method, trainer -> results; resume from the run directory.

A run directory holds at most one run. Starting a run where a checkpoint exists resumes it (same
config required); where a summary exists the run is finished and is only reported again, unless
``force=true``. After every epoch the metrics, precision and cost tables and a checkpoint are
written atomically, so a crash or kill loses at most the epoch in progress.
"""

from __future__ import annotations

import logging
import platform
import random
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from qtrain.config import validate
from qtrain.cost import CostMeter, gemm_layers
from qtrain.data import BatchStream, load_data
from qtrain.errors import ConfigError
from qtrain.methods import build_method
from qtrain.models import build_model
from qtrain.optim import build_optimizer, build_scheduler
from qtrain.precision import precision_rows
from qtrain.quant.rounding import set_fused
from qtrain.results import COST, METRICS, PRECISION, RunFiles
from qtrain.train import Diverged, Progress, Trainer

log = logging.getLogger(__name__)

# Keys that may differ between the attempts of one run without changing its results.
_RUNTIME_KEYS = ("force", "progress", "device", "fused")


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


def _comparable(cfg: DictConfig) -> dict[str, Any]:
    plain = OmegaConf.to_container(cfg, resolve=True)
    for key in _RUNTIME_KEYS:
        plain.pop(key, None)
    plain["data"].pop("root", None)
    return plain


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = _first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
            if found:
                return found
        return ""
    return "" if a == b else f"{prefix[:-1]}: {a!r} in the checkpoint, {b!r} now"


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_initial_weights(model: torch.nn.Module, run_dir: str) -> None:
    """Start ``model`` from the final weights of the finished run in ``run_dir`` (``train.init_from``)."""
    files = RunFiles(run_dir)
    summary = files.read_summary()
    if summary is None or summary.get("status") != "completed":
        raise ConfigError(f"train.init_from={run_dir} is not allowed: it holds no finished run (run the pre-training first)")
    state = files.load_checkpoint()["model"]
    ours = model.state_dict()
    if state.keys() != ours.keys() or any(state[k].shape != ours[k].shape for k in ours):
        raise ConfigError(f"train.init_from={run_dir} is not allowed: its {summary['model']} weights do not fit this model "
                          "(pre-train a float32 run of the same model with the same number of classes)")
    model.load_state_dict(state)


def summarize(cfg: DictConfig, progress: Progress, meter: CostMeter, status: str, device: torch.device,
              diverged: Diverged | None = None) -> dict[str, Any]:
    last = progress.history[-1] if progress.history else {}
    f32 = meter.float32_total()
    return {
        "status": status,
        "method": cfg.method.name, "model": cfg.model.name, "data": cfg.data.name, "seed": cfg.seed,
        "epochs_completed": progress.epoch, "steps": progress.step,
        "final": {k: last.get(k) for k in ("train_loss", "train_acc", "test_loss", "test_acc")},
        "best_test_acc": max((row["test_acc"] for row in progress.history), default=None),
        "cost": {
            "effective_macs": meter.total(),
            "bit_macs": meter.total() * 1024,
            "float32_effective_macs": f32,
            "percent_of_float32": meter.percent_of_float32(),
            "savings_percent": 100.0 - meter.percent_of_float32() if f32 else 0.0,
        },
        "diverged": None if diverged is None else {"epoch": diverged.epoch + 1, "step": diverged.step, "loss": diverged.loss},
        "wall_seconds": progress.elapsed,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "versions": _versions(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def run(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Train (or resume, or just report) the run that ``cfg`` describes in ``run_dir``; return its summary."""
    validate(cfg)
    files = RunFiles(run_dir)
    if cfg.force:
        files.clear()
    finished = files.read_summary()
    if finished is not None:
        log.info("%s already holds a finished run (force=true reruns it)", files.dir)
        return finished

    seed_everything(cfg.seed)
    set_fused(cfg.fused)
    device = _device(cfg.device)
    method = build_method(cfg.method)
    data = load_data(cfg.data)
    train_split, test_split = data.train.to(device), data.test.to(device)
    channels, height, width = data.image_shape
    model = build_model(cfg.model.name, channels, data.num_classes, (height, width)).to(device)
    if cfg.train.init_from is not None:
        load_initial_weights(model, cfg.train.init_from)
    model = method.prepare(model)
    meter = CostMeter(method.profile(model, train_split.images[:2].float()))
    optimizer = build_optimizer(cfg.optim, model)
    scheduler = build_scheduler(cfg.sched, optimizer, cfg.train.epochs)
    augment = cfg.data.augment
    trainer = Trainer(
        model, method, optimizer, scheduler, meter,
        BatchStream(data, train_split, cfg.train.batch_size, cfg.seed, True, augment.crop_padding, augment.flip),
        BatchStream(data, test_split, cfg.train.eval_batch_size, cfg.seed, False),
        cfg.train.epochs, cfg.train.accum_steps, cfg.progress,
    )
    precision_log: list[dict] = []

    checkpoint = files.load_checkpoint()
    if checkpoint is not None:
        difference = _first_difference(checkpoint["config"], _comparable(cfg))
        if difference:
            raise ConfigError(f"{files.dir} holds a run with another config ({difference}); "
                              "pass force=true to start over or hydra.run.dir=DIR for a new run")
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        method.load_state_dict(checkpoint["method"])
        meter.load_state_dict(checkpoint["meter"])
        trainer.progress = Progress(**checkpoint["progress"])
        precision_log = checkpoint["precision_log"]
        _set_rng_state(checkpoint["rng"])
        log.info("resuming %s after epoch %d", files.dir, trainer.progress.epoch)

    layers = gemm_layers(model)

    def end_epoch(progress: Progress) -> None:
        precision_log.extend(precision_rows(progress.epoch, progress.step, trainer.epoch_precision.record(), layers))
        files.write_table(METRICS, pd.DataFrame(progress.history))
        files.write_table(PRECISION, pd.DataFrame(precision_log))
        files.write_table(COST, meter.table())
        files.save_checkpoint({
            "config": _comparable(cfg), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "method": method.state_dict(), "meter": meter.state_dict(),
            "progress": vars(progress), "precision_log": precision_log, "rng": _rng_state(),
        })
        row = progress.history[-1]
        log.info("epoch %d/%d  train loss %.4f  acc %.4f | test loss %.4f  acc %.4f | cost %.2f%% of float32 | %.1fs",
                 row["epoch"], cfg.train.epochs, row["train_loss"], row["train_acc"], row["test_loss"],
                 row["test_acc"], row["percent_of_float32"], row["epoch_seconds"])

    try:
        trainer.fit(end_epoch)
    except Diverged as err:
        files.write_summary(summarize(cfg, trainer.progress, meter, "diverged", device, err))
        raise
    summary = summarize(cfg, trainer.progress, meter, "completed", device)
    files.write_summary(summary)
    return summary
