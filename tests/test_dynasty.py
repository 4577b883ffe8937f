"""DYNASTY (docs/methods/dynasty.md): block layouts against loop references, eq. 1, Algorithm 1, smoothing and
rounding, skipped blocks, the precision record, and the average bit-width of a short run."""

import json
import math

import pytest
import torch

from qtrain.cost import CostMeter
from qtrain.methods import RunFacts, dynasty_map
from qtrain.quant import formats
from qtrain.quant.block_maps import ActivationMap, WeightMap, block_ranges, sensitivity
from qtrain.run import run

from .conftest import TINY, make_config, prepared


def _reference_block(values: list[float], bits: int) -> list[float]:
    """One block by hand: E = floor(log2 max|v|), step 2^(E + 2 - b), round half to even, clamp to +-(2^(b-1) - 1)."""
    if bits == 0:
        return [0.0] * len(values)
    top = max(abs(v) for v in values)
    if top == 0:
        return [0.0] * len(values)
    step = 2.0 ** (math.floor(math.log2(top)) + 2 - bits)
    qmax = 2 ** (bits - 1) - 1
    return [max(-qmax, min(qmax, round(v / step))) * step for v in values]


def _reference(x: torch.Tensor, bits_of) -> torch.Tensor:
    """Block floating point by loops: 4 x 4 blocks over dimensions 0 and 1, for each index of the rest.

    ``bits_of(i, j, position)`` is the width of the block of rows 4i.., columns 4j.. at ``position``
    (the flat index over the other dimensions).
    """
    rows, cols = x.shape[:2]
    flat = x.reshape(rows, cols, -1)
    out = torch.empty_like(flat)
    for position in range(flat.shape[2]):
        for i in range(0, rows, 4):
            for j in range(0, cols, 4):
                block = flat[i:i + 4, j:j + 4, position]
                quantized = _reference_block(block.flatten().tolist(), bits_of(i // 4, j // 4, position))
                out[i:i + 4, j:j + 4, position] = torch.tensor(quantized).reshape(block.shape)
    return out.reshape(x.shape)


def _map(x: torch.Tensor, bits_of) -> torch.Tensor:
    """The map in :func:`tile_view`'s order: blocks of dimension 0 outermost, then dimension 1, then the rest."""
    rows, cols = -(-x.shape[0] // 4), -(-x.shape[1] // 4)
    rest = math.prod(x.shape[2:])
    return torch.tensor([bits_of(i, j, p) for i in range(rows) for j in range(cols) for p in range(rest)], dtype=torch.int32)


def bits_pattern(i, j, p):
    return (0, 2, 4, 6, 8)[(3 * i + 2 * j + p) % 5]


@pytest.mark.parametrize("shape", [
    (6, 5, 3, 3),    # a conv weight: C_out x C_in blocks at every kernel position
    (9, 6, 2, 3),    # a conv activation: batch x C_in blocks at every spatial position
    (7, 10),         # a linear layer's input: batch x features
])
def test_mapped_blocks_match_a_loop_reference(shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[1]).reshape(1, -1, *[1] * (len(shape) - 2))
    weight = WeightMap("nearest", 4)
    weight.map = _map(x, bits_pattern)
    assert torch.equal(weight(x), _reference(x, bits_pattern))


def test_the_activation_is_8_bit_forward_and_mapped_for_the_weight_gradient():
    torch.manual_seed(1)
    x = torch.randn(6, 8, 2, 2)
    act = ActivationMap("nearest", 4)
    act.batch_size = 12  # the map covers a full batch of 12: three blocks of samples
    act.allocate(3 * 2 * 4, x.device)
    act.map = _map(torch.empty(12, 8, 2, 2), bits_pattern)
    forward, saved = act.compact(x)
    assert torch.equal(forward, _reference(x, lambda *_: 8))
    assert saved[0].dtype == torch.int8  # kept for backward as codes and one step per block
    assert torch.equal(act.expand(saved, x.shape), _reference(x, bits_pattern))  # a batch of 6: the map's first rows
    x[0, 0, 0, 1] = float("nan")  # in a 2-bit block; no code for NaN: the floats are kept, NaN in place
    forward, saved = act.compact(x)
    expected = _reference(x.nan_to_num(0.0), bits_pattern)
    expected[0, 0, 0, 1] = float("nan")
    assert saved[0].dtype == torch.float32
    torch.testing.assert_close(act.expand(saved, x.shape), expected, rtol=0, atol=0, equal_nan=True)


def test_with_act_map_forward_the_forward_gemm_takes_the_mapped_activation():
    torch.manual_seed(1)
    x = torch.randn(6, 8, 2, 2)
    act = ActivationMap("nearest", 4, in_forward=True)
    act.batch_size = 12
    act.allocate(3 * 2 * 4, x.device)
    act.map = _map(torch.empty(12, 8, 2, 2), bits_pattern)
    forward, saved = act.compact(x)
    assert torch.equal(forward, _reference(x, bits_pattern))  # the map's widths, not 8 bits
    assert torch.equal(act.expand(saved, x.shape), forward)  # the same tensor in the weight-gradient GEMM
    assert torch.equal(act(x), _reference(x, lambda *_: 8))  # without gradients (evaluation): 8 bits


def test_the_gradient_is_8_bit_on_batch_by_channel_blocks():
    torch.manual_seed(2)
    g = torch.randn(5, 6, 3, 3) * 1e-4
    ours = formats.block_floating_point(g, 8, "nearest", block=4, dims=(0, 1))
    assert torch.equal(ours, _reference(g, lambda *_: 8))


def test_a_zero_bit_block_is_zero_whatever_it_holds():
    x = torch.full((4, 8), 3.0)
    x[0, 0], x[1, 1] = float("nan"), float("inf")
    out, _ = formats.tile_floating_point(x, torch.tensor([0, 8], dtype=torch.int32))
    assert torch.equal(out[:, :4], torch.zeros(4, 4))
    assert torch.equal(out[:, 4:], torch.full((4, 4), 3.0))


def test_eq1_sensitivity_by_hand():
    exponent, nonzero = block_ranges(torch.tensor([3.0, 0.0]))  # max 3: E = 1, range 2^e = 4; a zero block
    assert exponent.tolist() == [2, 0] and nonzero.tolist() == [True, False]
    grad = torch.zeros(4, 8)
    grad[0, 0], grad[1, 1], grad[:, 4:] = 1.0, 2.0, 5.0
    sums = formats.tile_square_sums(grad, 4)
    assert sums.tolist() == [5.0, 16 * 25.0]
    # (2^2)^2 / 16 * (1 + 4) = 5; the zero block has no quantization noise: 0
    assert sensitivity(sums, exponent, nonzero).tolist() == [5.0, 0.0]
    # gradients far below float32's normal range square without underflow
    assert formats.tile_square_sums(grad * 1e-30, 4).tolist() == pytest.approx([5e-60, 400e-60], rel=1e-6)


@pytest.mark.parametrize("shape,dims,block", [((16, 16, 3, 3), (0, 1), 4), ((10, 64), (0, 1), 4),
                                              ((128, 16, 8, 8), (0, 1), 4), ((7, 9, 5), (0, 1), 4),
                                              ((5, 9, 2, 2), (1, 2), 4), ((16, 3, 3, 3), (0, 1), 4),
                                              ((64, 64, 3, 3), (0, 1), 2), ((64, 64, 3, 3), (0, 1), 8)])
@pytest.mark.parametrize("fused", [False, True])
def test_tile_square_sums_equal_torchs_float64_sum_bit_for_bit(shape, dims, block, fused):
    """The fixed summation order gives torch's own float64 sum over the tiles (the sums DYNASTY's runs so far
    were made with) on data whose squares span 2^160, so that any other order shows in the last bits."""
    from qtrain.quant import rounding

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-40, 40, shape, generator=gen).float())
    x.view(-1)[:3] = torch.tensor([math.nan, math.inf, 0.0])
    view = formats.tile_view(x, block, dims)[0]
    finite = torch.where(view.abs() < math.inf, view, 0.0)
    k = torch.frexp(finite.abs().amax()).exponent - 1
    squares = (finite * 2.0 ** -k.item()).square()  # exact scaling by a power of two, squares rounded in float32
    expected = squares.sum(dim=(1, 3), dtype=torch.float64).reshape(-1) * 2.0 ** (2 * k.item())
    rounding.set_fused(fused)
    try:
        assert torch.equal(formats.tile_square_sums(x, block, dims), expected)
    finally:
        rounding.set_fused(True)


def test_eq3_and_the_first_lambda():
    r = dynasty_map.relative_sensitivity(torch.tensor([16.0, 4.0, 0.0]), torch.tensor([1.0, 4.0, 1.0]))
    assert r.tolist() == [2.0, 0.0, -math.inf]  # 1/2 log2(16), 1/2 log2(1), a zero block
    assert dynasty_map.bit_widths(r, -1.0, 8).tolist() == [3.0, 1.0, 0.0]
    assert dynasty_map.bit_widths(r, -7.0, 8).tolist() == [8.0, 7.0, 0.0]  # beta caps it
    # unbounded, lambda^ = mean(r) - alpha over the finite r, weighted by computation: (2 * 1 + 0 * 4) / 5 - 3
    assert dynasty_map.first_lambda(r, torch.tensor([1.0, 4.0, 1.0]), 3.0) == pytest.approx(0.4 - 3)


@pytest.mark.parametrize("alpha", [2.0, 3.0, 4.0, 6.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_algorithm1_reaches_the_target_with_bounds_active(alpha, seed):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(4000, generator=gen, dtype=torch.float64) * 4 + 3
    r[:200] = -math.inf  # zero blocks
    computation = torch.rand(4000, generator=gen, dtype=torch.float64) * 10 + 0.1

    def error(lam):
        return abs(dynasty_map.weighted_average(dynasty_map.bit_widths(r, lam, 8.0), computation) - alpha)

    lam = dynasty_map.tune_lambda(dynasty_map.first_lambda(r, computation, alpha), r, computation, alpha, 8.0, 3)
    bits = dynasty_map.bit_widths(r, lam, 8.0)
    assert (bits[200:] == 0).any() and (bits == 8).any()  # both bounds bite
    assert error(lam) < 0.05
    for stale in (1.5, -2.0):  # a lambda bits away: the paper's L = 3 steps close in, L = 6 reach the target
        assert error(dynasty_map.tune_lambda(stale, r, computation, alpha, 8.0, 3)) < error(stale)
        assert error(dynasty_map.tune_lambda(stale, r, computation, alpha, 8.0, 6)) < 0.05


def test_algorithm1_steps_by_hand():
    r, computation = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    # bracket [min r - 1, max r - 1] = [-1, 2] with averages 2.5 and 0.25; at lambda = 0 the average is 1.5 > 1:
    # t = (1.5 - 1) / (1.5 - 0.25) = 0.4, lambda = 0.6 * 0 + 0.4 * 2 = 0.8 (lines 9-10)
    assert dynasty_map.tune_lambda(0.0, r, computation, 1.0, 8.0, iterations=1) == pytest.approx(0.8)
    # then [0, 0.8]: the average at 0.8 is 0.9 < 1: t = (0.9 - 1) / (0.9 - 1.5) = 1/6, lambda = 5/6 * 0.8 (lines 12-13)
    assert dynasty_map.tune_lambda(0.0, r, computation, 1.0, 8.0, iterations=2) == pytest.approx(2 / 3)


def test_algorithm1_from_the_last_lambda_holds_the_target_as_r_drifts():
    gen = torch.Generator().manual_seed(3)
    r = torch.randn(3000, generator=gen, dtype=torch.float64) * 3
    computation = torch.ones(3000, dtype=torch.float64)
    lam = dynasty_map.first_lambda(r, computation, 2.0)
    for _ in range(5):
        r = r * 1.3 + 0.5  # the spread grows, as Fig. 5 shows lambda^ alone drifting
        lam = dynasty_map.tune_lambda(lam, r, computation, 2.0, 8.0, iterations=3)
        assert abs(dynasty_map.weighted_average(dynasty_map.bit_widths(r, lam, 8.0), computation) - 2.0) < 0.05


def test_algorithm1_gives_the_most_bits_where_the_target_is_unreachable():
    r = torch.tensor([1.0, 2.0, -math.inf, -math.inf], dtype=torch.float64)
    lam = dynasty_map.tune_lambda(0.0, r, torch.ones(4, dtype=torch.float64), 6.0, 8.0, iterations=3)
    assert dynasty_map.bit_widths(r, lam, 8.0).tolist() == [6.0, 7.0, 0.0, 0.0]  # lambda = min(r) - alpha


def test_smoothing_and_rounding():
    last, new = torch.tensor([4.0, 4.0, 8.0, 0.0]), torch.tensor([2.0, 8.0, 0.0, 3.0])
    assert dynasty_map.smooth(last, new, 0.5).tolist() == [3.0, 6.0, 4.0, 1.5]
    assert dynasty_map.smooth(last, new, 0.0).tolist() == new.tolist()
    levels = (0, 2, 4, 6, 8)
    widths = torch.tensor([0.0, 0.9, 1.0, 1.1, 2.9, 3.0, 3.1, 5.0, 7.0, 7.9, 8.0], dtype=torch.float64)
    # ties round half to even on bits / 2: 1 -> 0, 3 -> 4, 5 -> 4, 7 -> 8
    assert dynasty_map.round_to_levels(widths, levels).tolist() == [0, 0, 0, 2, 2, 4, 4, 4, 8, 8, 8]
    assert dynasty_map.round_to_levels(torch.tensor([2.4, 5.0]), (1, 3, 5)).tolist() == [3, 5]


def _step(method, model, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return method.precision()


@pytest.mark.slow
def test_zero_bit_blocks_contribute_and_cost_nothing():
    torch.manual_seed(0)
    method, model = prepared("dynasty")
    method.profile(model, torch.zeros(2, 3, 8, 8))
    method.attach(None, RunFacts(8, 1, 8))
    conv = model.layer1[0].conv1
    conv.quant.weight.map = torch.zeros_like(conv.quant.weight.map)
    x = torch.randn(8, 16, 8, 8)
    assert torch.equal(conv(x), torch.zeros(8, 16, 8, 8))
    record = _step(method, model, torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))
    layer = record["layer1.0.conv1"]
    forward, error, weight_gradient = layer.gemm_fractions
    assert forward == 0 and error == 0 and weight_gradient == pytest.approx(4 * 8 / 1024)  # activations still at 4
    meter = CostMeter({"layer1.0.conv1": 1000})
    meter.add({"layer1.0.conv1": layer}, samples=8)
    assert meter.total() == pytest.approx(8 * 1000 * 4 * 8 / 1024)


@pytest.mark.slow
def test_the_record_charges_the_map_shares_and_the_first_epoch_at_4_bits():
    torch.manual_seed(0)
    method, model = prepared("dynasty")
    method.profile(model, torch.zeros(2, 3, 8, 8))
    method.attach(None, RunFacts(8, 1, 8))
    record = _step(method, model, torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))
    assert set(record) == set(method.layers)
    for layer in record.values():  # 4-bit mapped operand against the static 8-bit one in every GEMM
        assert layer.gemm_fractions == pytest.approx((32 / 1024,) * 3)
    conv = model.layer1[0].conv1.quant
    conv.weight.map[: len(conv.weight.map) // 2] = 8  # half the weight blocks at 8 bits
    method._records.clear()
    record = _step(method, model, torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))
    assert record["layer1.0.conv1"].gemm_fractions[0] == pytest.approx((0.5 * 8 + 0.5 * 4) * 8 / 1024)


@pytest.mark.slow
def test_every_layers_weight_sensitivity_is_eq_1_of_its_blocks_by_hand():
    torch.manual_seed(0)
    method, model = prepared("dynasty")
    method.profile(model, torch.zeros(2, 3, 8, 8))
    method.attach(None, RunFacts(8, 1, 8))
    _step(method, model, torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))
    for name, quant in method.layers.items():  # the first layer's activation too, whose input needs no gradient
        assert quant.act.sensitivity.sum() > 0
        weight = model.get_submodule(name).weight
        expected = _weight_sensitivity_by_hand(weight.detach(), weight.grad)
        # the kernel sums the squares in float32
        assert quant.weight.sensitivity.tolist() == pytest.approx(expected.tolist(), rel=1e-6), name


def _weight_sensitivity_by_hand(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """DYNASTY eq. 1 of each 4 x 4 block of (output, input) channels at each kernel position, zero-padded, in a width
    map's order (output blocks outermost, then input blocks, then kernel positions; docs/formats.md): (2^e)^2 / 16
    times the block's sum of squared gradients, 2^e the power of two just above its largest magnitude."""
    def blocks(t):
        t = t.double().reshape(*t.shape[:2], -1).permute(2, 0, 1)  # (positions, out, in)
        t = torch.nn.functional.pad(t, (0, -t.shape[2] % 4, 0, -t.shape[1] % 4))
        positions, rows, cols = t.shape
        return t.reshape(positions, rows // 4, 4, cols // 4, 4).permute(1, 3, 0, 2, 4).reshape(-1, 16)
    largest = blocks(weight).abs().amax(1)
    _, exponent = torch.frexp(largest)  # largest = m 2^exponent with m in [0.5, 1): 2^exponent is just above it
    return torch.where(largest > 0, 4.0 ** exponent.double() / 16 * blocks(grad).square().sum(1), 0.0)


@pytest.mark.slow
def test_computation_counts_each_blocks_macs_strides_included():
    method, model = prepared("dynasty")
    method.profile(model, torch.zeros(2, 3, 8, 8))
    method.attach(None, RunFacts(8, 1, 8))
    _step(method, model, torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))
    # layer2.0's shortcut: a 1x1 stride-2 convolution from 16 channels at 8x8 to 32 at 4x4, batch 8
    act = method.computation("layer2.0.shortcut.0", "act").reshape(2, 4, 8, 8)  # sample blocks, channel blocks, h, w
    assert torch.all(act[:, :, ::2, ::2] == 16 * 32)  # 16 elements, each read by 32 output channels
    assert torch.all(act[:, :, 1::2, :] == 0) and torch.all(act[:, :, :, 1::2] == 0)  # never read: no MAC
    # every weight element meets 8 samples x 16 output positions, in the forward and the error GEMM
    assert torch.all(method.computation("layer2.0.shortcut.0", "weight") == 16 * 2 * 8 * 16)


@pytest.mark.slow
def test_act_map_forward_charges_the_forward_gemm_and_counts_both_gemms():
    torch.manual_seed(0)
    method, model = prepared("dynasty", "method.act_map=forward")
    method.profile(model, torch.zeros(2, 3, 8, 8))
    method.attach(None, RunFacts(8, 1, 8))
    record = _step(method, model, torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))
    for layer in record.values():  # first epoch: 4-bit weight x 4-bit activation forward; 4 x 8 in the other two
        assert layer.gemm_fractions == pytest.approx((16 / 1024, 32 / 1024, 32 / 1024))
    act = method.computation("layer2.0.shortcut.0", "act").reshape(2, 4, 8, 8)
    assert torch.all(act[:, :, ::2, ::2] == 2 * 16 * 32)  # the forward GEMM's MACs beside the weight gradient's
    assert torch.all(method.computation("layer2.0.shortcut.0", "weight") == 16 * 2 * 8 * 16)  # unchanged


def _dynasty_linear(features, sample_shape, batch, *overrides):
    """DYNASTY on one bias-free Linear(features, features) for samples of ``sample_shape`` in batches of ``batch``."""
    from qtrain.methods import build_method

    method = build_method(make_config("method=dynasty", *overrides).method)
    model = method.prepare(torch.nn.Sequential(torch.nn.Linear(features, features, bias=False)))
    method.profile(model, torch.zeros(2, *sample_shape))
    method.attach(None, RunFacts(batch, 1, batch))
    return method, model


def _one_linear(target=4, *overrides):
    method, model = _dynasty_linear(4, (4,), 4, f"method.target_bits={target}", *overrides)
    model(torch.randn(4, 4)).sum().backward()
    return method, model[0].quant


def _set_sensitivities(quant, r_weight, r_act):
    # one 4x4 block each; T = 2 GEMMs x 4 samples x 16 elements = 128 (weight), 4 outputs x 16 = 64 (activation)
    quant.weight.sensitivity = torch.tensor([128 * 4.0 ** r_weight], dtype=torch.float64)
    quant.act.sensitivity = torch.tensor([64 * 4.0 ** r_act], dtype=torch.float64)


def test_the_epoch_end_by_hand():
    method, quant = _one_linear()
    _set_sensitivities(quant, 5, 1)  # r = 1/2 log2(S / T) = 5 and 1
    metrics = {}
    method.end_epoch(0, metrics)
    # lambda^ = (128 * 5 + 64 * 1) / 192 - 4 = -1/3: widths 5 1/3 and 1 1/3 average 4, no bound active, so
    # Algorithm 1 keeps it; the first computed map is not smoothed; rounded to 6 and 2
    assert method.lam == pytest.approx(-1 / 3)
    assert (quant.weight.map.tolist(), quant.act.map.tolist()) == ([6], [2])
    assert metrics["dynasty_average_bits"] == 4.0 and metrics["dynasty_next_average_bits"] == pytest.approx(14 / 3)
    assert quant.weight.sensitivity.tolist() == [0.0] and quant.act.sensitivity.tolist() == [0.0]
    _set_sensitivities(quant, 1, 5)
    method.end_epoch(1, {})
    # from lambda = -1/3 (average 2 2/3 < 4) toward lambda0 = 1 - 4 (average 5 1/3): t = 1/2, lambda = -5/3, new
    # widths 2 2/3 and 6 2/3; smoothed with the last ones (5 1/3, 1 1/3) at gamma 0.5: 4 and 4
    assert method.lam == pytest.approx(-5 / 3)
    assert (quant.weight.map.tolist(), quant.act.map.tolist()) == ([4], [4])


def test_average_blocks_holds_algorithm_1s_plain_mean():
    method, quant = _one_linear(4, "method.average=blocks")
    _set_sensitivities(quant, 5, 1)  # r = 5 and 1, T = 128 and 64
    metrics = {}
    method.end_epoch(0, metrics)
    # lambda^ = (5 + 1) / 2 - 4 = -1: widths 6 and 2, whose plain mean is 4 (no bound active, Algorithm 1 keeps it);
    # the computation-weighted average the run reports is (128 * 6 + 64 * 2) / 192 = 4 2/3 (macs: lambda = -1/3)
    assert method.lam == pytest.approx(-1.0)
    assert (quant.weight.map.tolist(), quant.act.map.tolist()) == ([6], [2])
    assert metrics["dynasty_next_average_bits"] == pytest.approx(14 / 3)


def test_average_blocks_counts_the_blocks_that_take_part_in_a_mac():
    computation = torch.tensor([0.0, 5.0, 2.0], dtype=torch.float64)
    assert torch.equal(dynasty_map.average_weights(computation, "macs"), computation)
    assert dynasty_map.average_weights(computation, "blocks").tolist() == [0.0, 1.0, 1.0]
    # r = (-inf, 3, 1) at alpha 2: the plain mean over the two blocks that compute, lambda^ = 2 - 2 = 0, widths 3 and 1
    r = dynasty_map.relative_sensitivity(torch.tensor([0.0, 5.0 * 64, 2.0 * 4]), computation)
    weights = dynasty_map.average_weights(computation, "blocks")
    lam = dynasty_map.first_lambda(r, weights, 2.0)
    assert lam == pytest.approx(0.0)
    assert dynasty_map.bit_widths(r, lam, 8.0).tolist() == [0.0, 3.0, 1.0]
    assert dynasty_map.tune_lambda(lam, r, weights, 2.0, 8.0, 3) == pytest.approx(0.0)


def test_act_map_forward_epoch_end_by_hand():
    method, quant = _one_linear(4, "method.act_map=forward")
    # the activation block now takes part in two GEMMs: T = 2 x 64 = 128, as the weight's
    assert method.computation("0", "act").tolist() == [128.0]
    quant.weight.sensitivity = torch.tensor([128 * 4.0 ** 5], dtype=torch.float64)
    quant.act.sensitivity = torch.tensor([128 * 4.0 ** 1], dtype=torch.float64)
    method.end_epoch(0, {})
    assert method.lam == pytest.approx(-1.0)  # (128 * 5 + 128 * 1) / 256 - 4
    assert (quant.weight.map.tolist(), quant.act.map.tolist()) == ([6], [2])


@pytest.mark.parametrize("override,message", [
    ("method.average=tokens", "method.average='tokens' is not allowed"),
    ("method.act_map=error", "method.act_map='error' is not allowed"),
])
def test_bad_dynasty_readings_are_named(override, message):
    from qtrain.errors import ConfigError
    from qtrain.methods import build_method

    with pytest.raises(ConfigError, match=message):
        build_method(make_config("method=dynasty", override).method)


def test_the_maps_and_lambda_survive_a_resume():
    method, quant = _one_linear()
    _set_sensitivities(quant, 5, 1)
    method.end_epoch(0, {})
    resumed, resumed_quant = _one_linear()
    resumed.load_state_dict(method.state_dict())
    assert resumed.lam == method.lam and resumed.history == method.history
    assert torch.equal(resumed_quant.weight.map, quant.weight.map) and torch.equal(resumed_quant.act.map, quant.act.map)
    for m, q in ((method, quant), (resumed, resumed_quant)):
        _set_sensitivities(q, 1, 5)
        m.end_epoch(1, {})
    assert resumed.lam == method.lam and torch.equal(resumed_quant.act.map, quant.act.map)


@pytest.mark.parametrize("target", [2, 4])
@pytest.mark.slow
def test_a_short_run_holds_its_average_at_the_target(tmp_path, target):
    summary = run(make_config(*TINY, "method=dynasty", f"method.target_bits={target}", "train.epochs=4"), tmp_path)
    report = summary["dynasty"]
    assert report["target_bits"] == target
    assert report["average_bits_per_epoch"][0] == 4.0  # every block at 4 bits in the first epoch
    for average in report["average_bits_per_epoch"][1:]:  # rounding to {0, 2, 4, 6, 8} moves it a little
        assert abs(average - target) < 0.15
    precision = __import__("pandas").read_csv(tmp_path / "precision.csv")
    maps = precision[precision.event == "bitmap"]
    assert set(maps.operand) == {"weight", "act"}
    columns = [f"share_{b}bit" for b in (0, 2, 4, 6, 8)]
    assert maps[columns].sum(axis=1).to_numpy() == pytest.approx(1.0)
    assert (maps.loc[maps.epoch == 2, columns].max(axis=1) < 1).any()  # the first computed map mixes widths
    assert json.loads((tmp_path / "summary.json").read_text())["hardware"]["models"]["bit_serial"]["speedup_vs_8bit"] > 1


# a Linear on (batch 8, tokens 3, C_in 8): blocks of 4 samples x 4 channels at each token, in the map's order
# (sample block i, channel block j, token t) -> (2 i + j) * 3 + t, 12 entries


def test_a_linear_on_tokens_maps_batch_by_channel_blocks_at_each_token():
    torch.manual_seed(0)
    method, model = _dynasty_linear(8, (3, 8), 8)
    x = torch.randint(1, 8, (8, 3, 8)).float()  # integers below 8: exact at 8 bits
    x[4:8, 1, 0:4] = 0  # samples 4-7, channels 0-3, token 1: entry (2 * 1 + 0) * 3 + 1 = 7
    (model(x) * torch.randn(8, 3, 8)).sum().backward()
    act = model[0].quant.act
    assert act.map.tolist() == [4] * 12
    zero = torch.arange(12) == 7
    assert torch.all(act.sensitivity[zero] == 0) and torch.all(act.sensitivity[~zero] > 0)
    # T_i: each activation element is read by the 8 outputs of its token; each weight element meets
    # 8 samples x 3 tokens in the forward and the error GEMM
    assert method.computation("0", "act").tolist() == [16 * 8.0] * 12
    assert method.computation("0", "weight").tolist() == [16 * 2 * 8 * 3.0] * 4

    act.map = torch.full((12,), 8, dtype=torch.int32)
    act.map[4] = 0  # samples 0-3, channels 4-7, token 1: skipped in the weight-gradient GEMM
    model[0].weight.grad = None
    model(x).sum().backward()  # grad_output all ones (exact at 8 bits): grad_w[o, c] = sum over samples, tokens of x[., ., c]
    mapped = x.clone()
    mapped[0:4, 1, 4:8] = 0
    assert torch.equal(model[0].weight.grad, mapped.sum(dim=(0, 1)).expand(8, 8))
    assert not torch.equal(model[0].weight.grad, x.sum(dim=(0, 1)).expand(8, 8))


def test_a_linear_on_tokens_quantizes_grad_output_on_batch_by_output_blocks_at_each_token():
    method, model = _dynasty_linear(8, (3, 8), 8, "method.grad_rounding=nearest")
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(8))  # 4-bit blocks keep the identity: the input's gradient is grad_output
    x = torch.randn(8, 3, 8, requires_grad=True)
    g = torch.ones(8, 3, 8)
    g[0, 0, 0] = 1024.0  # its block (samples 0-3, outputs 0-3, token 0) steps by 2^(10 + 2 - 8) = 16: the ones there go to 0
    (model(x) * g).sum().backward()
    expected = torch.ones(8, 3, 8)
    expected[0:4, 0, 0:4] = 0
    expected[0, 0, 0] = 1024.0
    assert torch.equal(x.grad, expected)


