"""The float <exp, man> format on the IEEE 754 grid, against torch's own casts and QPyTorch.

<5,10> is IEEE binary16 and <8,7> is bfloat16: with nearest rounding the format must equal
``x.half().float()`` and ``x.bfloat16().float()`` bit for bit on every float32, subnormals, overflow
to infinity, signed zeros and NaN included. QPyTorch's float kernel is a reference only inside the
IEEE range and off ties: it rounds ties away from zero and reserves no exponent for inf/NaN, so it
keeps one more binade at the top and clamps there instead of overflowing.
"""

import math

import pytest
import torch

from qtrain.quant import formats

CASTS = {(5, 10): torch.float16, (8, 7): torch.bfloat16}
INF = float("inf")


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of unsigned 32-bit patterns held in int64."""
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def rounding_classes(man: int, seed: int = 0) -> torch.Tensor:
    """Every float32 exponent and sign x every target mantissa x round bit x sticky bits.

    The 23 - ``man`` bits a cast drops are a round bit (the highest) and sticky bits below it; the
    sticky bits are none, only the lowest, all, or random. Exponents 0 (zero and subnormals) and
    255 (inf and NaN) are included.
    """
    drop = 23 - man
    sticky_bits = drop - 1
    gen = torch.Generator().manual_seed(seed)
    sign = torch.tensor([0, 1 << 31]).view(-1, 1, 1, 1, 1)
    exponent = (torch.arange(256) << 23).view(1, -1, 1, 1, 1)
    mantissa = (torch.arange(1 << man) << drop).view(1, 1, -1, 1, 1)
    round_bit = torch.tensor([0, 1 << sticky_bits]).view(1, 1, 1, -1, 1)
    shape = (2, 256, 1 << man, 2, 1)
    classes = [torch.zeros(shape, dtype=torch.int64), torch.ones(shape, dtype=torch.int64),
               torch.full(shape, (1 << sticky_bits) - 1), torch.randint(0, 1 << sticky_bits, shape, generator=gen)]
    bits = sign + exponent + mantissa + round_bit + torch.cat(classes, dim=-1)
    return _from_bits(bits.flatten())


SPECIALS = torch.tensor([0.0, -0.0, INF, -INF, float("nan"), torch.finfo(torch.float32).max,
                         -torch.finfo(torch.float32).max, 2.0**-149, -(2.0**-149), torch.finfo(torch.float32).tiny])


def _assert_same_bits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(ours), nan)
    mismatch = (ours.view(torch.int32) != ref.view(torch.int32)) & ~nan
    assert not mismatch.any(), f"{int(mismatch.sum())} differ, e.g. {ours[mismatch][:4]} vs {ref[mismatch][:4]}"


@pytest.mark.parametrize("exp,man", list(CASTS))
@pytest.mark.slow
def test_nearest_equals_torch_cast_on_every_rounding_class(exp, man):
    x = torch.cat([rounding_classes(man), SPECIALS])
    assert x.numel() >= 2 * 256 * (1 << man) * 8
    _assert_same_bits(formats.floating_point(x, exp, man), x.to(CASTS[exp, man]).float())


def test_ieee_grid_by_hand():
    # <3,2>: bias 3, exponents -2..3, largest 2^3 * 1.75 = 14, subnormal step 2^(-2-2) = 1/16
    x = torch.tensor([1.3, 14.0, 14.9, 15.0, 100.0, -100.0, 0.07, 5.2, 1 / 32, 3 / 32, 0.01])
    expected = [1.25, 14.0, 14.0, INF, INF, -INF, 0.0625, 5.0, 0.0, 0.125, 0.0]
    # 15 is the tie between 14 and 16 (= 2^(emax+1)): even mantissa -> 16 -> overflow to inf
    # 1/32 is the tie between 0 and 1/16 -> 0 (even); 3/32 between 1/16 and 1/8 -> 1/8 (even)
    assert formats.floating_point(x, 3, 2).tolist() == expected


def test_saturate_clamps_finite_overflow_and_keeps_inf_and_nan():
    x = torch.tensor([1e6, -1e6, 15.0, 14.9, INF, -INF, float("nan"), 3.0])
    out = formats.floating_point(x, 3, 2, saturate=True)
    assert out[:6].tolist() == [14.0, -14.0, 14.0, 14.0, INF, -INF]
    assert math.isnan(out[6]) and out[7] == 3.0
    torch.manual_seed(0)
    sr = formats.floating_point(x.repeat(1000), 3, 2, "stochastic", saturate=True).view(1000, -1)
    assert torch.all(sr[:, :4].abs() == 14.0) and torch.all(sr[:, 4:6].isinf()) and torch.all(sr[:, 6].isnan())
    # e4m3-style FP8 recipes: largest finite 2^7 * 1.75 = 240 on the IEEE grid
    assert formats.floating_point(torch.tensor([1e4, -300.0]), 4, 3, saturate=True).tolist() == [240.0, -240.0]


def test_stochastic_keeps_specials_and_zero_signs():
    torch.manual_seed(0)
    x = torch.tensor([INF, -INF, float("nan"), 0.0, -0.0, -1e-30]).repeat(100)
    out = formats.floating_point(x, 5, 10, "stochastic").view(100, -1)
    assert torch.all(out[:, 0] == INF) and torch.all(out[:, 1] == -INF) and torch.all(out[:, 2].isnan())
    assert torch.all(out[:, 3].view(torch.int32) == 0)
    assert torch.all(torch.signbit(out[:, 4:]))  # -1e-30 rounds to -0 or to -(smallest subnormal)


@pytest.mark.slow
def test_float32_itself_is_the_identity():
    x = torch.cat([rounding_classes(10, seed=2), SPECIALS])
    _assert_same_bits(formats.floating_point(x, 8, 23), x)
    torch.manual_seed(0)
    _assert_same_bits(formats.floating_point(x, 8, 23, "stochastic"), x)


def _ieee_values(exp: int, man: int, n: int = 4096) -> torch.Tensor:
    """Log-uniform magnitudes over the format's whole range (subnormals included), both signs."""
    bias = 2 ** (exp - 1) - 1
    largest = 2.0**bias * (2 - 2.0**-man)
    torch.manual_seed(exp * 100 + man)
    lo, hi = 1 - bias - man - 2, math.log2(largest)
    mag = torch.exp2(torch.rand(n, dtype=torch.float64) * (hi - lo) + lo).clamp(max=largest)
    return (mag * torch.where(torch.rand(n) < 0.5, -1.0, 1.0).double()).float()


