"""MuPPET: dynamic fixed point against hand-computed scales and codes, the switching rule on synthetic
diversity sequences, the float32 stage, and a run's records."""

import math

import pandas as pd
import pytest
import torch

from qtrain.errors import ConfigError
from qtrain.methods import StepInfo, build_method
from qtrain.methods.diversity import DiversityWindow
from qtrain.methods.muppet import DiversityPolicy, muppet_threshold, window_diversity
from qtrain.quant import formats
from qtrain.quant.quantizers import DynamicFixedPoint, FixedPoint, fixed_codes
from qtrain.run import run
from qtrain.train import Trainer

from .conftest import TINY, make_config, prepared
from .test_run import TIMING


@pytest.mark.parametrize("values,wl,fl", [
    # min((2^7 - 0.5) / 2.9, (-2^7 - 0.5) / -1.7) = min(43.97, 75.59): floor(log2 43.97) = 5
    ([0.3, -1.7, 2.9], 8, 5),
    # positive only: 7.5 / 3 = 2.5 -> 1
    ([0.5, 3.0], 4, 1),
    # negative only: -8.5 / -3 = 2.83 -> 1
    ([-3.0, -0.25], 4, 1),
    # the largest magnitude is negative: -8.5 / -0.01 = 850 -> 9 (7.5 / 0.004 = 1875 would give 10)
    ([0.004, -0.01], 4, 9),
    # exactly at the bound: 7.5 / 7.5 = 1 -> 0
    ([7.5, 1.0], 4, 0),
])
def test_dynamic_fixed_point_scale_matches_the_hand_computed_exponent(values, wl, fl):
    assert int(formats.dynamic_fixed_point(torch.tensor(values), wl, "nearest")[1]) == fl


def test_dynamic_fixed_point_rounds_on_the_scaled_grid():
    out, fl = formats.dynamic_fixed_point(torch.tensor([0.3, -1.7, 2.9]), 8, "nearest")
    # x * 32 = 9.6, -54.4, 92.8 -> 10, -54, 93, divided by 32
    assert int(fl) == 5
    assert out.tolist() == [10 / 32, -54 / 32, 93 / 32]


def test_dynamic_fixed_point_clamps_to_the_word_length():
    # 7.5 sits at UB + 0.5 with s = 0: rounding reaches 8, one past the 4-bit range's 7
    torch.manual_seed(0)
    out, _ = formats.dynamic_fixed_point(torch.full((1000,), 7.5), 4, "stochastic")
    assert out.max() == 7 and out.min() == 7
    assert formats.dynamic_fixed_point(torch.tensor([7.5, -8.4]), 4, "nearest")[0].tolist() == [7.0, -8.0]


def test_dynamic_fixed_point_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    x = torch.full((200_000,), 0.3)
    x[0] = 2.9  # s = 5: 0.3 * 32 = 9.6, rounded up with probability 0.6
    out, fl = formats.dynamic_fixed_point(x, 8, "stochastic")
    assert int(fl) == 5
    assert set(out[1:].mul(32).unique().tolist()) == {9.0, 10.0}
    assert out[1:].mul(32).eq(10).float().mean().item() == pytest.approx(0.6, abs=0.005)


def test_dynamic_fixed_point_edges():
    zeros, fl = formats.dynamic_fixed_point(torch.zeros(5), 8)
    assert int(fl) == 0 and torch.equal(zeros, torch.zeros(5))
    empty, _ = formats.dynamic_fixed_point(torch.zeros(0), 8)
    assert empty.numel() == 0
    out, fl = formats.dynamic_fixed_point(torch.tensor([1.0, math.nan, math.inf, -2.0]), 8, "nearest")
    # the scale comes from the finite values: min(127.5 / 1, -128.5 / -2) = 64.25 -> 6
    assert int(fl) == 6 and out[0] == 1.0 and out[3] == -2.0 and math.isnan(out[1]) and out[2] == 127 / 64
    small, fl = formats.dynamic_fixed_point(torch.tensor([1e-30, -3e-31]), 8, "nearest")
    assert int(fl) == 106  # 127.5 / 1e-30 = 1.3e32 -> 2^106
    assert small[0] == 81 * 2.0**-106
    # subnormals: the quotient overflows float32; s stays at 126 (2^s normal) and they round to zero
    tiny, fl = formats.dynamic_fixed_point(torch.tensor([1e-40, -3e-41]), 8, "nearest")
    assert int(fl) == 126 and torch.equal(tiny, torch.zeros(2))


