"""AdaPT: PushDown on tensors built for a known format, KL and histograms against closed forms and
torch.histc, gradient diversity, PushUp's suggestions on chosen diversities, the strategy, lookback
and resolution rules, the loss terms, and runs."""

import math

import pandas as pd
import pytest
import torch

from qtrain.errors import ConfigError
from qtrain.methods import RunFacts, StepInfo, adapt_switching, build_method
from qtrain.methods.adapt import LayerSwitchState
from qtrain.methods.adapt_recipe import tnvs_init_
from qtrain.methods.adapt_switching import (
    Format,
    adapt_lookback,
    adapt_resolution,
    adapt_strategy,
    gradient_diversity_for,
    histograms,
    increase,
    information_loss,
    kl_divergence,
    pushdown,
    pushup,
    reference_loss,
    reference_search,
)
from qtrain.methods.diversity import DiversityWindow, gradient_diversity
from qtrain.quant import formats, rounding
from qtrain.quant.rounding import draw_key
from qtrain.run import run

from .conftest import TINY, make_config, prepared


def _on_grid(wl: int, fl: int, n: int = 4000) -> torch.Tensor:
    """Values exactly representable in <wl, fl> that reach both ends of its range and use its last fractional bit."""
    torch.manual_seed(0)
    low, high = -(2 ** (wl - 1)), 2 ** (wl - 1) - 1
    codes = torch.randint(low, high + 1, (n,))
    codes[:3] = torch.tensor([low, high, 1])
    return codes.float() / 2**fl


@pytest.mark.parametrize("wl,fl", [(6, 3), (8, 4), (5, 0), (12, 10)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.slow
def test_pushdown_finds_the_format_a_tensor_was_built_in(wl, fl, rounding):
    x = _on_grid(wl, fl)
    for search in ("range", "current"):
        assert pushdown(x, Format(20, 14), resolution=150, rounding=rounding, search=search) == Format(wl, fl)
    # from a coarser start: the whole range finds it; "current" (Algorithm 3) stays put
    assert pushdown(x, Format(wl - 1, fl), resolution=150, rounding=rounding, search="range") == Format(wl, fl)
    assert pushdown(x, Format(wl - 1, fl), resolution=150, rounding=rounding, search="current") == Format(wl - 1, fl)


def test_pushdown_checks_all_candidates_in_one_batch():
    x = _on_grid(6, 3)
    candidates = [Format(12, f) for f in range(9)]
    kl = information_loss(x, candidates, 150, "nearest")
    assert kl.shape == (9,) and (kl[3:] == 0).all() and (kl[:3] > 0).all()
    rows = formats.fixed_point_candidates(x, torch.tensor([12, 5]), torch.tensor([2, 3]), "nearest")
    assert torch.equal(rows[0], formats.fixed_point(x, 12, 2)) and torch.equal(rows[1], formats.fixed_point(x, 5, 3))


def test_candidates_share_each_elements_stochastic_draw():
    x = torch.randn(5000) * 3
    wl, fl = torch.tensor([6, 10, 16, 16]), torch.tensor([3, 3, 3, 9])
    torch.manual_seed(7)
    rows = formats.fixed_point_candidates(x, wl, fl, "stochastic")
    for i in range(4):  # each row is fixed_point at its format with the same key
        torch.manual_seed(7)
        assert torch.equal(rows[i], formats.fixed_point(x, int(wl[i]), int(fl[i]), "stochastic"))
    assert torch.equal(rows[1], rows[2])  # <10,3> and <16,3>: ranges 64 and 4096 clamp nothing here
    inside = x.abs() < 3.8  # <6,3> holds -4 .. 3.875
    assert torch.equal(rows[0][inside], rows[1][inside])  # <6,3> agrees wherever it does not clamp


def test_kl_is_zero_for_identical_histograms_and_positive_otherwise():
    p = torch.tensor([[3.0, 0.0, 1.0]])
    assert kl_divergence(p, p).item() == 0.0
    # P = (1/2, 1/2), Q = (1/4, 3/4): 1/2 log2 2 + 1/2 log2 (2/3)
    assert kl_divergence(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 3.0])).item() == pytest.approx(
        0.5 + 0.5 * math.log2(2 / 3))
    assert kl_divergence(torch.tensor([1.0, 1.0]), torch.tensor([2.0, 0.0])).item() == math.inf
    assert kl_divergence(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])).item() == pytest.approx(1.0)


