"""Every format against QPyTorch over the whole float32 magnitude range, off ties.

Values are log-uniform over 2^-149 .. 2^127 (subnormals included), both signs. QPyTorch differs on
purpose at ties (its float kernel rounds them away from zero, its block kernel up, and both round
in float32 once before: see the margins below), above the IEEE range of a float format (it keeps
one more binade and clamps), for block maxima of 2^126 or more (``6 * 2^E`` overflows there) and,
without clamping, for fixed-point values beyond 2^23 steps (checked against the identity instead),
so those are left out; everything else must agree exactly, the sign of zero aside.
"""

import math

import pytest
import torch
from qtorch.quant import block_quantize, fixed_point_quantize, float_quantize

from qtrain.quant import formats

N = 1 << 16


def log_uniform(n: int = N, lo: float = -149, hi: float = 127, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.rand(n, generator=gen, dtype=torch.float64) * (hi - lo) + lo)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return (mag * sign).float()


def _same(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal values (a zero's sign aside: QPyTorch returns +0 where a negative value rounds to zero)."""
    return bool(torch.all((ours == ref) | (ours.isnan() & ref.isnan())))


def _off_ties(r: torch.Tensor, margin: float | torch.Tensor) -> torch.Tensor:
    """``r`` is a value in units of its step (float64); keep it at least ``margin`` of a step from a tie."""
    return ((r - torch.floor(r)) - 0.5).abs() > margin


@pytest.mark.parametrize("wl,fl", [(8, 4), (16, 8), (24, 12), (12, 0), (8, 7)])
@pytest.mark.parametrize("clamp", [True, False])
@pytest.mark.slow
def test_fixed_point(wl, fl, clamp):
    x = log_uniform(seed=wl + fl)
    t = x.double() * 2.0**fl
    keep = _off_ties(t, 1e-3) | ~torch.isfinite(t)
    ours = formats.fixed_point(x, wl, fl, clamp=clamp)
    ref = fixed_point_quantize(x, wl, fl, clamp=clamp, rounding="nearest")
    if not clamp:
        # QPyTorch rounds x * 2^fl + 0.5 - 0.5 in float32, which moves values on the grid once
        # |x * 2^fl| >= 2^23; there every float32 lies on the grid and must come back unchanged
        big = t.abs() >= 2.0**23
        assert torch.equal(ours[big], x[big])
        keep &= ~big
    assert _same(ours[keep], ref[keep])
    assert keep.double().mean() > 0.5


def _block_steps(x: torch.Tensor, wl: int, dim: int | None) -> torch.Tensor:
    mag = x.double().abs()
    block_max = mag.max().expand_as(mag) if dim is None else mag.amax(dim=1 - dim, keepdim=True).expand_as(mag)
    return torch.exp2(torch.floor(torch.log2(block_max)) + 2 - wl)


@pytest.mark.parametrize("wl", [4, 8, 12, 20])
@pytest.mark.parametrize("dim", [None, 0, 1])
def test_block_floating_point(wl, dim):
    # below 2^125 (QPyTorch's limit); rows and columns of different magnitudes for the per-slice modes
    x = log_uniform(lo=-149, hi=124, seed=wl).view(256, 256)
    x = x * torch.exp2(-torch.linspace(0, 100, 256)).view(-1, 1)
    keep = _off_ties(x.double() / _block_steps(x, wl, dim), max(2.0**-10, 2.0 ** (wl - 22)))
    ours = formats.block_floating_point(x, wl, dim=dim)
    ref = block_quantize(x, wl, dim=-1 if dim is None else dim, rounding="nearest")
    assert _same(ours[keep], ref[keep])
    assert keep.double().mean() > 0.95
    assert (ours != 0).sum() >= 20  # not a comparison of flushed zeros only


@pytest.mark.parametrize("exp,man", [(8, 7), (5, 10), (4, 3), (5, 2), (6, 9), (3, 4), (8, 20)])
def test_float(exp, man):
    x = log_uniform(seed=exp * 32 + man)
    bias = 2 ** (exp - 1) - 1
    largest = 2.0**bias * (2 - 2.0**-man)
    x64 = x.double()
    e = torch.floor(torch.log2(x64.abs())).clamp_min(1 - bias)
    # below 2^emin QPyTorch first adds 2^emin in float32, rounding to 2^(man-23) of a step
    margin = torch.where(x64.abs() < 2.0 ** (1 - bias), 2.0 ** (man - 22), 2.0**-10)
    keep = (x64.abs() <= largest) & _off_ties(x64 / torch.exp2(e - man), margin)
    ours = formats.floating_point(x, exp, man)
    ref = float_quantize(x, exp, man, rounding="nearest")
    assert _same(ours[keep], ref[keep])
    in_range = (x64.abs() <= largest).double().mean().item()
    assert keep.double().mean().item() > 0.75 * in_range  # at man = 20 one value in eight is a tie
    assert torch.all(ours[x64.abs() > largest * (1 + 2.0 ** (-man - 1))].isinf())  # beyond: IEEE overflow
    assert math.isclose(in_range, (math.log2(largest) + 149) / 276, abs_tol=0.02)