def test_threshold_is_the_papers_closed_form():
    assert muppet_threshold(0) == pytest.approx(2.5)
    assert muppet_threshold(10) == pytest.approx(1 + 1.5 / math.e)


def test_policy_switches_after_patience_violations_and_not_on_flat_diversity():
    flat = DiversityPolicy(patience=2, base=1.0, scale=1.5, decay=0.1)
    assert not any(flat.update(1.0, epoch)[2] for epoch in range(2, 60, 3))
    assert flat.violations == 0

    policy = DiversityPolicy(patience=2, base=1.0, scale=1.5, decay=0.1)
    # epoch 2: sets the maximum 6; epoch 5: 6/3 = 2 > T(5) = 1 + 1.5 e^-0.5 = 1.91: the first violation;
    # epoch 8: 6/5 = 1.2 < T(8) = 1.67: none; epoch 11: 6/2 = 3 > T(11) = 1.50: the second violation switches
    results = [policy.update(d, e) for d, e in ((6.0, 2), (3.0, 5), (5.0, 8), (2.0, 11))]
    assert [r[2] for r in results] == [False, False, False, True]
    assert results[1][0] == pytest.approx(2.0) and results[1][1] == pytest.approx(1 + 1.5 * math.exp(-0.5))
    assert policy.maximum == 0.0 and policy.violations == 0  # reset for the next stage


def test_no_diversity_counts_nothing():
    policy = DiversityPolicy(patience=1, base=1.0, scale=0.0, decay=0.1)
    policy.update(4.0, 1)
    ratio, threshold, switched = policy.update(math.nan, 3)
    assert math.isnan(ratio) and threshold == 1.0 and not switched
    assert (policy.maximum, policy.violations) == (4.0, 0)
    assert policy.update(1.0, 5)[2]  # 4 / 1 > 1: the next drop still counts
    zero, cancelling = DiversityWindow(), DiversityWindow()
    for g in (torch.zeros(3), torch.zeros(3)):
        zero.add(g)
    for g in (torch.ones(3), -torch.ones(3)):
        cancelling.add(g)
    assert math.isnan(window_diversity(zero)) and window_diversity(cancelling) == math.inf


def test_a_window_of_zero_gradients_leaves_the_maximum_and_the_violations():
    method, model = prepared("muppet", "method.resolution=2", "method.patience=1", "method.threshold.scale=0.0",
                            "method.diversity_input=weight_grads")
    method.attach(torch.optim.SGD(model.parameters(), lr=1.0), None)
    names = list(method.layers)
    ones = {n: torch.ones_like(method.layers[n].weight) for n in names}
    metrics = [{} for _ in range(4)]
    for epoch, grads in enumerate((ones, ones, ones, {**ones, names[0]: torch.zeros_like(ones[names[0]])})):
        method.last_grads = grads
        method.end_epoch(epoch, metrics[epoch])
    assert metrics[1]["diversity"] == pytest.approx(0.5) and metrics[1]["diversity_max"] == pytest.approx(0.5)
    # window 2: one layer's two gradients are 1 and 0, none all zero: (n + 0) / n = 1 there, 1/2 elsewhere
    assert metrics[3]["diversity"] > 0.5 and metrics[3]["violations"] == 0
    method.last_grads = {**ones, names[0]: torch.zeros_like(ones[names[0]])}
    for epoch in (4, 5):
        method.end_epoch(epoch, metrics := {})
    # window 3: that layer's gradients are all zero: no diversity, the check counts nothing
    assert math.isnan(metrics["diversity"]) and metrics["violations"] == 0 and metrics["switched"] == 0
    assert method.policy.maximum == pytest.approx(metrics["diversity_max"]) and method.stage == 0