def test_histograms_match_torch_histc():
    torch.manual_seed(1)
    x = torch.randn(2, 5000)
    lo, hi = x.min(), x.max()
    counts = histograms(x, lo, hi, 37)
    for row in range(2):
        assert torch.equal(counts[row], torch.histc(x[row], 37, lo.item(), hi.item()))
    constant = torch.full((1, 10), 0.5)
    moved = torch.full((1, 10), 0.5 + 2**-4)  # bins of 1/50 over [0, 1]: 0.5625 leaves 0.5's bin
    same = histograms(constant, constant.min(), constant.max(), 50)
    assert same.sum() == 10 and kl_divergence(same, same).item() == 0
    assert kl_divergence(histograms(moved, constant.min(), constant.max(), 50), same).item() == math.inf


def test_gradient_diversity_matches_its_closed_form():
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    assert gradient_diversity([e1, e2]) == pytest.approx(1.0)  # orthogonal
    assert gradient_diversity([e1] * 4) == pytest.approx(0.25)  # k equal gradients: 1/k
    assert gradient_diversity([e1, -e1]) == math.inf  # they cancel
    # (1,0), (1,1): (1 + 2) / ||(2,1)||^2 = 3/5
    assert gradient_diversity([e1, e1 + e2]) == pytest.approx(0.6)
    window = DiversityWindow()
    assert math.isnan(window.diversity())
    window.add(e1)
    window.add(e1 + e2)
    assert (window.count, window.sum_sq, window.total_norm_sq()) == (2, 3.0, 5.0)


def test_adapt_diversity_is_eq_3_unsquared_and_the_reference_counts_the_window():
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    state = LayerSwitchState(Format(8, 4), 25, 50)
    for g in (e1, e2):
        state.add(g, float(g.norm()))

    def diversity(formula):
        return gradient_diversity_for(state.norm_sum, state.window.total_norm_sq(), state.window.count, formula)

    # two orthogonal unit gradients: (1 + 1) / ||(1, 1)|| = sqrt(2) in both readings (MuPPET's squared one: 1)
    assert diversity("paper") == pytest.approx(math.sqrt(2)) and diversity("reference") == pytest.approx(math.sqrt(2))
    state.add(torch.zeros(2), 0.0)  # a zero gradient: the reference's k counts it, eq. 3's sum of norms does not
    assert diversity("paper") == pytest.approx(math.sqrt(2)) and diversity("reference") == pytest.approx(3 / math.sqrt(2))
    # eq. 3 on gradients of other norms: (1 + sqrt 2) / ||(2, 1)||
    assert gradient_diversity_for(1 + math.sqrt(2), 5.0, 2, "paper") == pytest.approx((1 + math.sqrt(2)) / math.sqrt(5))
    state.add(-e1 - e2, math.sqrt(2))  # the sum is now zero
    assert diversity("paper") == math.inf == diversity("reference")
    resumed = LayerSwitchState(Format(8, 4), 25, 50)
    resumed.load_state_dict(state.state_dict())
    assert (resumed.norm_sum, resumed.window.count) == (state.norm_sum, 4)
    state.clear()
    assert (state.norm_sum, state.window.count) == (0.0, 0)


