"""Block floating point: tiny blocks, non-finite elements, and QPyTorch's per-slice mode (``dim``).

QPyTorch's block kernel is the reference off ties only: it rounds ``x + 6 * 2^E`` in float32 (a first
rounding to 2^(wl-23) of a step) and then rounds ties up, where ours rounds once, half to even. Its
``dim=d`` shares one exponent per index of dimension ``d`` (the maximum over all other dimensions);
its ``dim=-1`` means the whole tensor, which is ``dim=None`` here (``dim=-1`` is the last dimension).
It also needs the block maximum below 2^126 (``6 * 2^E`` overflows above).
"""

import math

import pytest
import torch
from qtorch.quant import block_quantize

from qtrain.quant import formats
from qtrain.quant.quantizers import BlockFloatingPoint

INF, NAN = float("inf"), float("nan")


def _steps(x: torch.Tensor, wl: int, dim: int | None) -> torch.Tensor:
    """Each element's step 2^(E + 2 - wl), E = floor(log2(max |x|)) over its block, in float64."""
    mag = x.double().abs()
    if dim is None:
        block_max = mag.max().expand_as(mag)
    else:
        others = [d for d in range(x.dim()) if d != dim % x.dim()]
        block_max = mag.amax(dim=others, keepdim=True).expand_as(mag)
    return torch.exp2(torch.floor(torch.log2(block_max)) + 2 - wl)


def _off_ties(x: torch.Tensor, step: torch.Tensor, wl: int) -> torch.Tensor:
    r = x.double() / step
    return ((r - torch.floor(r)) - 0.5).abs() > max(2.0**-10, 2.0 ** (wl - 22))


def test_tiny_blocks_keep_their_values():
    # max 1.5 * 2^-120 -> E = -120; wl 8 -> step 2^(-120 + 2 - 8) = 2^-126: all three on the grid
    x = torch.tensor([1.5 * 2.0**-120, 2.0**-125, -0.75 * 2.0**-120])
    assert torch.equal(formats.block_floating_point(x, 8), x)
    # subnormal block: max 100 * 2^-149 -> E = -143; wl 4 -> step 2^-145 = 16 * 2^-149, codes up to 7
    sub = torch.tensor([1.0, 7.0, 100.0, -64.0, 8.0, 24.0]) * 2.0**-149
    expected = torch.tensor([0.0, 0.0, 96.0, -64.0, 0.0, 32.0]) * 2.0**-149  # 8 and 24: ties -> even codes 0, 2
    assert torch.equal(formats.block_floating_point(sub, 4), expected)
    # wl 24 would step 2^-165, finer than float32 holds: the step stops at 2^-149 and every value stays
    assert torch.equal(formats.block_floating_point(sub, 24), sub)
    torch.manual_seed(0)
    assert torch.equal(formats.block_floating_point(sub.repeat(100), 24, "stochastic"), sub.repeat(100))


def test_huge_blocks_do_not_overflow():
    big = torch.finfo(torch.float32).max
    x = torch.tensor([big, -big, 2.0**120, 3.0**70])
    out = formats.block_floating_point(x, 8)
    step = 2.0 ** (127 + 2 - 8)
    assert out.tolist() == [127 * step, -127 * step, 0.0, round(3.0**70 / step) * step]
    assert torch.isfinite(formats.block_floating_point(x, 8, "stochastic")).all()


def test_nan_and_inf_pass_through_and_the_exponent_comes_from_finite_values():
    # largest finite magnitude 1.0 -> E = 0; wl 4 -> step 0.25
    x = torch.tensor([1.0, 0.3, NAN, INF, -INF, -0.6])
    for rounding in ("nearest", "stochastic"):
        out = formats.block_floating_point(x, 4, rounding)
        assert math.isnan(out[2]) and out[3] == INF and out[4] == -INF
        assert out[0] == 1.0 and out[1] in (0.25, 0.5) and out[5] in (-0.5, -0.75)
    assert formats.block_floating_point(x, 4)[[0, 1, 5]].tolist() == [1.0, 0.25, -0.5]
    tiles = torch.tensor([[1.0, NAN], [INF, 0.3]])
    out = formats.block_floating_point(tiles, 4, block=2)
    assert out[0, 0] == 1.0 and math.isnan(out[0, 1]) and out[1, 0] == INF and out[1, 1] == 0.25
    only = torch.tensor([NAN, INF, -INF])
    out = formats.block_floating_point(only, 6)
    assert math.isnan(out[0]) and out[1:].tolist() == [INF, -INF]


def _per_slice_data() -> torch.Tensor:
    torch.manual_seed(3)
    scale = torch.logspace(-30, 30, 5, base=2.0)
    x = torch.randn(5, 4, 6, 3)
    return x * scale.view(5, 1, 1, 1) * scale.flip(0)[:4].view(1, 4, 1, 1)


@pytest.mark.parametrize("wl", [4, 8, 13])
@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_per_slice_exponents_match_qtorch(wl, dim):
    x = _per_slice_data()
    ours = formats.block_floating_point(x, wl, dim=dim)
    ref = block_quantize(x, wl, dim=dim, rounding="nearest")
    keep = _off_ties(x, _steps(x, wl, dim), wl)
    assert keep.double().mean() > 0.9
    assert torch.equal(ours[keep], ref[keep])
    if dim == 3:
        assert torch.equal(formats.block_floating_point(x, wl, dim=-1), ours)


def test_per_slice_takes_the_max_over_all_other_dimensions():
    x = torch.tensor([[3.0, 0.3], [0.01, 0.2]])
    # dim 0: rows share an exponent (max 3 -> step 0.5 at wl 4; max 0.2 -> E = -3, step 2^-5)
    assert formats.block_floating_point(x, 4, dim=0).tolist() == [[3.0, 0.5], [0.0, 0.1875]]
    # dim 1: columns (max 3 -> step 0.5; max 0.3 -> E = -2, step 2^-4)
    assert formats.block_floating_point(x, 4, dim=1).tolist() == [[3.0, 0.3125], [0.0, 0.1875]]
    one_d = torch.tensor([3.0, -0.3, 1e-20])  # every element its own block: kept to wl - 1 significant bits
    assert formats.block_floating_point(one_d, 8, dim=0).tolist() == formats.floating_point(one_d, 8, 6).tolist()


def test_whole_tensor_matches_qtorch_dim_minus_one():
    x = _per_slice_data()
    keep = _off_ties(x, _steps(x, 8, None), 8)
    assert torch.equal(formats.block_floating_point(x, 8)[keep], block_quantize(x, 8, dim=-1, rounding="nearest")[keep])


def test_quantizer_takes_the_per_slice_option():
    x = _per_slice_data()
    q = BlockFloatingPoint(8, "nearest", dim=1)
    assert torch.equal(q(x), formats.block_floating_point(x, 8, "nearest", dim=1))
    assert "dim=1" in repr(q)
    with pytest.raises(ValueError, match="block"):
        formats.block_floating_point(x, 8, block=4, dim=1)