def test_muppet_quantizes_weights_activations_and_gradients_at_the_word_length():
    method, model = prepared("muppet")
    q = model.layer2[0].conv1.quant
    assert (q.weight.bits, q.act.bits, q.grad.bits) == (8, 8, 8)
    assert method.precision()["fc"].options[0][1].gemm_fractions() == (64 / 1024,) * 3
    method, model = prepared("muppet", "method.grad=float32")
    assert model.fc.quant.grad is None
    assert method.precision()["fc"].options[0][1].gemm_fractions() == (64 / 1024, 256 / 1024, 256 / 1024)


@pytest.mark.slow
def test_muppet_switches_on_a_diversity_drop_and_decays_the_float32_rate():
    method, model = prepared("muppet", "method.schedule=[8,32]", "method.resolution=2", "method.patience=1",
                            "method.threshold.base=1.0", "method.threshold.scale=0.0", "method.diversity_input=weight_grads",
                            "method.float32_lr={gamma: 0.5, every: 2, decays: 2}")
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    method.attach(optimizer, None)
    names = list(method.layers)
    shapes = {n: method.layers[n].weight.shape for n in names}

    def epoch_with(grad_of, epoch):
        method.last_grads = {n: grad_of(n) for n in names}
        metrics = {}
        method.end_epoch(epoch, metrics)
        return metrics

    def unit(n, i):
        g = torch.zeros(shapes[n]).reshape(-1)
        g[i] = 1.0
        return g.reshape(shapes[n])

    # window 1 (epochs 0, 1): orthogonal gradients, diversity 1; window 2 (epochs 2, 3): equal ones, 1/2
    first = [epoch_with(lambda n: unit(n, 0), 0), epoch_with(lambda n: unit(n, 1), 1)]
    assert math.isnan(first[0]["diversity"]) and first[1]["diversity"] == pytest.approx(1.0)
    second = [epoch_with(lambda n: unit(n, 0), 2), epoch_with(lambda n: unit(n, 0), 3)]
    assert second[1]["diversity"] == pytest.approx(0.5)
    assert second[1]["diversity_ratio"] == pytest.approx(2.0) and second[1]["switched"] == 1
    assert [m["word_length"] for m in first + second] == [8, 8, 8, 8]
    assert method.word_length == 32 and method.precision() == {}
    assert model.fc.quant.weight is None and model.fc.quant.act is None
    assert optimizer.param_groups[0]["lr"] == 1.0  # the switch epoch is the first float32 epoch of two
    epoch_with(lambda n: unit(n, 0), 4)
    assert optimizer.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("override,message", [
    ("method.schedule=[12,8]", "method.schedule=[12, 8] is not allowed"),
    ("method.schedule=[8,32,16]", "method.schedule=[8, 32, 16] is not allowed"),
    ("method.resolution=0", "method.resolution=0 is not allowed"),
    # a window of one epoch keeps one gradient: its diversity is always 1, and MuPPET could never switch
    ("method.resolution=1", "method.resolution=1 is not allowed: it must be an integer >= 2"),
    ("method.diversity_input=raw", "method.diversity_input='raw' is not allowed"),
    ("method.float32_lr.decays=-1", "method.float32_lr.decays=-1 is not allowed"),
    ("method.float32_lr.decays=1.5", "method.float32_lr.decays=1.5 is not allowed"),
    ("method.grad=half", "method.grad='half' is not allowed"),
    ("method.float32_lr.gamma=2", "method.float32_lr.gamma=2 is not allowed"),
    ("method.performance_model.same.epochs=0", "method.performance_model.same.epochs=0 is not allowed"),
])
@pytest.mark.slow
def test_bad_muppet_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        build_method(make_config("method=muppet", override).method)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_muppet_run_records_its_stage_and_prices_the_run(tmp_path):
    summary = run(make_config(*TINY, "method=muppet", "method.resolution=2"), tmp_path)
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    assert metrics["word_length"].tolist() == [8, 8]
    assert math.isnan(metrics.diversity[0]) and metrics.diversity[1] > 0  # one window, closing at epoch 2
    assert metrics.diversity[1] == metrics.diversity_max[1]  # the first window sets the maximum: no violation
    assert summary["stopped_early"] is None
    assert summary["cost"]["percent_of_float32"] == pytest.approx(6.25)
    model = summary["muppet"]["performance_model"]
    assert model["steps"] == 8 and model["baselines"]["same"]["SU"] > 1
    precision = pd.read_csv(tmp_path / "precision.csv")
    assert set(precision.format) == {"dynamic-fixed"} and set(precision.weight_bits) == {8}