@pytest.mark.parametrize("diversity,fl_min,formula,expected", [
    # ln Δs = 1.5: s1 = ceil(1 / 0.5) = 2; s2 = min(ceil(32 * 1.5 / ln 2 - 1), 32) - 4 = 28
    (math.exp(1.5), 4, "paper", {"min": 2, "mean": 15, "max": 28}),
    # ln Δs = 3: s1 = max(ceil(1/2), 1) = 1; s2 = 32 - 20 = 12
    (math.exp(3.0), 20, "paper", {"min": 1, "mean": 7, "max": 12}),
    # ln Δs = 0.5 <= 1: 1 / (0.5 - 1) < 0, s1 = 1; s2 = ceil(32 * 0.5 / ln 2 - 1) - 4 = 23 - 4 = 19
    (math.exp(0.5), 4, "paper", {"min": 1, "mean": 10, "max": 19}),
    # the reference: L = ln Δs - 1 = 0.5: s1 = ceil(1 / 0.25) = 4; s2 = max(ceil(32 * 0.25) - 4, 0) = 4
    (math.exp(1.5), 4, "reference", {"min": 4, "mean": 4, "max": 4}),
    # L = 2: s1 = 1, s2 = 32 - 10 = 22
    (math.exp(3.0), 10, "reference", {"min": 1, "mean": 12, "max": 22}),
    # L = 0.5, FL_min = 2: s1 = 4, s2 = ceil(8) - 2 = 6
    (math.exp(1.5), 2, "reference", {"min": 4, "mean": 5, "max": 6}),
    # L = 0.01, next to the pole: s1 = ceil(1 / 1e-4) = 10000 (no cap); s2 = max(ceil(0.0032) - 4, 0) = 0
    (math.exp(1.01), 4, "reference", {"min": 0, "mean": 5000, "max": 10000}),
    # the paper's reading caps s1: ln Δs = 1.01, 1 / 0.01 = 100 -> 32; s2 = min(ceil(32 * 1.01 / ln 2 - 1), 32) - 4 = 28
    (math.exp(1.01), 4, "paper", {"min": 28, "mean": 30, "max": 32}),
])
def test_pushup_suggestions_on_chosen_diversities(diversity, fl_min, formula, expected):
    assert {st: increase(diversity, fl_min, st, formula) for st in expected} == expected


@pytest.mark.parametrize("diversity", [0.5, 1.0, 0.0, math.inf, math.nan])
def test_pushup_adds_one_bit_without_a_positive_log_diversity(diversity):
    for formula in ("paper", "reference"):
        assert increase(diversity, 4, "max", formula) == 1


def test_the_reference_pushup_jumps_to_the_top_next_to_its_pole():
    for strategy in ("mean", "max"):  # FL = min(4 + s, 32) = 32, framed: FL = 32 - 8, WL = 32
        assert pushup(Format(8, 4), increase(math.exp(1.01), 4, strategy, "reference"), 8, "reference") == Format(32, 24)
    assert pushup(Format(8, 4), increase(math.exp(1.01), 4, "min", "reference"), 8, "reference") == Format(12, 4)


def test_pushup_frames_the_format_with_buffer_bits():
    assert pushup(Format(8, 4), 2, buffer_bits=8, formula="paper") == Format(14, 6)  # FL 6, WL = FL + 8
    assert pushup(Format(20, 4), 2, buffer_bits=4, formula="paper") == Format(20, 6)  # WL_min is a floor
    assert pushup(Format(30, 26), 5, buffer_bits=8, formula="paper") == Format(32, 24)  # FL <= 32 - buff
    # the reference's intermediate WL: max(WL_min, new FL) + 1 = 21 is the floor
    assert pushup(Format(10, 4), 16, buffer_bits=4, formula="reference") == Format(24, 20)
    assert pushup(Format(24, 4), 2, buffer_bits=4, formula="reference") == Format(25, 6)


def test_strategy_follows_eq_5():
    assert adapt_strategy("min", average_loss=2.0, loss=1.0) == "min"  # the loss fell below its average
    assert adapt_strategy("max", 2.0, 1.0) == "min"
    assert adapt_strategy("min", 1.0, 1.5) == "mean"  # it did not: one step toward more precision
    assert adapt_strategy("mean", 1.0, 1.0) == "max"
    assert adapt_strategy("max", 1.0, 1.5) == "max"


def test_lookback_and_resolution_rules():
    # Δs = 2: lb_new = 100 / 2 = 50; ceil(0.33 * 50 + 0.67 * 25) = ceil(33.25) = 34
    assert adapt_lookback(25, 2.0, 25, 100, 0.33) == 34
    assert adapt_lookback(25, 4.0, 25, 100, 0.33) == 25  # lb_new = 25: no drift from rounding
    assert adapt_lookback(25, 0.5, 25, 100, 1.0) == 100  # capped at the upper bound
    assert adapt_lookback(60, 1000.0, 25, 100, 1.0) == 25  # and at the lower
    assert adapt_lookback(25, 0.0, 25, 100, 0.5) == 63  # Δs not positive: the upper bound, with momentum
    assert adapt_resolution(50, 100, 25, 100, 50, 150) == 51
    assert adapt_resolution(50, 25, 25, 100, 50, 150) == 50  # at its lower bound already
    assert adapt_resolution(150, 100, 25, 100, 50, 150) == 150
    assert adapt_resolution(80, 60, 25, 100, 50, 150) == 80


