"""The fused (torch.compile) kernels against the eager ones and torch's casts, bit for bit: every format, the
64-bit index path of the hashed uniform, and whole training runs of every quantizing method.

Each test compiles kernels (about 35 s on a cold compile cache), so the whole file is in the slow tier.
"""

import warnings

import pandas as pd
import pytest
import torch

from qtrain.quant import elements, formats, fp8_scaling, microscaling, quantizers, rounding
from qtrain.run import run

from .conftest import TINY, make_config
from .test_float_format import CASTS, SPECIALS, _assert_same_bits, rounding_classes
from .test_rounding import N, _key
from .test_run import _metrics

pytestmark = pytest.mark.slow


def test_fused_64_bit_index_path_matches_eager():
    index = torch.arange(N, dtype=torch.int64) + (1 << 40) - (1 << 19)
    key = _key()
    eager = rounding.uniform_at(index, key)
    rounding.set_fused(True)
    assert torch.equal(rounding.fused(rounding.uniform_at)(index, key), eager)


# --- every format: the fused kernels give the eager results bit for bit ---------------------------

def _edge_data() -> torch.Tensor:
    torch.manual_seed(5)
    x = torch.randn(6, 5, 7, 3) * torch.exp2(torch.randint(-140, 120, (6, 1, 1, 1)).float())
    x[1] = 7.25  # a constant row
    x[2, 0, :3, 0] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x[3, 1, :3, 1] = torch.tensor([0.0, -0.0, 2.0**-149])
    return x


FORMAT_CALLS = {
    "fixed": lambda x, r: formats.fixed_point(x, 8, 4, r),
    "fixed-noclamp": lambda x, r: formats.fixed_point(x, 16, 10, r, symmetric=True, clamp=False),
    "fixed-mask": lambda x, r: formats.fixed_point_with_mask(x, 6, 2, r),
    "range": lambda x, r: formats.range_linear(x, 8, torch.full((1, 1), -2.0, device=x.device),
                                               torch.full((1, 1), 3.0, device=x.device), r),
    "range-tensor": lambda x, r: formats.range_linear_from_data(x, 8, "tensor", r),
    "range-channel": lambda x, r: formats.range_linear_from_data(x, 4, "channel", r),
    "range-codes": lambda x, r: formats.range_linear_codes(x, 8, "sample_mean", r),
    "decode": lambda x, r: formats.decode_codes(formats.range_linear_codes(x, 12, "channel", r)[3], x.shape),
    # 10,080 elements (32 lanes), in rows of 1,680 (16 lanes): the draws taken in lanes
    "fixed-lanes": lambda x, r: formats.fixed_point(x.repeat(16, 1, 1, 1), 8, 4, r),
    "fixed-candidates": lambda x, r: formats.fixed_point_candidates(
        x.repeat(16, 1, 1, 1), torch.tensor([8, 12], device=x.device), torch.tensor([4, 6], device=x.device), r),
    "range-lanes": lambda x, r: formats.range_linear_from_data(x.repeat(1, 16, 1, 1), 4, "channel", r),
    "range-codes-lanes": lambda x, r: formats.range_linear_codes(x.repeat(1, 16, 1, 1), 8, "sample_mean", r),
    "range-per-sample-lanes": lambda x, r: formats.range_linear_codes(
        x.repeat(1, 16, 1, 1), torch.arange(2, 8, device=x.device), "tensor", r, max_bits=8),
    "range-two-widths": lambda x, r: formats.range_linear_two_widths(x.repeat(16, 1, 1, 1), 8, 16, "tensor", r),
    "fixed-codes": lambda x, r: _fixed_codes_round_trip(formats.fixed_point(x, 8, 4, r)),
    "dynamic": lambda x, r: formats.dynamic_fixed_point(x, 8, r),
    "dynamic-codes-lanes": lambda x, r: formats.dynamic_fixed_point(x.repeat(16, 1, 1, 1), 16, r, torch.int16),
    "block": lambda x, r: formats.block_floating_point(x, 8, r),
    "block-tiles": lambda x, r: formats.block_floating_point(x, 6, r, block=4, dims=(1, 2)),
    "block-dim": lambda x, r: formats.block_floating_point(x, 10, r, dim=2),
    "tile-square-sums": lambda x, r: formats.tile_square_sums(x, 4),
    "float-e5m10": lambda x, r: formats.floating_point(x, 5, 10, r),
    "float-e4m3-sat": lambda x, r: formats.floating_point(x, 4, 3, r, saturate=True),
    "float-e8m23": lambda x, r: formats.floating_point(x, 8, 23, r),
    "element-e4m3": lambda x, r: elements.round_to_element(x, "e4m3", r),
    "element-int8": lambda x, r: elements.round_to_element(x, "int8", r),
    "fp8-current": lambda x, r: fp8_scaling.current_scaled_fp8(x, "e5m2", 1, r),
    "fp8-scaled": lambda x, r: fp8_scaling.scaled_fp8(x, "e4m3", torch.tensor(3.5, device=x.device), r),
    "mx-e2m1": lambda x, r: microscaling.mx_quantize(x, "e2m1", -1, rounding=r),
    "mx-int8-dim": lambda x, r: microscaling.mx_quantize(x, "int8", 1, block=4, rounding=r),
    "mx-e4m3-ceil": lambda x, r: microscaling.mx_quantize(x, "e4m3", -1, rounding=r, scale_rule="ceil"),
    "mx-e3m2-ceil-dim": lambda x, r: microscaling.mx_quantize(x, "e3m2", 1, block=4, rounding=r, scale_rule="ceil"),
    "nvfp4": lambda x, r: microscaling.nvfp4_quantize(x, 2, rounding=r),
    "nvfp4-2d": lambda x, r: microscaling.nvfp4_quantize(x, -1, block=4, rounding=r, two_d=True),
}


