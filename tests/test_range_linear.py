"""Range-linear quantization: constant tensors, cancellation far from zero, exact decoding, edges.

The reference is a float64 hand computation of the SBM grid: ``t = (x - lo) * (levels / (hi - lo))``,
code ``round(t)`` (half to even) clamped to [0, levels], value ``code * step + lo`` with
``step = (hi - lo) / levels``.
"""

import math

import pytest
import torch

from qtrain.quant import formats
from qtrain.quant.quantizers import RangeLinear, quantize_twice

GRANULARITIES = ("tensor", "channel", "sample_mean")


@pytest.mark.parametrize("value", [1e4, -3.7, 0.0, 3e38, -1e-42])
@pytest.mark.parametrize("bits", [2, 8, 16])
def test_constant_tensor_comes_back_unchanged(value, bits):
    x = torch.full((3, 3, 5), value)  # 3 samples: their mean is not a sum and a division by a power of 2
    for granularity in GRANULARITIES:
        out, lo, hi = formats.range_linear_from_data(x, bits, granularity)
        assert torch.equal(out, x) and torch.equal(lo, hi)
        assert torch.equal(formats.range_linear(x, bits, lo, hi, "stochastic"), x)
        if formats.code_dtype(bits) is not None:
            out, _, _, compact = formats.range_linear_codes(x, bits, granularity, "stochastic")
            assert torch.equal(out, x) and torch.equal(formats.decode_codes(compact, x.shape), x)


def test_constant_rows_with_per_channel_ranges():
    w = torch.stack([torch.full((6,), 1e4), torch.linspace(-1, 1, 6), torch.full((6,), -2.5)])
    out, lo, hi = formats.range_linear_from_data(w, 4, "channel")
    assert torch.equal(out[0], w[0]) and torch.equal(out[2], w[2])
    assert lo.shape == hi.shape == (3, 1)
    assert torch.allclose(out[1], w[1], atol=1 / 15)


