"""The learning-rate warm-up (linear per optimizer step, composed with the epoch schedules) and the inverse square root."""

import dataclasses
import math

import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from qtrain.config import schema, validate
from qtrain.errors import ConfigError
from qtrain.optim import _arguments, build_optimizer, build_scheduler, build_step_schedule, constructor
from qtrain.resources import conf_dir

from .conftest import make_config


def _sched(values: dict) -> OmegaConf:
    """``conf/sched/<name>.yaml`` (its ``_target_``) with ``values``."""
    return OmegaConf.merge(OmegaConf.load(conf_dir() / "sched" / f"{values['name']}.yaml"), values)


def _lrs(sched: dict, epochs: int, steps_per_epoch: int) -> list[float]:
    """The lr of every optimizer step over ``epochs`` epochs, stepping as the trainer does."""
    cfg = _sched(sched)
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
    cfg = _sched({"name": "inverse_sqrt", "warmup_steps": warmup})
    optimizer = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=peak)
    per_step = build_step_schedule(cfg, optimizer, 100)
    for step in range(1, 10_001):
        lr = optimizer.param_groups[0]["lr"]
        if step in (1, 100, 4000, 10_000):
            assert lr == pytest.approx(d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5), rel=1e-9)
        optimizer.step()
        per_step.step()


@pytest.mark.parametrize("choice,cls,values", [
    ("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "nesterov": False}),
    ("adam", torch.optim.Adam, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}),
])
def test_the_optimizer_is_its_files_target_with_its_values(choice, cls, values):
    model = torch.nn.Linear(2, 1)
    optimizer = build_optimizer(make_config(f"optim={choice}").optim, [{"params": list(model.parameters())}])
    assert type(optimizer) is cls
    assert {key: optimizer.param_groups[0][key] for key in values} == values
    assert optimizer.param_groups[0]["params"] == list(model.parameters())


@pytest.mark.parametrize("choice,cls,values", [
    ("cosine", torch.optim.lr_scheduler.CosineAnnealingLR, {"T_max": 12, "eta_min": 0.0}),
    ("multistep", torch.optim.lr_scheduler.MultiStepLR, {"gamma": 0.1}),
    ("plateau", torch.optim.lr_scheduler.ReduceLROnPlateau, {"factor": 0.1, "patience": 10, "threshold": 1e-4}),
    ("constant", torch.optim.lr_scheduler.ConstantLR, {"factor": 1.0, "total_iters": 0}),
    ("inverse_sqrt", torch.optim.lr_scheduler.ConstantLR, {"factor": 1.0, "total_iters": 0}),
])
def test_the_schedule_is_its_files_target_with_its_values(choice, cls, values):
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = build_scheduler(make_config(f"sched={choice}").sched, optimizer, 12)
    assert type(scheduler) is cls
    assert {key: getattr(scheduler, key) for key in values} == values


@pytest.mark.parametrize("key,value", [("optim._target_", "torch.optim.Adam"), ("sched._partial_", False)])
def test_a_target_other_than_its_files_is_refused(key, value):
    cfg = make_config()
    OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError, match=rf"^{key}={value!r} is not allowed: .* is built by its file's "):
        validate(cfg)


@pytest.mark.parametrize("group,schemas", [("optim", schema.OPTIMIZERS), ("sched", schema.SCHEDULES)])
def test_every_optimizer_and_schedule_file_has_a_schema_of_its_keys(group, schemas):
    files = {path.stem: OmegaConf.load(path) for path in (conf_dir() / group).glob("*.yaml")}
    assert set(files) == set(schemas)
    for name, cfg in files.items():
        assert {item.name for item in dataclasses.fields(schemas[name])} == set(cfg) - {"name", "_target_", "_partial_"}


@pytest.mark.parametrize("group,choice", [("optim", "adam"), ("optim", "sgd"), ("sched", "multistep"), ("sched", "plateau")])
def test_a_constructor_gets_plain_python_values(group, choice):
    # OmegaConf's containers kept in a state_dict would make checkpoint.pt fail to load with weights_only=True
    bound = constructor(_arguments(make_config(f"{group}={choice}")[group]))
    assert bound.keywords and not any(isinstance(v, (DictConfig, ListConfig)) for v in bound.keywords.values())
    assert all(type(v) in (int, float, bool, list, str) for v in bound.keywords.values())