@pytest.mark.slow
def test_dynasty_trains_a_transformer_with_maps_that_differ_between_blocks():
    from qtrain.methods import build_method
    from qtrain.models import build_model

    torch.manual_seed(0)
    method = build_method(make_config("method=dynasty").method)
    model = method.prepare(build_model("transformer", {"name": "transformer"}, vocab_size=50, layers=1, d_model=32,
                                       heads=2, ffn=64, dropout=0.0, seq_len=16))
    tokens = torch.randint(0, 50, (4, 16))
    method.profile(model, tokens[:2])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    method.attach(optimizer, RunFacts(4, 1, 4))

    def train(steps):
        for _ in range(steps):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            optimizer.step()
            assert torch.isfinite(loss)
            assert set(method.precision()) == set(method.layers)

    train(3)
    assert set(method.layers) == {"blocks.0.attention.qkv", "blocks.0.attention.out", "blocks.0.ffn1", "blocks.0.ffn2", "head"}
    ffn2 = method.layers["blocks.0.ffn2"]  # input (4, 16, 64): 1 sample block x 16 channel blocks x 16 tokens
    assert ffn2.act.dims == ffn2.grad.dims == (0, -1) and ffn2.weight.dims == (0, 1)
    assert ffn2.act.map.shape == (16 * 16,) and ffn2.weight.map.shape == (8 * 16,)
    method.end_epoch(0, {})
    train(3)
    for operand in ("weight", "act"):
        maps = torch.cat([getattr(quant, operand).map for quant in method.layers.values()])
        assert len(maps.unique()) > 1


def test_a_batch_of_other_sequences_than_the_map_was_made_for_is_refused():
    act = ActivationMap("nearest", 4, (0, -1))
    act.batch_size = 8
    act.compact(torch.randn(8, 3, 8))
    act.compact(torch.randn(5, 3, 8))  # a smaller last batch: the map's first rows
    with pytest.raises(ValueError, match=r"shape \(2, 8\) do not fit the activation map made for \(3, 8\)"):
        act.compact(torch.randn(8, 2, 8))  # 2 tokens: the map's entries would land on other tokens
