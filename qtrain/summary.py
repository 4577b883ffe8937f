"""A run's summary.json: what it trained, on what, its figures, its cost and the hardware models' totals, and
where and with what it ran (docs/running.md lists the keys)."""

from __future__ import annotations

import math
import platform
from importlib import metadata
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from qtrain import distributed
from qtrain.config import digest, identity, recorded
from qtrain.cost import CostMeter, to_target
from qtrain.data import data_task
from qtrain.methods import Method
from qtrain.results import loss_explosion
from qtrain.train import Diverged, Progress


def versions() -> dict[str, str]:
    names = ("qtrain", "torch", "torchvision", "hydra-core", "omegaconf", "numpy", "pandas")
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return {"python": platform.python_version(), **found}


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
        "versions": versions(),
        "run_id": digest(ident),
        "identity": ident,
        "config": OmegaConf.to_container(recorded(cfg), resolve=True),
    }


def _hardware(cfg: DictConfig, progress: Progress, meter: CostMeter) -> dict[str, Any] | None:
    """Each hardware model's totals and, where ``hardware.target_acc`` is set and reached, the figures at that epoch."""
    if meter.hardware is None:
        return None
    totals = meter.hardware.totals()
    target = cfg.hardware.target_acc
    reached = None if target is None else to_target(progress.history, target, list(totals))
    return {"models": totals, "target_acc": target, "to_target": reached}