def _reference(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 codes and values of ``x`` over its own range (one range for the tensor)."""
    x64 = x.double()
    lo, hi = x64.min(), x64.max()
    levels = 2.0**bits - 1
    t = (x64 - lo) * (levels / (hi - lo))
    codes = torch.round(t).clamp(0, levels)
    return t, codes * ((hi - lo) / levels) + lo


@pytest.mark.parametrize("center,ulps,bits", [
    (1e4, 1, 16),  # a range of 2^-10 ~ 1e-3 near 1e4 (the float32 grid holds just lo and hi there)
    (1e4, 1 << 16, 16),  # a range of 64: 65536 float32 values on 65536 levels
    (1e4, 2000, 8),
    (-3e5, 5000, 12),
    (1e2, 131, 16),  # a range of 1e-3 near 100
])
def test_far_from_zero_the_codes_match_a_float64_computation(center, ulps, bits):
    ulp = 2.0 ** (math.frexp(abs(center))[1] - 24)  # float32 ulp at |center|
    torch.manual_seed(0)
    x = (torch.tensor(center, dtype=torch.float64) + torch.randint(0, ulps + 1, (4096,)).double() * ulp).float()
    x[:2] = torch.tensor([center, center + ulps * ulp])  # the range: exactly ulps float32 steps
    t, ref = _reference(x, bits)
    off_tie = ((t - torch.floor(t)) - 0.5).abs() > 1e-3
    out, _, _ = formats.range_linear_from_data(x, bits, "tensor")
    # with the right code, the float32 value is within half an ulp of the float64 one (plus ~1e-7 ulp)
    err = (out.double() - ref).abs()[off_tie]
    assert err.max() <= 0.5 * ulp * (1 + 1e-6), f"max error {err.max() / ulp:.3f} ulp"
    if formats.code_dtype(bits) is not None:
        _, _, _, (codes, _, _) = formats.range_linear_codes(x, bits, "tensor")
        assert torch.equal(codes.reshape(-1).double()[off_tie], torch.round(t)[off_tie])


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [1, 2, 8, 12, 15])
def test_decode_rebuilds_the_quantized_tensor_bit_for_bit(granularity, rounding, bits):
    torch.manual_seed(bits)
    x = torch.randn(8, 3, 7, 5) * torch.logspace(-3, 3, 8).view(8, 1, 1, 1) + 1e3
    x[2] = 4.25  # a constant row
    out, lo, hi, compact = formats.range_linear_codes(x, bits, granularity, rounding)
    assert compact[0].dtype == formats.code_dtype(bits) and compact[0].numel() == x.numel()
    assert torch.equal(formats.decode_codes(compact, x.shape).view(torch.int32), out.view(torch.int32))
    rows = 8 if granularity == "channel" else 1
    assert lo.shape == hi.shape == (rows, 1)


def test_empty_tensors():
    for shape in [(0,), (0, 4), (3, 0)]:
        x = torch.empty(shape)
        for granularity in GRANULARITIES:
            out, lo, hi = formats.range_linear_from_data(x, 8, granularity)
            assert out.shape == x.shape
            out, _, _, compact = formats.range_linear_codes(x, 8, granularity)
            assert out.shape == x.shape and formats.decode_codes(compact, x.shape).shape == x.shape
        assert formats.range_linear(x, 8, torch.zeros(1, 1), torch.ones(1, 1)).shape == x.shape


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nan_stays_nan_and_inf_saturates_to_the_ends_of_the_finite_range(rounding):
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, nan, inf, -inf])
    expected = torch.tensor([0.0, 1.0, 2.0, 3.0, nan, 3.0, 0.0])  # 2 bits over [0, 3]: step 1
    out, lo, hi = formats.range_linear_from_data(x, 2, "tensor", rounding)
    assert lo.item() == 0.0 and hi.item() == 3.0
    assert torch.allclose(out, expected, equal_nan=True)
    assert torch.allclose(formats.range_linear(x, 2, lo, hi, rounding), expected, equal_nan=True)
    rows = torch.stack([x, x.flip(0)])
    out, lo, hi = formats.range_linear_from_data(rows, 2, "channel", rounding)
    assert torch.allclose(out, torch.stack([expected, expected.flip(0)]), equal_nan=True)
    assert torch.isnan(formats.range_linear_from_data(torch.tensor([nan, nan]), 8, "tensor")[0]).all()


@pytest.mark.parametrize("granularity", ["tensor", "sample_mean"])
@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.slow)])  # the fused kernel compiles
def test_per_sample_bits_share_one_range_and_match_quantizing_each_sample_alone(granularity, fused):
    from qtrain.quant import rounding

    torch.manual_seed(5)
    x = torch.randn(6, 3, 4, 4) * torch.tensor([1.0, 7, 0.2, 3, 1, 0.5]).view(6, 1, 1, 1)
    bits = torch.tensor([2, 8, 4, 2, 6, 8])
    rounding.set_fused(fused)
    out, lo, hi, compact = formats.range_linear_codes(x, bits, granularity, "nearest", max_bits=8)
    rounding.set_fused(False)
    ref_lo, ref_hi = formats.tensor_range(x, granularity)
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi) and lo.shape == (1, 1)
    alone = torch.cat([formats.range_linear(x[n:n + 1], int(b), lo, hi) for n, b in enumerate(bits.tolist())])
    assert torch.equal(out, alone)
    assert compact[0].dtype == torch.uint8 and torch.equal(formats.decode_codes(compact, x.shape), out)
    assert torch.equal(formats.range_linear_from_data(x, bits, granularity)[0], out)
    assert torch.equal(formats.range_linear(x, bits, lo, hi), out)


def test_per_sample_bits_need_one_range_and_a_code_width():
    x, bits = torch.randn(2, 5), torch.tensor([2, 4])
    with pytest.raises(ValueError, match="granularity 'tensor' or 'sample_mean'"):
        formats.range_linear_from_data(x, bits, "channel")
    with pytest.raises(ValueError, match="max_bits"):
        formats.range_linear_codes(x, bits, "tensor")


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("shape", [(64, 16, 8, 8), (5, 7, 3)])  # in lanes (per tensor), and not
def test_two_widths_equal_two_calls_with_the_same_draws(granularity, rounding, shape):
    x = torch.randn(shape) * 3
    torch.manual_seed(4)
    once = formats.range_linear_two_widths(x, 8, 16, granularity, rounding)
    torch.manual_seed(4)
    twice = (formats.range_linear_from_data(x, 8, granularity, rounding)[0],
             formats.range_linear_from_data(x, 16, granularity, rounding)[0])
    assert all(torch.equal(a, b) for a, b in zip(once, twice))


def test_quantize_twice_shares_a_kernel_only_between_range_linear_quantizers_over_one_range(monkeypatch):
    shared = []
    monkeypatch.setattr(formats, "range_linear_two_widths", lambda *args: shared.append(args) or ("a", "b"))
    grad, grad16 = RangeLinear(8, "tensor", "stochastic"), RangeLinear(16, "tensor", "stochastic")
    x = torch.randn(4, 3)
    assert quantize_twice(grad, grad16, x) == ("a", "b") and len(shared) == 1
    running = RangeLinear(16, "tensor", "stochastic", momentum=0.9)  # a running range: not shared
    nearest = RangeLinear(16, "tensor", "nearest")
    for second in (running, nearest):
        out = quantize_twice(grad, second, x)
        assert len(shared) == 1 and all(isinstance(t, torch.Tensor) for t in out)
    assert len(shared) == 1 and isinstance(quantize_twice(grad, grad16, x, torch.full((4,), 6))[0], torch.Tensor)


def test_two_widths_refuse_a_range_they_do_not_take_from_the_data():
    with pytest.raises(ValueError, match="granularity 'tensor' or 'channel', not 'sample_mean'"):
        formats.range_linear_two_widths(torch.randn(4, 3), 8, 16, "sample_mean")