def test_tnvs_draws_the_cpu_generators_weights_on_every_device(device):
    """A run starts from the same weights on a GPU as on the CPU: the draw is the CPU generator's, then copied."""
    torch.manual_seed(3)
    reference = torch.empty(8, 4, 3, 3)
    torch.nn.init.trunc_normal_(reference, 0.0, math.sqrt(0.5 / 36), -math.sqrt(1.5 / 36), math.sqrt(1.5 / 36))
    after = torch.rand(2)
    torch.manual_seed(3)
    w = torch.empty(8, 4, 3, 3, device=device)
    tnvs_init_(w, 0.5)
    assert w.device.type == device.type and torch.equal(w.cpu(), reference)
    assert torch.equal(torch.rand(2), after)  # the CPU generator went on as after the reference draw


def test_tnvs_draws_a_truncated_fan_in_normal():
    torch.manual_seed(0)
    w = torch.empty(256, 64, 3, 3)
    tnvs_init_(w, 0.5)
    bound = math.sqrt(3 * 0.5 / 576)
    assert w.abs().max() <= bound and w.abs().max() > 0.99 * bound
    # N(0, σ²) cut at ±sqrt(3)σ has variance σ²(1 - 2 a φ(a) / (2Φ(a) - 1)) with a = sqrt(3)
    a = math.sqrt(3)
    phi, cdf = math.exp(-a * a / 2) / math.sqrt(2 * math.pi), 0.5 * (1 + math.erf(a / math.sqrt(2)))
    expected = 0.5 / 576 * (1 - 2 * a * phi / (2 * cdf - 1))
    assert w.var().item() == pytest.approx(expected, rel=0.02)


@pytest.mark.slow
def test_adapt_quantizes_weights_and_activations_and_keeps_gradients_float32():
    method, model = prepared("adapt")
    q = model.layer1[0].conv1.quant
    assert (q.weight.bits, q.weight.inner.fl, q.act.bits, q.act.fl, q.grad) == (8, 4, 8, 4, None)
    bits = method.precision()["layer1.0.conv1"].options[0][1]
    assert bits.gemm_fractions() == (64 / 1024, 256 / 1024, 256 / 1024)


@pytest.mark.slow
def test_adapt_loss_adds_l1_l2_and_the_word_length_density_penalty():
    method, model = prepared("adapt", "method.l1=0.01", "method.l2=0.1", "method.params=weights")
    model.train()
    model(torch.randn(4, 3, 8, 8))
    weights = [layer.weight for layer in method.layers.values()]
    rounded = [layer.quant.weight.last for layer in method.layers.values()]  # the copies this forward used
    for w, q in zip(weights, rounded):  # on the <8,4> grid, and not the float32 weights
        assert torch.equal(q * 16, (q * 16).round()) and not torch.equal(q, w.detach())
    densities = [float(layer.quant.weight.density) for layer in method.layers.values()]
    base = torch.tensor(1.0)
    total = method.loss(base, StepInfo(0, 0, 4))
    expected = (1.0 + 0.01 * sum(q.abs().sum().item() for q in rounded)
                + 0.05 * sum(w.square().sum().item() for w in weights) + sum(8 / 32 * d for d in densities) / len(densities))
    assert total.item() == pytest.approx(expected, rel=1e-5)
    total.backward()  # L1 acts on the rounded copy (zero where it rounded to 0), L2 on the float32 weights
    w, q = method.layers["fc"].weight, method.layers["fc"].quant.weight.last
    assert (q == 0).any() and (q != 0).any()
    assert torch.allclose(w.grad, 0.01 * q.sign() + 0.1 * w.detach())


