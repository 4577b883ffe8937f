"""The learning-rate warm-up (linear per optimizer step, composed with the epoch schedules) and the inverse square root."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from qtrain.optim import build_scheduler, build_step_schedule


def _lrs(sched: dict, epochs: int, steps_per_epoch: int) -> list[float]:
    """The lr of every optimizer step over ``epochs`` epochs, stepping as the trainer does."""
    cfg = OmegaConf.create(sched)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = build_scheduler(cfg, optimizer, epochs)
    per_step = build_step_schedule(cfg, optimizer, steps_per_epoch)
    seen, step = [], 0
    for _ in range(epochs):
        for _ in range(steps_per_epoch):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            step += 1
            if per_step is not None:
                per_step.step()
        scheduler.step()
    return seen


def test_warmup_rises_linearly_over_the_first_epoch_then_multistep_decays():
    lrs = _lrs({"name": "multistep", "milestones": [2, 3], "gamma": 0.2, "warmup_epochs": 1}, 4, 4)
    # step k of the n = 4 warm-up steps runs at k/n of the lr (DYNASTY: "linear warming up in the 1st epoch")
    assert lrs[:4] == pytest.approx([0.025, 0.05, 0.075, 0.1])
    assert lrs[4:] == pytest.approx([0.1] * 4 + [0.02] * 4 + [0.004] * 4)


def test_no_warmup_leaves_the_schedule_alone():
    assert _lrs({"name": "constant", "warmup_epochs": 0}, 2, 3) == pytest.approx([0.1] * 6)


def test_warmup_over_several_epochs_scales_the_cosine_schedule():
    lrs = _lrs({"name": "cosine", "min_lr": 0.0, "warmup_epochs": 2}, 4, 2)
    # closed form: the cosine lr of the step's epoch times the warm-up factor min(1, (k + 1) / 4) of step k
    expected = [0.05 * (1 + math.cos(math.pi * (k // 2) / 4)) * min(1.0, (k + 1) / 4) for k in range(8)]
    assert lrs == pytest.approx(expected)


def test_inverse_sqrt_rises_to_the_peak_at_the_warmup_then_falls_as_one_over_root_step():
    lrs = _lrs({"name": "inverse_sqrt", "warmup_steps": 4}, 3, 4)  # peak lr 0.1 (the optimizer's) at step 4
    expected = [0.1 * min(s / 4, math.sqrt(4 / s)) for s in range(1, 13)]  # step s (from 1), Vaswani's shape
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[3] == pytest.approx(0.1) and lrs[11] == pytest.approx(0.1 * math.sqrt(4 / 12))


def test_inverse_sqrt_is_vaswanis_formula_with_the_peak_it_implies():
    d_model, warmup = 512, 4000
    peak = (d_model * warmup) ** -0.5
    cfg = OmegaConf.create({"name": "inverse_sqrt", "warmup_steps": warmup})
    optimizer = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=peak)
    per_step = build_step_schedule(cfg, optimizer, 100)
    for step in range(1, 10_001):
        lr = optimizer.param_groups[0]["lr"]
        if step in (1, 100, 4000, 10_000):
            assert lr == pytest.approx(d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5), rel=1e-9)
        optimizer.step()
        per_step.step()