@pytest.mark.slow
def test_muppet_run_switches_word_length_on_a_diversity_drop(tmp_path):
    # T(e) = 0: any window less diverse than the most diverse one so far switches (patience 1)
    overrides = ["method=muppet", "train.epochs=6", "method.resolution=2", "method.patience=1",
                 "method.threshold={base: 0.0, scale: 0.0, decay: 0.1}", "method.schedule=[8,12,32]"]
    run(make_config(*TINY, *overrides), tmp_path)
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    checks = metrics.dropna(subset=["diversity"])
    assert checks.epoch.tolist() == [2, 4, 6]
    switched = metrics[metrics.switched == 1]
    assert len(switched) >= 1
    first = switched.epoch.iloc[0]
    assert (metrics.loc[metrics.epoch > first, "word_length"] == 12).all() or len(switched) > 1
    assert metrics.loc[metrics.epoch <= first, "word_length"].eq(8).all()
    assert (switched.diversity < switched.diversity_max).all()  # the drop that switched, against the maximum before it


@pytest.mark.parametrize("quantizer,dtype", [
    (lambda: DynamicFixedPoint(8), torch.int8),
    (lambda: DynamicFixedPoint(16), torch.int16),
    (lambda: FixedPoint(8, 4), torch.int8),
    (lambda: FixedPoint(12, 9, clamp_grad_zero=True), torch.int16),
])
def test_fixed_point_activations_are_saved_as_codes_and_come_back_exactly(quantizer, dtype, device):
    torch.manual_seed(0)
    q = quantizer().to(device).train()
    x = 3 * torch.randn(4, 8, 5, 5, device=device)
    state = torch.get_rng_state()
    out, saved = q.compact(x)
    assert saved[0].dtype == dtype and torch.equal(q.expand(saved, x.shape), out)
    grad = torch.ones_like(x)
    expected = grad
    if getattr(q, "clamp_grad_zero", False):  # the mask of the same draws, from the format function
        torch.set_rng_state(state)
        expected = torch.where(formats.fixed_point_with_mask(x, 12, 9, "stochastic")[1], grad, 0.0)
    assert torch.equal(q.masked_grad(grad, saved), expected)
    assert q.eval().compact(x)[1][0].is_floating_point()  # evaluation saves nothing for backward
    wide = FixedPoint(24, 8).train()
    assert wide.compact(x)[1][0].is_floating_point()  # beyond 16 bits codes would save nothing


def test_dynamic_compact_equals_quantize_then_codes(device):
    """compact's one kernel gives the tensor, scale and codes of quantizing and then encoding, draws included."""
    q = DynamicFixedPoint(8).to(device).train()
    x = 3 * torch.randn(4, 8, 5, 5, device=device)
    x[0, 0, 0, :2] = torch.tensor([math.nan, math.inf])
    torch.manual_seed(3)
    out, saved = q.compact(x)
    fl = q.fl.clone()
    torch.manual_seed(3)
    expected = q(x)
    assert torch.equal(q.fl, fl) and torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.nan_to_num(0.0), expected.nan_to_num(0.0))
    assert all(torch.equal(a, b) for a, b in zip(saved, fixed_codes(expected, fl, 8), strict=True))


