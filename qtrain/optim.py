"""Optimizers (SGD with momentum and weight decay, Adam) and learning-rate schedules
(multi-step, cosine, reduce-on-plateau, constant), built from the ``optim`` and ``sched`` configs.
Any schedule may start with a linear warm-up over its first ``sched.warmup_epochs`` epochs, stepped
per optimizer step (DYNASTY Sec. 5.1: one epoch on CIFAR-100, five on ImageNet)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from qtrain.errors import ConfigError

OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("constant", "multistep", "cosine", "plateau")


def build_optimizer(cfg: DictConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.lr!r} is not allowed: the learning rate must be positive")
    if cfg.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay={cfg.weight_decay!r} is not allowed: it must be >= 0")
    params = model.parameters()
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    raise ConfigError(f"unknown optimizer {cfg.name!r} (choose from: {', '.join(OPTIMIZERS)})")


Scheduler = torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau


def build_scheduler(cfg: DictConfig, optimizer: torch.optim.Optimizer, epochs: int) -> Scheduler:
    """An epoch-level schedule; ``plateau`` steps on the test loss."""
    if cfg.name == "constant":
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if cfg.name == "multistep":
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(cfg.milestones), gamma=cfg.gamma)
    if cfg.name == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(epochs, 1), eta_min=cfg.min_lr)
    if cfg.name == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=cfg.factor, patience=cfg.patience,
                                                          threshold=cfg.threshold, min_lr=cfg.min_lr)
    raise ConfigError(f"unknown schedule {cfg.name!r} (choose from: {', '.join(SCHEDULES)})")


def build_warmup(cfg: DictConfig, optimizer: torch.optim.Optimizer,
                 steps_per_epoch: int) -> torch.optim.lr_scheduler.LinearLR | None:
    """The warm-up: the lr rises linearly from 1/n of its value to it over the n optimizer steps of the warm-up epochs.

    Built after the epoch schedule; both scale the current lr, so they compose.
    """
    steps = cfg.warmup_epochs * steps_per_epoch
    if steps <= 1:
        return None
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / steps, end_factor=1.0, total_iters=steps - 1)
