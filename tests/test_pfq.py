"""PFQ: the loss indicator on synthetic loss curves, manual schedules, stage bits, cost and resume."""

import math
from types import SimpleNamespace

import pandas as pd
import pytest
from torch import nn

from qtrain.config import methods as schemas
from qtrain.errors import ConfigError
from qtrain.methods import build_method
from qtrain.methods.progressive import LossIndicator, StageSchedule
from qtrain.models import build_model
from qtrain.run import run

from .conftest import TINY, make_config

# Plateaus at 4, then 2 (from epoch 7), then 1 (from epoch 14).
STEPS = [4.0] * 7 + [2.0] * 7 + [1.0] * 7


def _turning_points(curve, indicator):
    return [epoch for epoch, loss in enumerate(curve) if indicator.update(loss)]


def test_indicator_switches_once_a_window_sits_on_a_plateau():
    indicator = LossIndicator(epsilon=0.05, alpha=0.3, window=5, scale_epochs=10)
    # Epoch 4 closes the first all-4.0 window; after each switch the window restarts, and the next one
    # that holds only one plateau ends at epoch 11 (2.0 from 7 to 11), then 18 (1.0 from 14 to 18).
    assert _turning_points(STEPS, indicator) == [4, 11, 18]
    assert indicator.epsilon == pytest.approx(0.05 * 0.3**3)


def test_indicator_does_not_switch_while_the_loss_falls():
    falling = [10 * 0.8**t for t in range(30)]  # relative change 20 % per epoch, far above epsilon
    assert _turning_points(falling[:12], LossIndicator(0.05, 0.3)) == []


def test_indicator_turning_points_are_a_window_apart_and_epsilon_decays():
    # A curve that flattens: every later turning point needs a smaller loss difference.
    curve = [1 + 9 * math.exp(-t / 6) for t in range(80)]
    indicator = LossIndicator(0.05, 0.3, window=5, scale_epochs=10)
    points, epsilons = [], []
    for epoch, loss in enumerate(curve):
        before = indicator.epsilon
        if indicator.update(loss):
            points.append(epoch)
            epsilons.append(before)
            assert indicator.last_difference <= before
    assert len(points) >= 2
    assert all(b - a >= 5 for a, b in zip(points, points[1:]))
    assert epsilons == pytest.approx([0.05 * 0.3**i for i in range(len(points))])


def test_indicator_is_invariant_to_the_loss_scale():
    wobbly = [4.0, 4.4, 3.7, 4.3, 3.8, 4.3, 3.9, 4.0, 4.01, 3.99, 4.0]
    for factor in (1.0, 100.0, 0.01):
        # L_scale = 4.04; max |L_i - L_now| is 0.6, 0.6, 0.4, 0.3, 0.5, 0.31 at epochs 4-9 (above 0.05 * 4.04)
        # and 0.1 at epoch 10 (below)
        assert _turning_points([x * factor for x in wobbly], LossIndicator(0.05, 0.3, 5, 10)) == [10]


def _schedule(stages, switch="auto", **cfg):
    base = {"epsilon": 0.05, "alpha": 0.3, "window": 5, "scale_epochs": 10, "manual_epochs": []}
    return StageSchedule(stages, SimpleNamespace(switch=schemas.Switch(switch), **{**base, **cfg}))


def test_schedule_stops_at_its_last_stage():
    schedule = _schedule(2)
    stages = []
    for epoch, loss in enumerate(STEPS):
        schedule.end_epoch(epoch, {"train_loss": loss})
        stages.append(schedule.stage)
    assert stages == [0] * 4 + [1] * 17


def test_metrics_show_the_epsilon_compared_and_the_indicator_keeps_watching_in_the_last_stage():
    schedule = _schedule(2)
    rows = []
    for epoch, loss in enumerate(STEPS):
        metrics = {"train_loss": loss}
        schedule.end_epoch(epoch, metrics)
        rows.append(metrics)
    assert [r["stage"] for r in rows[3:6]] == [0, 0, 1]  # the turning point closes epoch 4
    assert rows[4]["epsilon"] == 0.05 and rows[4]["loss_difference"] == 0  # what epoch 4 compared
    assert rows[5]["epsilon"] == pytest.approx(0.015) and math.isnan(rows[5]["loss_difference"])
    # L_scale = (7 * 4 + 3 * 2) / 10 = 3.4; the window refills from epoch 5 and goes on sliding in the last stage
    scale = 3.4
    assert rows[9]["loss_difference"] == pytest.approx(2 / scale)  # losses 4, 4, 2, 2, 2
    assert rows[13]["loss_difference"] == 0 and rows[14]["loss_difference"] == pytest.approx(1 / scale)
    assert [r["epsilon"] for r in rows[5:]] == pytest.approx([0.015] * 16)  # nothing decays in the last stage