@pytest.mark.slow
def test_adapt_covers_every_parameter_by_default():
    method, model = prepared("adapt", "method.l1=0.01")
    model.train()
    model(torch.randn(4, 3, 8, 8))
    total = method.loss(torch.tensor(0.0), StepInfo(0, 0, 4))
    # the penalty: the mean over every parameter of WL/32 * density (a weight's of its rounded copy, every
    # other parameter's of itself); all start at WL 8, and resnet20's conv1 comes first, so all have a format
    quantizers = {f"{name}.weight": layer.quant.weight for name, layer in method.layers.items()}
    params = dict(model.named_parameters())
    assert {n for n in params if n not in quantizers} >= {"bn1.weight", "fc.bias"}
    densities = [float(quantizers[n].density) if n in quantizers else p.count_nonzero().item() / p.numel()
                 for n, p in params.items()]
    l1 = sum((quantizers[n].last if n in quantizers else p).abs().sum().item() for n, p in params.items())
    assert total.item() == pytest.approx(0.01 * l1 + sum(8 / 32 * d for d in densities) / len(densities), rel=1e-5)
    total.backward()
    bn = model.bn1  # batch norm stays float32: its L1 gradient is the sign of its own values
    assert torch.equal(bn.weight.grad, 0.01 * bn.weight.detach().sign())
    assert torch.allclose(model.fc.bias.grad, 0.01 * model.fc.bias.detach().sign())


def _one_step(*overrides: str, seed: int = 0):
    """An AdaPT method after one backward and its after_backward (no switch), the same draws for the same seed."""
    torch.manual_seed(seed)
    method, model = prepared("adapt", "method.lookback={low: 100, high: 100, momentum: 0.33}", "method.l1=0",
                             "method.penalty=false", *overrides)
    model.train()
    torch.manual_seed(seed + 1)
    logits = model(torch.randn(8, 3, 8, 8))
    (1000 * method.loss(logits.logsumexp(1).mean(), StepInfo(0, 0, 8))).backward()  # large: some reach the range's ends
    float_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    method.after_backward(StepInfo(0, 0, 8))
    return method, model, float_grads


@pytest.mark.slow
def test_quantized_gradients_lie_on_the_layer_grid_and_are_normalized_after():
    method, model, float_grads = _one_step("method.normalize_grads=false")
    for name, p in model.named_parameters():  # every layer at <8,4>: multiples of 2^-4 in [-8, 8 - 2^-4]
        codes = p.grad * 16
        assert torch.equal(codes, codes.round()), name
        assert codes.min() >= -128 and codes.max() <= 127, name
        # stochastic rounding: each value to one of its two neighbours on the grid (or the clamped end)
        expected = float_grads[name].clamp(-8, 8 - 1 / 16)
        assert ((p.grad - expected).abs() < 1 / 16).all(), name
    conv = model.conv1.weight.grad
    assert (conv.abs() == 8).any() and ((conv != 0) & (conv.abs() < 8)).any()
    assert not torch.equal(model.conv1.weight.grad, float_grads["conv1.weight"])
    # the same draws with normalization: the optimizer receives the rounded gradient over its norm
    _, normalized, _ = _one_step()
    for (name, p), (_, q) in zip(model.named_parameters(), normalized.named_parameters()):
        assert torch.allclose(q.grad, p.grad / p.grad.norm()), name
        assert q.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.slow
def test_float32_gradients_and_the_weights_only_scope_leave_the_rest_alone():
    _, model, float_grads = _one_step("method.normalize_grads=false", "method.grad=float32")
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, float_grads[name]), name
    _, model, float_grads = _one_step("method.params=weights")
    assert torch.equal(model.bn1.weight.grad, float_grads["bn1.weight"])  # neither rounded nor normalized
    assert torch.equal(model.fc.bias.grad, float_grads["fc.bias"])
    w = model.fc.weight.grad
    assert w.norm().item() == pytest.approx(1.0, rel=1e-5) and not torch.allclose(w, float_grads["fc.weight"] /
                                                                                  float_grads["fc.weight"].norm())


@pytest.mark.slow
def test_adapt_normalizes_each_layer_gradient_and_switches_when_the_window_is_full():
    method, model = prepared("adapt", "method.lookback={low: 2, high: 2, momentum: 0.33}")
    model.train()
    for step in range(2):
        loss = method.loss(model(torch.randn(8, 3, 8, 8)).logsumexp(1).mean(), StepInfo(0, step, 8))
        loss.backward()
        method.after_backward(StepInfo(0, step, 8))
        for layer in method.layers.values():
            assert layer.weight.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
        model.zero_grad()
    rows = method.drain_event_rows()
    assert len(rows) == len(method.layers) and method.switches == len(method.layers)
    for row in rows:  # PushUp adds s >= 1 to PushDown's minimum, and the 8 buffer bits
        assert row["fl"] >= row["fl_min"] + 1 and row["wl"] == max(row["fl"] + 8, row["wl_min"])
        assert method.states[row["layer"]].window.count == 0
    assert method.drain_event_rows() == []


