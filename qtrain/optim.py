"""Optimizers (SGD with momentum and weight decay, Adam) and learning-rate schedules (multi-step, cosine,
reduce-on-plateau, constant, inverse square root), built from the ``optim`` and ``sched`` configs, and the per-step
warm-up an epoch schedule may start with."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

# The keys of an optim or sched config that qtrain reads itself (its name, the warm-ups), not its ``_target_``.
OWN_KEYS = ("name", "warmup_epochs", "warmup_steps")


def _arguments(cfg: DictConfig) -> dict[str, Any]:
    """The config's ``_target_``, ``_partial_`` and the keyword arguments of its constructor."""
    return {key: value for key, value in OmegaConf.to_container(cfg, resolve=True).items() if key not in OWN_KEYS}


def constructor(arguments: dict[str, Any]) -> functools.partial:
    """The class ``arguments`` name (``_target_``) with their keyword values bound, as plain Python values (not
    OmegaConf's lists, which a state_dict would carry into a checkpoint that then fails to load safely)."""
    return instantiate(arguments, _convert_="all")


def build_optimizer(cfg: DictConfig, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The optimizer ``conf/optim/<name>.yaml`` names (``_target_``) with its values, over the parameter ``groups``
    (a method's :meth:`~qtrain.methods.base.Method.parameter_groups`)."""
    return constructor(_arguments(cfg))(groups)


Scheduler = torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau


def build_scheduler(cfg: DictConfig, optimizer: torch.optim.Optimizer, epochs: int) -> Scheduler:
    """An epoch-level schedule: ``conf/sched/<name>.yaml``'s ``_target_`` with its values (``plateau`` steps on the test
    loss); one without a ``_target_`` (``constant``, ``inverse_sqrt``) leaves the lr alone (see :func:`build_step_schedule`)."""
    if "_target_" not in cfg:
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    arguments = _arguments(cfg)
    if cfg.name == "cosine":  # torch's names: one half-period over the run, down to min_lr
        arguments.update(T_max=max(epochs, 1), eta_min=arguments.pop("min_lr"))
    return constructor(arguments)(optimizer)


def build_step_schedule(cfg: DictConfig, optimizer: torch.optim.Optimizer,
                        steps_per_epoch: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    """What is stepped after every optimizer step: the inverse-square-root schedule, or an epoch schedule's warm-up.

    The warm-up (``sched.warmup_epochs``; DYNASTY Sec. 5.1: one epoch on CIFAR-100, five on ImageNet): the lr rises
    linearly from 1/n of its value to it over the n optimizer steps of the warm-up epochs, and is left alone after.
    Built after the epoch schedule; both scale the current lr, so they compose.

    The inverse-square-root schedule (Vaswani et al. 2017, Sec. 5.3; FracTrain appendix D): at optimizer step s (from
    1) the rate is ``optim.lr * min(s / warmup_steps, sqrt(warmup_steps / s))``, rising linearly to ``optim.lr`` at
    ``warmup_steps`` and falling as 1/sqrt(s) after. Vaswani's ``d_model^-0.5 * min(s^-0.5, s * warmup^-1.5)`` is this
    with ``optim.lr = (d_model * warmup_steps)^-0.5``: 7.0e-4 for Transformer-base and 4000 steps.
    """
    if cfg.name == "inverse_sqrt":
        warmup = cfg.warmup_steps
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: min((done + 1) / warmup,
                                                                              math.sqrt(warmup / (done + 1))))
    steps = cfg.warmup_epochs * steps_per_epoch
    if steps <= 1:
        return None
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / steps, end_factor=1.0, total_iters=steps - 1)
