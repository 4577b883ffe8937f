"""Edges for every format: empty tensors, constant tensors, NaN and ±inf, fused and eager."""

import math

import pytest
import torch

from qtrain.quant import formats, rounding

INF, NAN = math.inf, math.nan
FIXED_MAX, FIXED_MIN = 127 / 16, -8.0  # <8,4>
FORMATS = {
    # name: (quantize(x, rounding), what +inf and -inf become)
    "fixed": (lambda x, r: formats.fixed_point(x, 8, 4, r), (FIXED_MAX, FIXED_MIN)),
    "fixed-noclamp": (lambda x, r: formats.fixed_point(x, 8, 4, r, clamp=False), (INF, -INF)),
    "fixed-mask": (lambda x, r: formats.fixed_point_with_mask(x, 8, 4, r)[0], (FIXED_MAX, FIXED_MIN)),
    # range-linear: ±inf saturate to the ends of the finite range (in test_infinities: per tensor
    # [-2, 3]; per row [-2, 1] and [0.5, 3]; sample mean [-0.75, 2])
    "range-tensor": (lambda x, r: formats.range_linear_from_data(x, 8, "tensor", r)[0], (3.0, -2.0)),
    "range-channel": (lambda x, r: formats.range_linear_from_data(x, 8, "channel", r)[0], (1.0, 0.5)),
    "range-sample-mean": (lambda x, r: formats.range_linear_from_data(x, 8, "sample_mean", r)[0], (2.0, -0.75)),
    "range-codes": (lambda x, r: formats.decode_codes(formats.range_linear_codes(x, 8, "channel", r)[3], x.shape),
                    (1.0, 0.5)),
    "block": (lambda x, r: formats.block_floating_point(x, 8, r), (INF, -INF)),
    "block-tiles": (lambda x, r: formats.block_floating_point(x, 8, r, block=2), (INF, -INF)),
    "block-dim": (lambda x, r: formats.block_floating_point(x, 8, r, dim=-1), (INF, -INF)),
    "float": (lambda x, r: formats.floating_point(x, 5, 10, r), (INF, -INF)),
    "float-saturate": (lambda x, r: formats.floating_point(x, 4, 3, r, saturate=True), (INF, -INF)),
}
# the fused kernels compile on first use: their half is in the slow tier
MODES = [pytest.param((r, f), id=f"{r}-{'fused' if f else 'eager'}", marks=[pytest.mark.slow] if f else [])
         for r in ("nearest", "stochastic") for f in (False, True)]


@pytest.fixture(params=MODES)
def mode(request):
    rounding_mode, fused = request.param
    rounding.set_fused(fused)
    return rounding_mode


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0), (2, 0, 4)])
@pytest.mark.slow
def test_empty_tensors(name, shape, mode):
    x = torch.empty(shape)
    assert FORMATS[name][0](x, mode).shape == shape


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("value", [0.0, 1.0, -3.3, 1e4, 2.0**-140])
@pytest.mark.slow
def test_constant_tensors_stay_constant(name, value, mode):
    x = torch.full((4, 6), value)
    out = FORMATS[name][0](x, mode)
    assert out.unique().numel() <= (1 if mode == "nearest" else 2)  # stochastic: the two grid neighbours
    if name.startswith("range"):
        assert torch.equal(out, x)  # a constant range maps to lo, which is the value
    if name.startswith("block"):  # the block's own maximum: wl - 1 significant bits, no flush to zero
        assert (out - value).abs().max() <= abs(value) * 2.0**-6


@pytest.mark.parametrize("name", [name for name in FORMATS if name != "range-codes"])  # codes hold no NaN
@pytest.mark.slow
def test_nan_stays_nan_and_leaves_the_rest_alone(name, mode):
    torch.manual_seed(0)
    x = torch.randn(4, 6) * 3
    with_nan = x.clone()
    with_nan[1, 2] = with_nan[3, 0] = NAN
    nan = with_nan.isnan()
    out = FORMATS[name][0](with_nan, mode)
    assert torch.equal(out.isnan(), nan)
    if mode == "nearest" and not name.startswith("range"):
        # elementwise formats and blocks (whose exponent NaN does not set) keep every other element
        reference = FORMATS[name][0](torch.where(nan, 0.0, x), mode)
        assert torch.equal(out[~nan], reference[~nan])


@pytest.mark.parametrize("name", FORMATS)
def test_infinities(name, mode):
    x = torch.tensor([[1.0, INF, -2.0], [-INF, 0.5, 3.0]])
    out = FORMATS[name][0](x, mode)
    assert (out[0, 1].item(), out[1, 0].item()) == pytest.approx(FORMATS[name][1], rel=1e-6)
    assert torch.isfinite(out[torch.isfinite(x)]).all()


def _exact_scale(hi: float, lo: float, wl: int) -> int:
    """MuPPET's s in exact rational arithmetic: the largest s with hi·2^s <= UB + 1/2 and lo·2^s >= LB - 1/2."""
    from fractions import Fraction

    bounds = [(Fraction(hi), Fraction(2 ** (wl - 1)) - Fraction(1, 2))] if hi > 0 else []
    bounds += [(-Fraction(lo), Fraction(2 ** (wl - 1)) + Fraction(1, 2))] if lo < 0 else []
    s = 200
    while any(value * Fraction(2) ** s > limit for value, limit in bounds):
        s -= 1
    return s