@pytest.mark.parametrize("override,message", [
    ("method.initial.fl=8", "method.initial.fl=8 is not allowed"),
    ("method.buffer_bits=0", "method.buffer_bits=0 is not allowed"),
    ("method.lookback.high=10", "method.lookback.high=10 is not allowed"),
    ("method.pushup=both", "method.pushup='both' is not allowed"),
    ("method.init=xavier", "method.init='xavier' is not allowed"),
    ("method.kl_epsilon=-1", "method.kl_epsilon=-1 is not allowed"),
    ("method.pushdown_search=below", "method.pushdown_search='below' is not allowed"),
    ("method.normalize_grads=1", "method.normalize_grads=1 is not allowed"),
    ("method.grad=int8", "method.grad='int8' is not allowed"),
    ("method.params=biases", "method.params='biases' is not allowed"),
])
@pytest.mark.slow
def test_bad_adapt_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        build_method(make_config("method=adapt", override).method)


@pytest.mark.parametrize("override,message", [
    ("method.init=xavier", "method.init='xavier' is not allowed"),
    ("method.init_scale=0", "method.init_scale=0 is not allowed"),
    ("method.l1=-1", "method.l1=-1 is not allowed"),
])
def test_bad_float32_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        build_method(make_config("method=float32", override).method)


@pytest.mark.slow
def test_float32_baseline_draws_tnvs_weights_and_adds_l1():
    torch.manual_seed(0)
    method, model = prepared("float32", "method.init=tnvs", "method.init_scale=0.5", "method.l1=0.001")
    for layer in (model.conv1, model.layer3[0].conv2, model.fc):
        bound = math.sqrt(3 * 0.5 / layer.weight[0].numel())
        assert layer.weight.abs().max() <= bound and layer.weight.abs().max() > 0.9 * bound
    plain_method, plain = prepared("float32")
    bound = 1 / math.sqrt(plain.fc.weight.shape[1])  # torch's default init, below tnvs's sqrt(1.5 / fan_in) here
    assert plain.fc.weight.abs().max() <= bound < model.fc.weight.abs().max()
    assert plain_method.loss(torch.tensor(2.0), StepInfo(0, 0, 4)).item() == 2.0  # no L1 by default
    total = method.loss(torch.tensor(0.0), StepInfo(0, 0, 4))
    assert total.item() == pytest.approx(0.001 * sum(p.abs().sum().item() for p in model.parameters()), rel=1e-5)
    total.backward()
    for p in model.parameters():  # every parameter, batch norm included
        assert torch.equal(p.grad, 0.001 * p.detach().sign())


@pytest.mark.slow
def test_adapt_without_switches_charges_the_start_format(tmp_path):
    summary = run(make_config(*TINY, "method=adapt", "method.lookback={low: 100, high: 100, momentum: 0.33}"), tmp_path)
    assert summary["adapt"]["switches"] == 0
    # forward <8,4> x <8,4>, both backward GEMMs 8 x 32: (64 + 256 + 256) / 1024 of float32
    macs = pd.read_csv(tmp_path / "cost.csv")["macs_per_sample"].sum()
    assert summary["cost"]["effective_macs"] == pytest.approx(2 * 256 * macs * 576 / 1024)


@pytest.mark.slow
def test_adapt_run_records_switches_formats_and_the_performance_model(tmp_path):
    summary = run(make_config(*TINY, "method=adapt", "method.lookback={low: 3, high: 3, momentum: 0.33}"), tmp_path)
    precision = pd.read_csv(tmp_path / "precision.csv")
    switches = precision[precision.event == "switch"]
    epochs = precision[precision.event == "epoch"]
    assert summary["adapt"]["switches"] == len(switches) > 0
    assert set(switches.step) == {3, 6}  # a full window every three optimizer steps
    last = epochs[epochs.epoch == 2].groupby("layer")[["wl", "fl"]].first()  # one row per format the epoch used
    for layer, (wl, fl) in summary["adapt"]["formats"].items():
        assert (last.loc[layer, "wl"], last.loc[layer, "fl"]) == (wl, fl)
    assert {"lookback", "resolution", "density"} <= set(epochs.columns)
    model = summary["adapt"]["performance_model"]
    assert model["steps"] == 8 and model["overhead_cost"] > 0
    assert set(model["baselines"]) == {"same", "muppet"}
    assert 0 <= model["sparsity"]["final"] < 1 and model["inference"]["SZ"] > 0


