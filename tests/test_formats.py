"""Number formats against QPyTorch (same grid and clamping, unbiased stochastic rounding) and by hand."""

import math

import pytest
import torch
from qtorch.quant import block_quantize, fixed_point_quantize, float_quantize

from qtrain.quant import formats

REPEATS = 4096


def _data(n: int = 4096, scale: float = 3.0) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(n) * scale


def _off_ties(x_scaled: torch.Tensor) -> torch.Tensor:
    """Elements not within float32 noise of a rounding tie (QPyTorch rounds ties differently)."""
    return (x_scaled - torch.floor(x_scaled) - 0.5).abs() > 1e-3


@pytest.mark.parametrize("wl,fl", [(8, 4), (4, 2), (16, 10), (6, 0)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_fixed_point_nearest_matches_qtorch(wl, fl, symmetric):
    x = torch.cat([_data(), torch.tensor([1e4, -1e4])])
    ours = formats.fixed_point(x, wl, fl, "nearest", symmetric)
    ref = fixed_point_quantize(x, wl, fl, clamp=True, symmetric=symmetric, rounding="nearest")
    assert torch.equal(ours, ref)
    top = 2.0 ** (wl - fl - 1) - 2.0**-fl
    assert ours.max() == top and ours.min() == (-top if symmetric else -top - 2.0**-fl)


def test_fixed_point_hand_computed():
    x = torch.tensor([0.30, -0.30, 0.125, 5.0, -5.0, 0.0625])
    # <4,2>: step 0.25, range [-2, 1.75]; 0.125 is a tie -> even (0.0); 0.0625 -> 0
    assert formats.fixed_point(x, 4, 2).tolist() == [0.25, -0.25, 0.0, 1.75, -2.0, 0.0]


def _sr_mean(fn, x: torch.Tensor) -> torch.Tensor:
    return fn(x.expand(REPEATS, -1).contiguous()).double().mean(0)


def test_fixed_point_stochastic_on_grid_and_unbiased_like_qtorch():
    x = _data(64, 1.0)
    torch.manual_seed(1)
    ours = formats.fixed_point(x.expand(REPEATS, -1).contiguous(), 8, 4, "stochastic")
    lower = torch.floor(x * 16) / 16
    assert torch.all((ours == lower) | (ours == lower + 1 / 16))
    tol = 4 * (1 / 16) * 0.5 / math.sqrt(REPEATS)  # four standard errors of a Bernoulli step
    assert torch.allclose(ours.double().mean(0), x.double(), atol=tol)
    ref = _sr_mean(lambda t: fixed_point_quantize(t, 8, 4, rounding="stochastic"), x)
    assert torch.allclose(ours.double().mean(0), ref, atol=2 * tol)


@pytest.mark.parametrize("wl", [4, 8, 12])
def test_block_floating_point_whole_tensor_matches_qtorch(wl):
    x = _data()
    ours = formats.block_floating_point(x, wl, "nearest")
    ref = block_quantize(x, wl, dim=-1, rounding="nearest")
    step = 2.0 ** (math.floor(math.log2(x.abs().max().item())) + 2 - wl)
    keep = _off_ties(x / step)
    assert torch.equal(ours[keep], ref[keep])
    assert ours.abs().max() <= 2 ** (wl - 1) * step  # symmetric clamp


def test_block_floating_point_hand_computed():
    # max 3.0 -> E = 1; wl = 4 -> step 2^(1+2-4) = 0.5, magnitudes up to 2^(E+1) - step = 3.5
    x = torch.tensor([3.0, 1.2, -0.3, 0.74, -2.9])
    assert formats.block_floating_point(x, 4).tolist() == [3.0, 1.0, -0.5, 0.5, -3.0]


def test_block_floating_point_tiles_match_qtorch_per_tile():
    torch.manual_seed(2)
    w = torch.randn(10, 7, 3, 3) * torch.logspace(-3, 1, 10).view(10, 1, 1, 1)
    ours = formats.block_floating_point(w, 6, "nearest", block=4, dims=(0, 1))
    for i in range(0, 10, 4):
        for j in range(0, 7, 4):
            for k in range(3):
                tile = w[i:i + 4, j:j + 4, k, 1]
                ref = block_quantize(tile.contiguous(), 6, dim=-1, rounding="nearest")
                step = 2.0 ** (math.floor(math.log2(tile.abs().max().item())) + 2 - 6)
                keep = _off_ties(tile / step)
                assert torch.equal(ours[i:i + 4, j:j + 4, k, 1][keep], ref[keep])


def test_block_floating_point_stochastic_unbiased_like_qtorch():
    x = _data(64, 1.0)
    torch.manual_seed(3)
    ours = formats.block_floating_point(x.expand(REPEATS, -1).contiguous(), 6, "stochastic")
    step = 2.0 ** (math.floor(math.log2(x.abs().max().item())) + 2 - 6)
    lower = torch.floor(x / step) * step
    assert torch.all((ours == lower) | (ours == lower + step))
    tol = 4 * step * 0.5 / math.sqrt(REPEATS)
    assert torch.allclose(ours.double().mean(0), x.double(), atol=tol)
    ref = _sr_mean(lambda t: block_quantize(t, 6, dim=-1, rounding="stochastic"), x)
    assert torch.allclose(ours.double().mean(0), ref, atol=2 * tol)


def test_float_stochastic_unbiased_like_qtorch():
    x = _data(64, 1.0)
    torch.manual_seed(4)
    ours = formats.floating_point(x.expand(REPEATS, -1).contiguous(), 5, 2, "stochastic")
    ulp = torch.exp2(torch.floor(torch.log2(x.abs())) - 2)
    lower = torch.floor(x / ulp) * ulp
    assert torch.all((ours == lower) | (ours == lower + ulp))
    tol = (4 * ulp * 0.5 / math.sqrt(REPEATS)).double()
    assert torch.all((ours.double().mean(0) - x.double()).abs() <= tol)
    ref = _sr_mean(lambda t: float_quantize(t, 5, 2, rounding="stochastic"), x)
    assert torch.all((ours.double().mean(0) - ref).abs() <= 2 * tol)


def test_range_linear_hand_computed():
    x = torch.tensor([-1.0, 0.0, 0.5, 1.0, 3.0])
    lo, hi = formats.tensor_range(x, "tensor")
    # 2 bits over [-1, 3]: step 4/3, grid -1 + k * 4/3; (x + 1) / step = 0, .75, 1.125, 1.5 (tie -> 2), 3
    out = formats.range_linear(x, 2, lo, hi)
    assert torch.allclose(out, torch.tensor([-1.0, 1 / 3, 1 / 3, 5 / 3, 3.0]))


def test_range_linear_per_channel_and_sample_mean_ranges():
    w = torch.tensor([[0.0, 1.0, 2.0], [-4.0, 0.0, 4.0]])
    lo, hi = formats.tensor_range(w, "channel")
    assert lo.flatten().tolist() == [0.0, -4.0] and hi.flatten().tolist() == [2.0, 4.0]
    # 1 bit: row 0 grid {0, 2}, row 1 grid {-4, 4}; 1.0 and 0.0 are ties -> even code (0)
    assert formats.range_linear(w, 1, lo, hi).tolist() == [[0.0, 0.0, 2.0], [-4.0, -4.0, 4.0]]
    lo, hi = formats.tensor_range(w, "sample_mean")
    assert lo.item() == -2.0 and hi.item() == 3.0


def test_range_linear_stochastic_is_unbiased_with_exact_ends():
    x = torch.linspace(-1, 1, 64)
    lo, hi = torch.full((1, 1), -1.0), torch.full((1, 1), 1.0)
    torch.manual_seed(5)
    out = formats.range_linear(x.expand(REPEATS, -1).contiguous(), 3, lo, hi, "stochastic")
    step = 2 / 7
    assert torch.allclose(out.double().mean(0), x.double(), atol=4 * step * 0.5 / math.sqrt(REPEATS))
    assert set(out[:, 0].tolist()) == {-1.0} and set(out[:, -1].tolist()) == {1.0}


# --- nearest rounding sends ties to the even code in every format (hand-computed ties) --------------

def test_fixed_point_ties_go_to_even():
    # <8,2>: step 0.25; t = 0.5, 1.5, -0.5, -1.5, 2.5, 4.5 -> 0, 2, -0, -2, 2, 4
    x = torch.tensor([0.125, 0.375, -0.125, -0.375, 0.625, 1.125])
    assert formats.fixed_point(x, 8, 2).tolist() == [0.0, 0.5, -0.0, -0.5, 0.5, 1.0]
    assert formats.fixed_point(x, 8, 2, clamp=False).tolist() == [0.0, 0.5, -0.0, -0.5, 0.5, 1.0]


def test_block_floating_point_ties_go_to_even():
    # max 3 -> E = 1; wl 4 -> step 0.5; t = 0.5, 1.5, -2.5, 4.5, -0.5 -> 0, 2, -2, 4, -0 (QPyTorch: 1, 2, -2, 5, 0)
    x = torch.tensor([3.0, 0.25, 0.75, -1.25, 2.25, -0.25])
    expected = [3.0, 0.0, 1.0, -1.0, 2.0, -0.0]
    assert formats.block_floating_point(x, 4).tolist() == expected
    assert formats.block_floating_point(x.view(2, 3), 4, dim=0).flatten().tolist() == expected  # rows: max 3, 2.25
    assert formats.block_floating_point(x.view(2, 3), 4, block=3).flatten().tolist() == expected


def test_float_ties_go_to_even():
    # <5,2>: step 0.25 in [1, 2), 0.5 in [2, 4); subnormal step 2^-16 (QPyTorch: ties away from zero)
    x = torch.tensor([1.125, 1.375, 2.75, 3.75, 2.0**-17, 3 * 2.0**-17])
    expected = [1.0, 1.5, 3.0, 4.0, 0.0, 2.0**-15]
    assert formats.floating_point(x, 5, 2).tolist() == expected
    assert formats.floating_point(-x, 5, 2).tolist() == [-v for v in expected]


def test_range_linear_ties_go_to_even():
    # 2 bits over [0, 3]: step 1; t = 0.5, 1.5, 2.5 -> 0, 2, 2
    x = torch.tensor([0.0, 0.5, 1.5, 2.5, 3.0])
    assert formats.range_linear_from_data(x, 2, "tensor")[0].tolist() == [0.0, 0.0, 2.0, 2.0, 3.0]