def _off_ties(x: torch.Tensor, exp: int, man: int) -> torch.Tensor:
    """Elements clearly away from a rounding tie, where QPyTorch's ties away from zero cannot matter.

    At least 2^-10 of a step away; below the smallest normal QPyTorch first adds ``2^emin`` in
    float32, which rounds the value to 2^(man-23) of a step, so there the margin is 2^(man-22).
    """
    x64 = x.double()
    e_min = 2 - 2 ** (exp - 1)
    e = torch.floor(torch.log2(x64.abs().clamp_min(2.0**-300)))
    r = x64 / torch.exp2(e.clamp_min(e_min) - man)
    margin = torch.where(e < e_min, 2.0 ** (man - 22), 2.0**-10)
    return ((r - torch.floor(r)) - 0.5).abs() > margin


@pytest.mark.parametrize("exp", range(2, 9))
@pytest.mark.parametrize("man", [1, 2, 3, 5, 7, 10, 16, 22])
@pytest.mark.slow
def test_every_format_matches_qtorch_inside_the_ieee_range(exp, man):
    # imported here: test_fused borrows this file's helpers, and gpu-check runs it where qtorch is not installed
    from qtorch.quant import float_quantize

    x = _ieee_values(exp, man)
    keep = _off_ties(x, exp, man)
    assert keep.sum() >= 100  # at man = 22 half of all float32 values are ties, and more below 2^emin
    ours = formats.floating_point(x, exp, man)
    ref = float_quantize(x, exp, man, rounding="nearest")
    assert torch.equal(ours[keep], ref[keep])


@pytest.mark.parametrize("exp,man", [(2, 1), (3, 4), (4, 3), (5, 2), (6, 9), (8, 20)])
def test_largest_finite_smallest_subnormal_and_overflow(exp, man):
    bias = 2 ** (exp - 1) - 1
    largest, tiny = 2.0**bias * (2 - 2.0**-man), 2.0 ** (1 - bias - man)
    half_ulp_top = 2.0 ** (bias - man - 1)
    x = torch.tensor([largest, largest + half_ulp_top * 0.75, largest + half_ulp_top, tiny, tiny * 0.5, tiny * 0.625])
    assert formats.floating_point(x, exp, man).tolist() == [largest, largest, INF, tiny, 0.0, tiny]


def test_only_float32_and_valid_formats():
    with pytest.raises(TypeError, match="float32"):
        formats.floating_point(torch.zeros(4, dtype=torch.float64), 5, 10)
    with pytest.raises(ValueError, match="outside"):
        formats.floating_point(torch.zeros(4), 9, 10)