def test_manual_schedule_switches_after_the_given_epochs():
    schedule = _schedule(3, switch="manual", manual_epochs=[2, 5])
    switched = [epoch for epoch in range(8) if schedule.end_epoch(epoch, {"train_loss": 1.0})]
    assert switched == [1, 4] and schedule.stage == 2


@pytest.mark.parametrize("overrides,message", [  # PFQ's default schedule has 4 stages
    (["method.switch=manual", "method.manual_epochs=[3]"], "method.manual_epochs=[3] is not allowed"),
    (["method.switch=manual", "method.manual_epochs=[5,3,8]"], "method.manual_epochs=[5, 3, 8] is not allowed"),
    (["method.switch=sometimes"], "method.switch='sometimes' is not allowed"),
    (["method.epsilon=0"], "method.epsilon=0 is not allowed"),
    (["method.window=1"], "method.window=1 is not allowed"),
])
def test_bad_schedules_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_method(make_config("method=pfq", *overrides).method)


@pytest.mark.parametrize("override,message", [
    ("method.fw=[3,4]", "method.fw=[3, 4] and method.bw=[6, 8, 12, 16] are not allowed"),
    ("method.bw=[6,8,0,16]", "method.bw=[6, 8, 0, 16] is not allowed: bit-widths are integers from 1 to 32"),
])
def test_bad_precision_schedules_are_named(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_method(make_config("method=pfq", override).method)


@pytest.mark.slow
def test_pfq_trains_each_stage_at_its_bits_and_charges_them(tmp_path):
    overrides = ["method=pfq", "method.fw=[4,8]", "method.bw=[8,16]", "method.switch=manual", "method.manual_epochs=[1]",
                 "method.last_layer=quantized"]
    summary = run(make_config(*TINY, *overrides), tmp_path)
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    assert metrics["stage"].tolist() == [0, 1]
    precision = pd.read_csv(tmp_path / "precision.csv")
    for epoch, (fw, bw) in ((1, (4, 8)), (2, (8, 16))):
        rows = precision[precision.epoch == epoch]
        assert set(rows.weight_bits) == set(rows.act_bits) == {fw}
        assert set(rows.grad_bits) == set(rows.grad_weight_bits) == {bw}
    # Closed form: every layer charged (fw*fw + bw*fw + fw*bw)/1024 of a MAC per sample per stage.
    macs = pd.read_csv(tmp_path / "cost.csv")["macs_per_sample"].sum()
    samples = 256  # one epoch of the synthetic training split per stage
    expected = samples * macs * ((16 + 32 + 32) + (64 + 128 + 128)) / 1024
    assert summary["cost"]["effective_macs"] == pytest.approx(expected)


def test_pfq_resumes_at_its_stage_and_bits():
    cfg = make_config("method=pfq", "method.switch=manual", "method.manual_epochs=[1,2,3]").method
    method = build_method(cfg)
    method.prepare(build_model("resnet20", in_channels=3, num_classes=10, input_size=(8, 8)))
    for epoch in range(2):
        method.end_epoch(epoch, {"train_loss": 1.0})
    resumed = build_method(cfg)
    model = resumed.prepare(build_model("resnet20", in_channels=3, num_classes=10, input_size=(8, 8)))
    resumed.load_state_dict(method.state_dict())
    q = model.layer2[1].conv2.quant
    assert (q.weight.bits, q.act.bits, q.grad.bits) == (6, 6, 12)
    assert resumed.precision()["layer3.2.conv2"].options[0][1].weight == 6


def test_pfq_follows_the_reference_code_stem_quantized_classifier_float32_global_range():
    method = build_method(make_config("method=pfq").method)
    model = method.prepare(build_model("resnet20", in_channels=3, num_classes=10, input_size=(8, 8)))
    assert type(model.fc) is nn.Linear and "fc" not in method.precision()
    assert model.conv1.quant.act.granularity == "tensor" and model.conv1.quant.act.momentum == 0.9