def _fixed_codes_round_trip(out: torch.Tensor) -> tuple:
    saved = quantizers.fixed_codes(out, torch.tensor(4, device=out.device), 8)
    return saved, quantizers.expand_codes(saved)


def _flat(result) -> list[torch.Tensor]:
    parts = result if isinstance(result, tuple) else (result,)
    out = []
    for part in parts:
        out.extend(_flat(part) if isinstance(part, tuple) else [part])
    return out


@pytest.mark.parametrize("name", FORMAT_CALLS)
@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
def test_fused_kernels_match_eager_bit_for_bit(name, mode, device):
    x = _edge_data().to(device)
    results = []
    for fused in (False, True):
        rounding.set_fused(fused)
        torch.manual_seed(7)
        with warnings.catch_warnings():
            # a compile failure falls back to eager with this warning (other warnings of a first compile pass)
            warnings.filterwarnings("error", message="torch.compile failed")
            results.append(_flat(FORMAT_CALLS[name](x, mode)))
    for eager, fused in zip(*results):
        assert eager.dtype == fused.dtype and eager.shape == fused.shape
        if eager.dtype == torch.float32:  # bit for bit, but any NaN equals any NaN (payloads carry nothing)
            nan = eager.isnan()
            assert torch.equal(nan, fused.isnan())
            eager, fused = eager.view(torch.int32)[~nan], fused.view(torch.int32)[~nan]
        assert torch.equal(eager, fused)


@pytest.mark.parametrize("exp,man", list(CASTS))
def test_fused_kernel_equals_torch_cast(exp, man):
    x = torch.cat([rounding_classes(man, seed=1)[::7], SPECIALS])
    rounding.set_fused(True)
    _assert_same_bits(formats.floating_point(x, exp, man), x.to(CASTS[exp, man]).float())


@pytest.mark.parametrize("method", ["sbm", "pfq", "dfq", "fractrain", "muppet", "adapt", "dynasty", "fp8", "mx"])
def test_fused_and_eager_quantizers_train_to_the_same_bits(tmp_path, method):
    # fused stays part of a run's identity (another kernel, another run); its results must not differ
    overrides = [*TINY, f"method={method}", "train.epochs=1"]
    run(make_config(*overrides, "fused=true"), tmp_path / "fused")
    run(make_config(*overrides), tmp_path / "eager")
    pd.testing.assert_frame_equal(_metrics(tmp_path / "fused"), _metrics(tmp_path / "eager"), check_exact=True)
    fused, eager = (torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)["model"] for name in ("fused", "eager"))
    assert fused.keys() == eager.keys() and all(torch.equal(fused[k], eager[k]) for k in fused)
