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
MODES = [(r, f) for r in ("nearest", "stochastic") for f in (False, True)]


@pytest.fixture(params=MODES, ids=[f"{r}-{'fused' if f else 'eager'}" for r, f in MODES])
def mode(request):
    rounding_mode, fused = request.param
    rounding.set_fused(fused)
    return rounding_mode


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0), (2, 0, 4)])
def test_empty_tensors(name, shape, mode):
    x = torch.empty(shape)
    assert FORMATS[name][0](x, mode).shape == shape


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("value", [0.0, 1.0, -3.3, 1e4, 2.0**-140])
def test_constant_tensors_stay_constant(name, value, mode):
    x = torch.full((4, 6), value)
    out = FORMATS[name][0](x, mode)
    assert out.unique().numel() <= (1 if mode == "nearest" else 2)  # stochastic: the two grid neighbours
    if name.startswith("range"):
        assert torch.equal(out, x)  # a constant range maps to lo, which is the value
    if name.startswith("block"):  # the block's own maximum: wl - 1 significant bits, no flush to zero
        assert (out - value).abs().max() <= abs(value) * 2.0**-6


@pytest.mark.parametrize("name", [name for name in FORMATS if name != "range-codes"])  # codes hold no NaN
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
