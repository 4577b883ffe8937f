"""The checkpoint's format: what a run saves after every epoch and restores when it resumes, in one object
(:class:`Checkpoint`), as timm's ``CheckpointSaver`` keeps its format in one place."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from qtrain import distributed
from qtrain.cost import CostMeter
from qtrain.methods import Method
from qtrain.results import RunFiles
from qtrain.train import Progress


def rng_state() -> dict[str, Any]:
    """The RNG states as tensors and plain values (a checkpoint loads with ``weights_only=True``)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Checkpoint:
    """A run's stateful parts, saved to and restored from ``checkpoint.pt``: every key of it (those
    :data:`qtrain.results.CHECKPOINT_KEYS` checks, and ``rank_rng`` under torchrun)."""

    identity: dict[str, Any]
    device: torch.device
    model: nn.Module  # the model itself, not its DistributedDataParallel wrapper
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step_schedule: torch.optim.lr_scheduler.LRScheduler | None
    method: Method
    meter: CostMeter

    def save(self, files: RunFiles, progress: Progress, precision_log: list[dict],
             rank_rngs: list[dict[str, Any]] | None) -> None:
        """Write the checkpoint of the epoch ``progress`` ends (``rank_rngs``: every rank's RNG states, under torchrun)."""
        files.save_checkpoint({
            "identity": self.identity, "device_type": self.device.type, "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "method": self.method.state_dict(),
            "step_schedule": self.step_schedule.state_dict() if self.step_schedule is not None else None,
            "meter": self.meter.state_dict(), "progress": vars(progress), "precision_log": precision_log, "rng": rng_state(),
            **({"rank_rng": rank_rngs} if rank_rngs is not None else {}),
        })

    def restore(self, state: dict[str, Any]) -> tuple[Progress, list[dict]]:
        """Load a checkpoint's ``state`` into the parts and this rank's RNGs; return its progress and precision log."""
        self.method.load_state_dict(state["method"])  # first: a method's stage may decide which quantizers the model holds
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.step_schedule is not None:
            self.step_schedule.load_state_dict(state["step_schedule"])
        self.meter.load_state_dict(state["meter"])
        progress = Progress(**state["progress"])
        set_rng_state(state["rank_rng"][distributed.rank()] if distributed.active() else state["rng"])
        return progress, state["precision_log"]