@pytest.mark.slow
def test_the_performance_model_amortizes_over_the_runs_accumulation(tmp_path):
    overrides = [*TINY, "method=adapt", "train.epochs=1", "method.lookback={low: 100, high: 100, momentum: 0.33}"]
    one = run(make_config(*overrides), tmp_path / "one")["adapt"]["performance_model"]
    four = run(make_config(*overrides, "train.accum_steps=4"), tmp_path / "four")["adapt"]["performance_model"]
    # eq. 8: ops (sp WL + 32 / accs) over the same 4 steps at <8, 4> (the densities differ a little)
    assert four["train_cost"] < one["train_cost"] * (8 + 8) / (8 + 32) * 1.2
    assert four["baselines"]["same"]["accum_steps"] == 4


@pytest.mark.slow
def test_adapt_warns_when_the_optimizer_adds_l2_again(caplog):
    method, model = prepared("adapt", "method.l2=1e-4")
    method.attach(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=5e-4), RunFacts(64, 1, 256))
    assert "pass optim.weight_decay=0 to count L2 once" in caplog.text
    caplog.clear()
    method.attach(torch.optim.SGD(model.parameters(), lr=0.1), RunFacts(64, 1, 256))
    assert caplog.text == ""


def test_reference_loss_is_torchs_kldivloss_on_frequencies():
    # bins of 1/4 over [0, 1]: the weights fill one each; rounded to nearest at FL 1 they are 0, 0, 0.5, 1
    w = torch.tensor([[0.0, 0.25, 0.5, 1.0]])
    p, q = [0.25] * 4, [0.5, 0.0, 0.25, 0.25]
    # KLDivLoss(batchmean, log_target): Σ exp(q) (q - p) / bins, the frequencies read as log-probabilities
    expected = sum(math.exp(b) * (b - a) for a, b in zip(p, q)) / 4
    assert reference_loss(w[0], Format(8, 1), 4, "nearest") == pytest.approx(expected)
    assert expected > 0
    assert reference_loss(w[0], Format(8, 2), 4, "nearest") == 0.0  # on the grid: identical histograms
    # the reference drops values beyond the weights' range from the copy's histogram: a clamped copy at <2,0>
    # (-2 .. 1) keeps them all here; the reference's histogram of the weights alone decides the bins
    assert reference_loss(torch.tensor([0.0, 0.5, 1.0, 1.5]), Format(8, 4), 3, "nearest") == 0.0


def test_reference_search_walks_as_the_reference_code():
    asked = []

    def always(fmt):
        asked.append(fmt)
        return True

    # FL from 4 to 8: asks at the lower bound 4 (mid 6), then 6 (mid 7): FL 7; WL from 7 to 12: asks 10, then 11
    assert reference_search(Format(12, 8), always) == Format(11, 7)
    assert asked == [Format(12, 4), Format(12, 6), Format(10, 7), Format(11, 7)]
    asked.clear()
    # nothing lossy: FL 4 (asked twice at the lower bound), WL 4 after asking 8, 6, 5
    assert reference_search(Format(12, 8), lambda fmt: asked.append(fmt) or False) == Format(4, 4)
    assert asked == [Format(12, 4), Format(12, 4), Format(8, 4), Format(6, 4), Format(5, 4)]
    assert reference_search(Format(8, 4), always) == Format(7, 4)  # FL 4: no FL round
    assert reference_search(Format(9, 5), always) == Format(8, 5)  # one FL round from 4 to 5 ends at 5