@pytest.mark.parametrize("wl", [2, 4, 8, 12, 16, 24])
@pytest.mark.slow
def test_dynamic_scale_is_exact_on_the_boundary_maxima(wl):
    f32 = torch.float32
    for k in range(-100, 101):
        for side, limit in ((1.0, 2.0 ** (wl - 1) - 0.5), (-1.0, 2.0 ** (wl - 1) + 0.5)):
            edge = torch.tensor(side * limit * 2.0**-k, dtype=f32)  # exact in float32: wl + 1 significant bits
            for value in (edge, torch.nextafter(edge, torch.tensor(side * INF, dtype=f32)),
                          torch.nextafter(edge, torch.tensor(0.0, dtype=f32))):
                x = torch.stack([value, torch.tensor(0.25 * side)])
                hi, lo = x.max().item(), x.min().item()
                assert formats.dynamic_fixed_point(x, wl, "nearest")[1].item() == _exact_scale(hi, lo, wl), (wl, k, value.item())


@pytest.mark.slow
def test_dynamic_scale_reproducers():
    assert formats.dynamic_fixed_point(torch.tensor([32767.501953125]), 16, "nearest")[1].item() == -1  # one ulp above 32767.5
    out, s = formats.dynamic_fixed_point(torch.tensor([torch.finfo(torch.float32).max]), 24, "nearest")
    assert s.item() == -105 and torch.isfinite(out).all()
    assert out.item() == (2**23 - 1) * 2.0**105  # the top code of <24, -105>
    gen = torch.Generator().manual_seed(0)
    for wl in (3, 8, 16, 24):
        for _ in range(200):
            x = torch.randn(5, generator=gen) * 2.0 ** torch.randint(-60, 60, (1,), generator=gen).item()
            assert formats.dynamic_fixed_point(x, wl, "nearest")[1].item() == _exact_scale(x.max().item(), x.min().item(), wl)


@pytest.mark.parametrize("quantizer", ["fixed", "dynamic"])
def test_compact_codes_keep_nan(quantizer):
    from qtrain.quant.quantizers import DynamicFixedPoint, FixedPoint

    q = FixedPoint(8, 4, "nearest") if quantizer == "fixed" else DynamicFixedPoint(8, "nearest")
    q.train()
    out, saved = q.compact(torch.tensor([1.0, 0.5]))
    assert saved[0].dtype == torch.int8 and q.expand(saved, out.shape).tolist() == [1.0, 0.5]  # codes where they can
    out, saved = q.compact(torch.tensor([1.0, NAN]))
    back = q.expand(saved, out.shape)
    assert saved[0].dtype == torch.int8 and back[0].item() == 1.0 and math.isnan(back[1].item())


def test_saved_codes_mark_nan_without_waiting_on_the_device(device):
    from qtrain.quant.quantizers import FixedPoint

    def saved_and_back(q: FixedPoint, values: list[float]) -> tuple[tuple[torch.Tensor, ...], list[float]]:
        x = torch.tensor(values, device=device)
        _, warm = q.compact(x)  # a first call compiles the kernels, which may wait on the device
        q.expand(warm, x.shape)
        if device.type == "cuda":  # from here a read-back to the host, or a copy from it, raises
            torch.cuda.set_sync_debug_mode("error")
        try:
            out, saved = q.compact(x)
            back = q.expand(saved, out.shape)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        return saved, back.tolist()

    for bits, dtype in ((6, torch.int8), (12, torch.int16)):  # the lowest code is off the grid: exact
        lowest = -(2 ** (bits - 1))
        saved, back = saved_and_back(FixedPoint(bits, 0, "nearest").train(), [lowest - 5.0, NAN, 3.0, -0.0])
        assert saved_and_back(FixedPoint(bits, 0, "nearest").train(), [0.0, lowest, 1.0])[1] == [0.0, lowest, 1.0]
        assert saved[0].dtype == dtype
        assert back[0] == lowest and math.isnan(back[1]) and back[2:] == [3.0, 0.0]
    q = FixedPoint(8, 0, "nearest").train()  # at 8 bits the lowest code is also the grid's -128
    assert saved_and_back(q, [-300.0, 2.0])[1] == [-128.0, 2.0]  # without a NaN it is -128
    _, back = saved_and_back(q, [-300.0, 2.0, NAN])
    assert math.isnan(back[0]) and back[1] == 2.0 and math.isnan(back[2])  # with one, NaN (the loss is NaN then)


def test_range_linear_span_beyond_float32():
    x = torch.tensor([-2e38, 2e38, 3e36])
    out, lo, hi = formats.range_linear_from_data(x, 8, "tensor")
    assert torch.isfinite(out).all() and out[0].item() == lo.item() == x[0].item() and out[1].item() == x[1].item()
    step = (2e38 - -2e38) / 255  # float64: the grid's step
    code = round((x[2].item() - x[0].item()) / step)  # 129.4: no tie
    assert out[2].item() == pytest.approx(x[0].item() + code * step, abs=2.0**105)  # float32 rounding at 2^127
    _, _, _, compact = formats.range_linear_codes(x, 8, "tensor")
    assert torch.equal(formats.decode_codes(compact, x.shape), out)  # the codes backward keeps give it back