@pytest.mark.parametrize("fused", [False, True])
def test_values_beyond_float32_on_the_grid_come_back_as_saved(fused):
    """At float32's largest magnitudes the scale puts the grid's top codes past float32: the largest value rounds
    to +inf, and its saved code must decode to +inf again in the eager and the compiled kernel alike."""
    from qtrain.quant import rounding

    big = torch.finfo(torch.float32).max
    rounding.set_fused(fused)
    try:
        q = DynamicFixedPoint(8, "nearest").train()
        out, saved = q.compact(torch.tensor([big, 1.0, -2.0]))
        assert q.fl.item() == -122 and out[0] == math.inf  # big * 2^-122 rounds to the code 64: 2^128
        assert torch.equal(q.expand(saved, out.shape), out)
        out, saved = q.compact(torch.tensor([-big, 1.0]))
        assert out[0] == -math.inf and torch.equal(q.expand(saved, out.shape), out)
    finally:
        rounding.set_fused(True)


def test_dynamic_fixed_point_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float32 bits; got a torch.float64"):
        formats.dynamic_fixed_point(torch.ones(3, dtype=torch.float64), 8)


class _Tiny(torch.nn.Module):
    """One Linear(2 -> 1) layer: a weight of two elements and a bias of one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _tiny_muppet(*overrides: str, weight_decay: float = 0.5):
    method = build_method(make_config("method=muppet", "method.resolution=2", *overrides).method)
    model = method.prepare(_Tiny())
    method.attach(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=weight_decay), None)
    return method, model


def _last_step(method, model, weight, weight_grad, bias, bias_grad) -> None:
    """What after_backward sees at an optimizer step: the weights before it and their gradients."""
    with torch.no_grad():
        model.fc.weight.copy_(torch.tensor([weight]))
        model.fc.bias.copy_(torch.tensor([bias]))
    model.fc.weight.grad = torch.tensor([weight_grad])
    model.fc.bias.grad = None if bias_grad is None else torch.tensor([bias_grad])
    method.after_backward(StepInfo(0, 0, 1))


def test_reference_diversity_input_rounds_every_gradient_and_adds_weight_decay():
    method, model = _tiny_muppet()
    assert set(method.windows) == {"fc.weight", "fc.bias"}
    # every gradient is on its 8-bit grid ([1, -2]: 2^-6 steps; [3]: 2^-5; [0.5, 1]: 2^-6; [-1]: 2^-7), so the
    # stochastic rounding keeps it. Inputs g + 0.5 w: epoch 0 weight [1, -2] + 0.5 [2, 0] = [2, -2], bias 3 + 0.5 * 2 = 4;
    # epoch 1 weight [0.5, 1] + 0.5 [-1, 2] = [0, 2], bias -1 + 0 = -1.
    # Weight: (8 + 4) / ||[2, 0]||^2 = 3; bias: (16 + 1) / 3^2 = 17/9; their mean 22/9.
    _last_step(method, model, [9.0, 9.0], [7.0, 7.0], 9.0, 7.0)  # an earlier step of the epoch: overwritten
    _last_step(method, model, [2.0, 0.0], [1.0, -2.0], 2.0, 3.0)
    first = {}
    method.end_epoch(0, first)
    _last_step(method, model, [-1.0, 2.0], [0.5, 1.0], 0.0, -1.0)
    second = {}
    method.end_epoch(1, second)
    assert math.isnan(first["diversity"])
    assert second["diversity"] == pytest.approx(22 / 9, rel=1e-12)

    # the option: the layer's raw weight gradients, no rounding, no weight decay: (5 + 1.25) / ||[1.5, -1]||^2
    method, model = _tiny_muppet("method.diversity_input=weight_grads")
    assert set(method.windows) == {"fc"}
    for epoch, (w, g) in enumerate((([2.0, 0.0], [1.0, -2.0]), ([-1.0, 2.0], [0.5, 1.0]))):
        _last_step(method, model, w, g, 0.0, 1.0)
        metrics = {}
        method.end_epoch(epoch, metrics)
    assert metrics["diversity"] == pytest.approx(6.25 / 3.25, rel=1e-12)


@pytest.mark.slow
def test_reference_diversity_input_is_rounded_at_the_word_length():
    # [127, 0.5] at 8 bits: scale 2^0, so 0.5 rounds to 0 or 1 (a, b), 127 stays. Diversity over [127, a] and
    # [-127, b]: (2 * 127^2 + a + b) / (a + b)^2 = inf, 32259 or 8065; unrounded it would be 32258.5.
    # No weight decay, no bias gradient (its window stays empty and out of the mean).
    seen = set()
    for seed in range(8):
        torch.manual_seed(seed)
        method, model = _tiny_muppet(weight_decay=0.0)
        for epoch, grad in enumerate(([127.0, 0.5], [-127.0, 0.5])):
            _last_step(method, model, [0.0, 0.0], grad, 0.0, None)
            metrics = {}
            method.end_epoch(epoch, metrics)
        seen.add(metrics["diversity"])
    assert seen <= {math.inf, 32259.0, 8065.0} and len(seen) >= 2
    # at 16 bits 0.5 is on the grid (scale 2^8): exactly 32258.5
    method, model = _tiny_muppet("method.schedule=[16,32]", weight_decay=0.0)
    for epoch, grad in enumerate(([127.0, 0.5], [-127.0, 0.5])):
        _last_step(method, model, [0.0, 0.0], grad, 0.0, None)
        metrics = {}
        method.end_epoch(epoch, metrics)
    assert metrics["diversity"] == 32258.5


def test_float32_stage_decays_then_stops_at_the_next_point(monkeypatch):
    # a switch to float32 at the end of epoch 2 (0-based 1); every 2 epochs, counting the switching epoch:
    # float32 epochs 2 (epoch 3) and 4 (epoch 5) decay, 6 (epoch 7) stops without a third decay
    monkeypatch.setattr(DiversityPolicy, "update", lambda self, d, epoch: (1.0, 1.0, epoch == 1))
    method, model = _tiny_muppet("method.schedule=[8,32]", "method.float32_lr={gamma: 0.5, every: 2, decays: 2}")
    lrs = []
    for epoch in range(7):
        lrs.append(method.optimizer.param_groups[0]["lr"])
        assert method.stopped() is None
        _last_step(method, model, [1.0, 0.0], [1.0, 2.0], 0.0, 1.0)
        method.end_epoch(epoch, {})
    assert lrs == [0.1, 0.1, 0.1, 0.05, 0.05, 0.025, 0.025]
    assert method.optimizer.param_groups[0]["lr"] == 0.025
    assert "after 2 decays" in method.stopped()
    restored, _ = _tiny_muppet("method.schedule=[8,32]", "method.float32_lr={gamma: 0.5, every: 2, decays: 2}")
    restored.load_state_dict(method.state_dict())
    assert restored.stopped() == method.stopped()

    # decays: null, the fixed-epoch reading: a third decay, and no stop
    method, model = _tiny_muppet("method.schedule=[8,32]", "method.float32_lr={gamma: 0.5, every: 2, decays: null}")
    for epoch in range(7):
        _last_step(method, model, [1.0, 0.0], [1.0, 2.0], 0.0, 1.0)
        method.end_epoch(epoch, {})
    assert method.optimizer.param_groups[0]["lr"] == 0.0125 and method.stopped() is None


# switch at the end of epoch 2 (DiversityPolicy.update patched); float32 lr x0.5 after epochs 2 and 3 (every 1, the
# switching epoch first); the third point, epoch 4, trains and stops the run, 16 epochs before the cap
STOPPING = [*TINY, "method=muppet", "method.schedule=[8,32]", "method.resolution=2", "train.epochs=20",
            "train.batches_per_epoch=1", "sched=constant", "optim.lr=0.1",
            "method.float32_lr={gamma: 0.5, every: 1, decays: 2}"]


@pytest.mark.slow
def test_run_stops_by_the_float32_rule_and_stays_stopped_after_a_kill(tmp_path, monkeypatch):
    monkeypatch.setattr(DiversityPolicy, "update", lambda self, d, epoch: (1.0, 1.0, epoch == 1))
    overrides = STOPPING
    whole = run(make_config(*overrides), tmp_path / "whole")
    metrics = pd.read_csv(tmp_path / "whole" / "metrics.csv")
    assert metrics.epoch.tolist() == [1, 2, 3, 4]
    assert metrics.lr.tolist() == [0.1, 0.1, 0.05, 0.025]
    assert metrics.word_length.tolist() == [8, 8, 32, 32]
    assert whole["status"] == "completed" and whole["epochs_completed"] == 4
    assert whole["stopped_early"]["by"] == "muppet" and whole["stopped_early"]["epoch"] == 4
    checkpoint = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)
    assert checkpoint["optimizer"]["param_groups"][0]["lr"] == 0.025  # no third decay

    original = Trainer.train_epoch

    def killed_in_epoch_4(self, epoch):
        if epoch == 3:
            raise KeyboardInterrupt
        return original(self, epoch)

    monkeypatch.setattr(Trainer, "train_epoch", killed_in_epoch_4)
    with pytest.raises(KeyboardInterrupt):
        run(make_config(*overrides), tmp_path / "resumed")
    monkeypatch.setattr(Trainer, "train_epoch", original)
    resumed = run(make_config(*overrides), tmp_path / "resumed")
    pd.testing.assert_frame_equal(metrics.drop(columns=TIMING),
                                  pd.read_csv(tmp_path / "resumed" / "metrics.csv").drop(columns=TIMING))
    assert resumed["stopped_early"] == whole["stopped_early"]

    # a kill after the stopping epoch's checkpoint, before the summary: the resumed run trains no further epoch
    (tmp_path / "resumed" / "summary.json").unlink()
    monkeypatch.setattr(Trainer, "train_epoch", lambda self, epoch: pytest.fail("a stopped run trained again"))
    again = run(make_config(*overrides), tmp_path / "resumed")
    assert again["status"] == "completed" and again["epochs_completed"] == 4 and again["stopped_early"]["epoch"] == 4
    # a finished run is reported, never re-run
    assert run(make_config(*overrides), tmp_path / "resumed")["epochs_completed"] == 4


@pytest.mark.slow
def test_the_epoch_the_method_stops_at_is_evaluated_whatever_eval_every(tmp_path, monkeypatch):
    monkeypatch.setattr(DiversityPolicy, "update", lambda self, d, epoch: (1.0, 1.0, epoch == 1))
    sparse = run(make_config(*STOPPING, "train.eval_every=5"), tmp_path)  # no 5th epoch comes
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    assert metrics.test_acc.isna().tolist() == [True, True, True, False] and metrics.test_loss[3] > 0
    assert sparse["final"]["test_acc"] == sparse["best_test_acc"] == metrics.test_acc[3]
    assert sparse["stopped_early"]["epoch"] == 4


def test_mini_settings_switch_every_six_epochs_on_repeated_diversity_drops():
    # scale=mini's windows (2 epochs) and threshold with the paper's patience 2: checks close at epochs 1, 3, 5, ...
    # (0-based). A stage's first check sets the maximum; its next two violate when the diversity falls below
    # max / T(e): here to a third of it (T <= 2.5 always). The fastest switches close at epochs 5, 11, 17 and 23.
    cfg = make_config("method=muppet", "scale=mini").method
    assert (cfg.resolution, cfg.patience, cfg.float32_lr.every, cfg.float32_lr.decays) == (2, 2, 2, 2)
    method = build_method(cfg)
    switches = []
    for check, epoch in enumerate(range(1, 25, 2)):
        diversity = 3.0 if check % 3 == 0 else 0.9
        if method.policy.update(diversity, epoch)[2]:
            switches.append(epoch + 1)
    assert switches == [6, 12, 18, 24]  # 1-based epochs: a stage lasts (patience + 1) * resolution = 6 epochs
    # T at the mini's k-th check is within 4% of the paper's T at its k-th check (epoch 3k + 2, decay 0.1)
    for k in range(12):
        mini, paper = muppet_threshold(2 * k + 1, decay=cfg.threshold.decay), muppet_threshold(3 * k + 2)
        assert mini == pytest.approx(paper, rel=0.04)