@pytest.mark.parametrize("current", [Format(8, 4), Format(12, 8), Format(16, 8), Format(20, 12), Format(32, 24)])
def test_reference_pushdown_never_lowers_precision_where_every_candidate_loses(current):
    torch.manual_seed(0)
    w = 1e9 * (2 * torch.rand(16, 64) - 1)  # beyond every candidate's range (WL <= 32, FL >= 4: below 2^27): all clamp
    asked = []

    def lossy(fmt):
        asked.append(reference_loss(w[0], fmt, 150))
        return asked[-1] > 0

    minimal = reference_search(current, lossy)
    assert asked and all(loss > 0 for loss in asked)
    assert pushdown(w, current, 150) == minimal  # pushdown's default: the first filter, the same walk
    # the walk ends at the last lossy bounds, a bit below the current format at most ...
    assert current.fl - 1 <= minimal.fl <= current.fl and current.wl - 1 <= minimal.wl <= current.wl
    # ... and PushUp's smallest increase brings it back: never below the current format
    for buffer_bits in (4, 8):
        new = pushup(minimal, 1, buffer_bits, "reference")
        assert new.wl >= current.wl and new.fl >= min(current.fl, 32 - buffer_bits)


@pytest.mark.parametrize("resolution", [50, 150])
def test_pushdown_stops_at_the_kl_tolerance_on_gaussian_weights(resolution):
    torch.manual_seed(3)
    w = 0.03 * torch.randn(64, 64, 3, 3)
    epsilon = 1e-3
    state = torch.get_rng_state()
    chosen = pushdown(w, Format(8, 4), resolution, epsilon, search="range")
    torch.set_rng_state(state)
    key = draw_key(w.device)  # the draws pushdown rounded with
    # the bisection ends on a boundary: the chosen FL passes, the one below it does not
    kl = information_loss(w, [Format(32, chosen.fl - 1), Format(32, chosen.fl)], resolution, key=key)
    assert kl[1] <= epsilon < kl[0]
    assert chosen.wl == chosen.fl + 1  # |w| < 1: one sign bit and the fraction


@pytest.mark.slow
def test_adapt_strategy_reads_the_mean_loss_of_the_last_average_lookback_steps():
    method, _ = prepared("adapt", "method.lookback={low: 3, high: 3, momentum: 0.33}")
    for loss in (5.0, 4.0, 3.0):  # fewer than lb_avg = 3 losses recorded before these: the strategy waits
        method._adapt_strategy(loss)
    assert method.strategy == "min" and list(method.losses) == [5.0, 4.0, 3.0]
    method._adapt_strategy(4.5)  # mean of 5, 4, 3 is 4 <= 4.5: one step toward more precision
    assert method.strategy == "mean"
    method._adapt_strategy(4.0)  # mean of 4, 3, 4.5 = 3.83 <= 4
    assert method.strategy == "max"
    method._adapt_strategy(1.0)  # the loss fell below the mean
    assert method.strategy == "min"
    resumed, _ = prepared("adapt", "method.lookback={low: 3, high: 3, momentum: 0.33}")
    resumed.load_state_dict(method.state_dict())
    assert resumed.strategy == "min" and list(resumed.losses) == [4.5, 4.0, 1.0]


def test_pushdown_rounds_only_the_candidates_its_bisection_visits(monkeypatch):
    torch.manual_seed(3)
    w = 0.03 * torch.randn(64, 64, 3, 3)
    rows = []
    real = adapt_switching.fixed_point_candidates

    def counted(x, wl, fl, *args):
        rows.append(len(wl))
        return real(x, wl, fl, *args)

    monkeypatch.setattr(adapt_switching, "fixed_point_candidates", counted)
    chosen = pushdown(w, Format(8, 4), 150, 1e-3, search="range")
    # FL over 0..31 and WL over fl+1..32: at most 5 probes each, where rounding every candidate took 32 + 32 - fl
    assert rows == [1] * len(rows) and len(rows) <= 5 + math.ceil(math.log2(32 - chosen.fl))


@pytest.mark.parametrize("numel", [64, 4096])  # without lanes and in lanes
def test_candidates_broadcast_one_fl_over_several_wl_and_take_no_format(numel):
    x = torch.randn(numel) * 4
    key = rounding.key_for(True, x.device)
    rows = formats.fixed_point_candidates(x, torch.tensor([8, 6, 4]), torch.tensor([2]), "stochastic", key=key)
    assert rows.shape == (3, numel)
    for row, wl in zip(rows, (8, 6, 4)):
        assert torch.equal(row, formats.fixed_point(x, wl, 2, "stochastic", key=key))
    none = formats.fixed_point_candidates(x, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    assert none.shape == (0, numel)
