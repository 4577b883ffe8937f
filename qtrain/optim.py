"""Optimizers (SGD with momentum and weight decay, Adam) and learning-rate schedules
(multi-step, cosine, reduce-on-plateau, constant, inverse square root), built from the ``optim`` and
``sched`` configs. The epoch schedules may start with a linear warm-up over their first
``sched.warmup_epochs`` epochs, stepped per optimizer step (DYNASTY Sec. 5.1: one epoch on CIFAR-100,
five on ImageNet). The inverse-square-root schedule of the Transformer (Vaswani et al. 2017, Sec. 5.3;
FracTrain appendix D) is a per-step schedule of its own: at optimizer step s (from 1) the rate is
``optim.lr * min(s / warmup_steps, sqrt(warmup_steps / s))``, rising linearly to ``optim.lr`` at
``warmup_steps`` and falling as 1/sqrt(s) after. (Vaswani's ``d_model^-0.5 * min(s^-0.5, s *
warmup^-1.5)`` is this with ``optim.lr = (d_model * warmup_steps)^-0.5``: 7.0e-4 for Transformer-base
and 4000 steps.)"""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig
from torch import nn

from qtrain.errors import ConfigError

OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("constant", "multistep", "cosine", "plateau", "inverse_sqrt")


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
    """An epoch-level schedule; ``plateau`` steps on the test loss (``inverse_sqrt``: none, see :func:`build_step_schedule`)."""
    if cfg.name in ("constant", "inverse_sqrt"):
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if cfg.name == "multistep":
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(cfg.milestones), gamma=cfg.gamma)
    if cfg.name == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(epochs, 1), eta_min=cfg.min_lr)
    if cfg.name == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=cfg.factor, patience=cfg.patience,
                                                          threshold=cfg.threshold, min_lr=cfg.min_lr)
    raise ConfigError(f"unknown schedule {cfg.name!r} (choose from: {', '.join(SCHEDULES)})")


def build_step_schedule(cfg: DictConfig, optimizer: torch.optim.Optimizer,
                        steps_per_epoch: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    """What is stepped after every optimizer step: the inverse-square-root schedule, or an epoch schedule's warm-up.

    The warm-up: the lr rises linearly from 1/n of its value to it over the n optimizer steps of the
    warm-up epochs, and is left alone after. Built after the epoch schedule; both scale the current
    lr, so they compose.
    """
    if cfg.name == "inverse_sqrt":
        warmup = cfg.warmup_steps
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: min((done + 1) / warmup,
                                                                              math.sqrt(warmup / (done + 1))))
    steps = cfg.warmup_epochs * steps_per_epoch
    if steps <= 1:
        return None
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / steps, end_factor=1.0, total_iters=steps - 1)
