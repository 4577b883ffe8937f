"""FP8 with per-tensor scaling, the OCP MX formats and NVFP4, against independent references.

Elements: E4M3 and E5M2 against torch's ``float8_e4m3fn``/``float8_e5m2`` casts; E3M2, E2M3 and E2M1 against
torchao's FP6/FP4 casts; INT8 against a float64 rounding. Blocks: MX against torchao's ``to_mx`` (FLOOR scale
mode, the spec's; RCEIL for the ceil scale rule) and against a float64 reference written here from the spec;
NVFP4 against torchao's ``NVFP4Tensor``. Each over every float32 exponent and rounding class or a wide spread of
magnitudes, and by hand at the block edges. torchao (a test dependency) is imported inside the tests that use it.
"""

import math

import pytest
import torch

from qtrain.quant import elements, fp8_scaling, microscaling
from qtrain.quant.elements import ELEMENTS, round_to_element
from qtrain.quant.fp8_scaling import AmaxHistory, current_scaled_fp8, fp8_scale, scaled_fp8
from qtrain.quant.microscaling import mx_quantize, nvfp4_quantize, random_hadamard

from .test_float_format import SPECIALS, _assert_same_bits, rounding_classes

INF, NAN = float("inf"), float("nan")
FP8_CASTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SMALL_FLOATS = {"e3m2": (3, 2), "e2m3": (2, 3), "e2m1": (2, 1)}  # (exponent bits, mantissa bits)
MX_FLOATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")


def _sweep(man: int) -> torch.Tensor:
    """Every float32 exponent and rounding class at ``man`` mantissa bits, every bfloat16 value (a dense grid that
    holds the element formats' subnormals and their ties), each bfloat16 value's float32 neighbours, and the specials."""
    bf16 = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    up, down = torch.nextafter(bf16, torch.tensor(INF)), torch.nextafter(bf16, torch.tensor(-INF))
    return torch.cat([rounding_classes(man), bf16, up, down, SPECIALS])


def _torchao_small_float(x: torch.Tensor, name: str) -> torch.Tensor:
    """torchao's FP6/FP4 cast and back (round half to even, saturating; it has no NaN, so NaN stays out)."""
    from torchao.prototype.custom_fp_utils import _f32_to_floatx_unpacked, _floatx_unpacked_to_f32

    exp, man = SMALL_FLOATS[name]
    return _floatx_unpacked_to_f32(_f32_to_floatx_unpacked(x, exp, man), exp, man)


# --- elements --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FP8_CASTS))
def test_fp8_elements_equal_torch_casts_on_every_rounding_class(name):
    x = _sweep(ELEMENTS[name].man)
    largest = ELEMENTS[name].max_normal
    ref = x.clamp(-largest, largest).to(FP8_CASTS[name]).float()  # torch's cast does not saturate: clamp first
    if name == "e5m2":
        ref = torch.where(x.isinf(), x, ref)  # E5M2 keeps infinities
    _assert_same_bits(round_to_element(x, name), ref)


@pytest.mark.parametrize("name", list(SMALL_FLOATS))
def test_small_float_elements_equal_torchao_casts_on_every_rounding_class(name):
    x = _sweep(ELEMENTS[name].man)
    ours = round_to_element(x, name)
    nan = x.isnan()
    _assert_same_bits(ours[~nan], _torchao_small_float(x[~nan], name))
    assert ours[nan].isnan().all()


def test_element_grids_by_hand():
    assert [ELEMENTS[n].max_normal for n in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")] == [448, 57344, 28, 7.5, 6]
    assert [ELEMENTS[n].bits for n in ELEMENTS] == [8, 8, 6, 6, 4, 8]
    x = torch.tensor([0.25, 0.3, 0.75, 1.25, 2.5, 3.5, 5.0, 5.5, 7.0, 1e30, -1e30, INF, -INF, -0.1])
    # E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to even: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    expected = [0.0, 0.5, 1.0, 1.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -6.0, 6.0, -6.0, -0.0]
    out = round_to_element(x, "e2m1")
    assert out.tolist() == expected and out[-1].signbit()
    # E4M3 has no inf: ±inf saturate; E5M2 keeps them; both saturate finite overflow
    assert round_to_element(torch.tensor([INF, -INF, 1e6, 464.0, 480.0]), "e4m3").tolist() == [448, -448, 448, 448, 448]
    assert round_to_element(torch.tensor([INF, -INF, 1e6, 61440.0]), "e5m2").tolist() == [INF, -INF, 57344, 57344]
    assert round_to_element(torch.tensor([NAN]), "e2m1").isnan().all()


def test_int8_element_equals_a_float64_rounding():
    torch.manual_seed(0)
    x = torch.cat([torch.randn(20000) * 2, torch.arange(-300, 300) / 128, torch.tensor([INF, -INF, 1e30, -2.0, 2.0])])
    ref = (torch.round(x.double() * 64).clamp(-127, 127) / 64).float()  # half to even; symmetric ±127/64
    assert torch.equal(round_to_element(x, "int8"), ref)
    assert round_to_element(torch.tensor([NAN]), elements.ELEMENTS["int8"]).isnan().all()


def test_bad_element_input():
    with pytest.raises(ValueError, match="not one of"):
        round_to_element(torch.zeros(2), "e9m9")
    with pytest.raises(TypeError, match="float32"):
        round_to_element(torch.zeros(2, dtype=torch.float64), "e4m3")


# --- stochastic rounding ---------------------------------------------------------------------------

DRAWS = 4000


def _check_unbiased(x: torch.Tensor, out: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """Each result one of its two neighbours ``lo``/``hi``; the mean over the draws within 4.5 sigma of ``x``."""
    out = out.view(DRAWS, -1)
    assert ((out == lo) | (out == hi)).all()
    p = torch.where(hi > lo, (x - lo) / (hi - lo), 0.0)  # an element on the grid never moves
    sigma = (hi - lo) * torch.sqrt(p * (1 - p) / DRAWS)
    assert ((out.double().mean(0) - x).abs() <= 4.5 * sigma + 1e-12).all()


def test_stochastic_element_rounding_is_unbiased():
    torch.manual_seed(1)
    x = torch.tensor([0.3, 1.2, 2.6, 3.9, 5.1, -0.7, 0.1])  # E2M1 neighbours below
    lo = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, -1.0, 0.0])
    hi = torch.tensor([0.5, 1.5, 3.0, 4.0, 6.0, -0.5, 0.5])
    _check_unbiased(x, round_to_element(x.repeat(DRAWS), "e2m1", "stochastic"), lo, hi)
    y = torch.tensor([449.0 / 2**8, 0.013])  # E4M3 neighbours: 1.75 and 1.875; subnormals 6/512 and 7/512
    _check_unbiased(y, round_to_element(y.repeat(DRAWS), "e4m3", "stochastic"),
                    torch.tensor([1.75, 6 / 512]), torch.tensor([1.875, 7 / 512]))


def test_stochastic_block_rounding_is_unbiased():
    torch.manual_seed(2)
    block = torch.tensor([4.0, 1.2, 2.6, -0.3])  # amax 4: MX scale 2^(2 - 2) = 1 for E2M1
    out = mx_quantize(block.repeat(DRAWS), "e2m1", 0, block=4, rounding="stochastic")
    _check_unbiased(block, out, torch.tensor([4.0, 1.0, 2.0, -0.5]), torch.tensor([4.0, 1.5, 3.0, 0.0]))
    # NVFP4: amax 2688 makes the tensor scale 1 and the block scale 448, so the elements step as E2M1 times 448
    x = torch.tensor([6.0, 1.2, 2.6, -0.3]) * 448
    out = nvfp4_quantize(x.repeat(DRAWS), 0, block=4, rounding="stochastic")
    _check_unbiased(x, out, torch.tensor([6.0, 1.0, 2.0, -0.5]) * 448, torch.tensor([6.0, 1.5, 3.0, 0.0]) * 448)


def test_same_key_same_draws():
    x = torch.randn(1000)
    key = torch.tensor(12345, dtype=torch.int32)
    assert torch.equal(mx_quantize(x, "e2m1", 0, rounding="stochastic", key=key),
                       mx_quantize(x, "e2m1", 0, rounding="stochastic", key=key))


# --- MX ----------------------------------------------------------------------------------------------

def _spread(shape: tuple[int, ...], dim: int, block: int, low: int = -100, high: int = 100, seed: int = 0) -> torch.Tensor:
    """Normal values whose magnitude changes by up to 2^±100 from block to block along ``dim``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    moved = x.movedim(dim, -1)
    exps = torch.randint(low, high, (*moved.shape[:-1], -(-moved.shape[-1] // block)), generator=gen).float()
    moved = moved * torch.exp2(exps).repeat_interleave(block, -1)[..., : moved.shape[-1]]
    return moved.movedim(-1, dim).contiguous()


def _torchao_mx(x: torch.Tensor, name: str, dim: int, block: int) -> torch.Tensor:
    """torchao's MX quantization (FLOOR scales) and dequantization, blocks along ``dim``."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e3m2": DTYPE_FP6_E3M2, "e2m3": DTYPE_FP6_E2M3,
             "e2m1": torch.float4_e2m1fn_x2}[name]
    moved = x.movedim(dim, -1).contiguous()
    scale, data = to_mx(moved, dtype, block, ScaleCalculationMode.FLOOR)
    return to_dtype(data, scale, dtype, block, torch.float32).movedim(-1, dim)


@pytest.mark.parametrize("name", MX_FLOATS)
@pytest.mark.parametrize("shape,dim", [((6, 128), -1), ((96, 5), 0), ((3, 64, 4), 1)])
def test_mx_equals_torchao(name, shape, dim):
    # torchao quantizes the bottom E8M0 scale 2^-127 as 2^-126 (and dequantizes as 2^-127): blocks stay above it
    x = _spread(shape, dim, 32, low=-100 + ELEMENTS[name].emax)
    x.view(-1)[::17] = -0.0
    _assert_same_bits(mx_quantize(x, name, dim), _torchao_mx(x, name, dim, 32))


def _round_float64(y: torch.Tensor, fmt: elements.ElementFormat) -> torch.Tensor:
    """``y`` (float64) on the element grid, half to even, clamped to ±max normal: from the format's definition."""
    e = torch.floor(torch.log2(y.abs().clamp_min(2.0**-1000))).clamp(fmt.emin, fmt.emax)
    step = torch.exp2(e - fmt.man)
    return (torch.round(y / step) * step).clamp(-fmt.max_normal, fmt.max_normal)


def _mx_reference(x: torch.Tensor, name: str, dim: int, block: int, ceil: bool = False) -> torch.Tensor:
    """The spec's MX conversion in float64, block by block: X = 2^(floor(log2 amax) - emax_elem) in [2^-127, 2^127];
    ``ceil``: X = 2^ceil(log2(amax * (1 / max_elem))), reciprocal and product in float32 (Transformer Engine's)."""
    fmt = ELEMENTS[name]
    moved = x.movedim(dim, -1).double()
    out = torch.empty_like(moved)
    for start in range(0, moved.shape[-1], block):
        v = moved[..., start:start + block]
        amax = v.abs().amax(-1, keepdim=True)
        if ceil:  # the product with float32's 1 / max, rounded to float32 (Transformer Engine's order)
            quotient = (amax.float() * torch.tensor(1 / fmt.max_normal, dtype=torch.float32)).double()
            exponent = torch.ceil(torch.log2(quotient.clamp_min(2.0**-1000)))
        else:
            exponent = torch.floor(torch.log2(amax.clamp_min(2.0**-1000))) - fmt.emax
        scale = torch.exp2(exponent.clamp(-127, 127))
        out[..., start:start + block] = _round_float64(v / scale, fmt) * scale
    return out.float().movedim(-1, dim)


@pytest.mark.parametrize("name", list(ELEMENTS))
@pytest.mark.parametrize("shape,dim,block", [((5, 70), 1, 32), ((40, 3), -2, 32), ((4, 50), -1, 16)])
def test_mx_equals_float64_reference_from_the_spec(name, shape, dim, block):
    # magnitudes down to float32's subnormals: blocks at the bottom E8M0 scale 2^-127 included
    x = _spread(shape, dim, block, low=-150, high=100, seed=3)
    _assert_same_bits(mx_quantize(x, name, dim, block), _mx_reference(x, name, dim, block))


@pytest.mark.parametrize("name", list(ELEMENTS))
@pytest.mark.parametrize("shape,dim,block", [((5, 70), 1, 32), ((40, 3), -2, 32)])
def test_mx_ceil_scales_equal_float64_reference(name, shape, dim, block):
    x = _spread(shape, dim, block, low=-150, high=100, seed=4)
    _assert_same_bits(mx_quantize(x, name, dim, block, scale_rule="ceil"), _mx_reference(x, name, dim, block, ceil=True))


@pytest.mark.parametrize("name", MX_FLOATS)
def test_mx_ceil_scale_of_the_reciprocal_product_is_the_quotients_for_float_elements(name):
    # Transformer Engine multiplies amax by float32's 1 / max, cuDNN's documentation divides: over a whole binade of
    # float32 amaxes (and so over every binade, the factors being powers of two) both round up to the same exponent
    from qtrain.quant.microscaling import _ceil_log2

    amax = (torch.arange(2**23, dtype=torch.int32) + (127 << 23)).view(torch.float32)  # every float32 in [1, 2)
    for shift in (0, 10, -20):
        scaled = amax * 2.0**shift
        product = scaled * torch.tensor(1 / ELEMENTS[name].max_normal, dtype=torch.float32)
        quotient = scaled / torch.tensor(ELEMENTS[name].max_normal, dtype=torch.float32)
        assert torch.equal(_ceil_log2(product), _ceil_log2(quotient))


@pytest.mark.parametrize("name", MX_FLOATS)
def test_mx_ceil_scales_equal_torchaos_rceil(name):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e3m2": DTYPE_FP6_E3M2, "e2m3": DTYPE_FP6_E2M3,
             "e2m1": torch.float4_e2m1fn_x2}[name]
    # blocks above the bottom E8M0 scale, where torchao 0.18's RCEIL quantizes with a reciprocal of 1 (flushing the
    # block to zero); random amaxes, where its float32 log2 cannot round a quotient just above a power of two down
    x = _spread((6, 128), -1, 32, low=-100, seed=5)
    scale, data = to_mx(x, dtype, 32, ScaleCalculationMode.RCEIL)
    _assert_same_bits(mx_quantize(x, name, -1, scale_rule="ceil"), to_dtype(data, scale, dtype, 32, torch.float32))


def test_mx_ceil_scale_by_hand():
    block = torch.tensor
    # E4M3 (max 448): amax 500 takes scale 2^floor(log2 500) - 8 = 1 and saturates; ceil(log2(500 / 448)) = 1 takes
    # 2^1: 500 / 2 = 250 rounds to 256 (steps of 16 in [128, 256)), back to 512, and 1.0 stays
    assert mx_quantize(block([1.0, 500.0]), "e4m3", 0).tolist() == [1.0, 448.0]
    assert mx_quantize(block([1.0, 500.0]), "e4m3", 0, scale_rule="ceil").tolist() == [1.0, 512.0]
    # amax exactly 448: both rules take scale 1; one ulp above it, ceil takes 2, and 448 + 2^-15 rounds back to 448
    for rule in ("floor", "ceil"):
        assert mx_quantize(block([448.0, 3.0]), "e4m3", 0, scale_rule=rule).tolist() == [448.0, 3.0]
    above = torch.nextafter(block(448.0), block(math.inf))
    assert mx_quantize(torch.stack([above, block(3.0)]), "e4m3", 0, scale_rule="ceil").tolist() == [448.0, 3.0]
    # zero, NaN and inf blocks as under the floor rule; a tiny block at the bottom scale 2^-127, as under floor
    assert mx_quantize(block([0.0, -0.0]), "e2m1", 0, scale_rule="ceil").tolist() == [0.0, -0.0]
    assert mx_quantize(block([1.0, NAN]), "e2m1", 0, scale_rule="ceil").isnan().all()
    assert mx_quantize(block([1.0, INF]), "e2m1", 0, scale_rule="ceil").isnan().all()
    tiny = block([2.0**-130, 3 * 2.0**-134, 2.0**-140])
    assert mx_quantize(tiny, "e4m3", 0, scale_rule="ceil").tolist() == [2.0**-130, 3 * 2.0**-134, 0.0]
    # just above a power of two: 7168 / 448 = 16, so amax 7168 + 2^-11 takes 2^5 (torchao 0.18's log2 says 2^4)
    assert mx_quantize(block([7168.0 + 2.0**-11, 0.03125]), "e4m3", 0, scale_rule="ceil").tolist() == [7168.0, 0.0]
    with pytest.raises(ValueError, match="scale rule 'up' is not one of"):
        mx_quantize(block([1.0]), "e4m3", 0, scale_rule="up")


def test_mx_block_edges_by_hand():
    block = torch.tensor
    # all-zero block; one huge element flushes the rest; a NaN or inf block; a partial last block of its own
    x = torch.cat([block([0.0] * 4), block([2.0**20, 1.0, -3.0, 1e3]), block([1.0, NAN, 2.0, 3.0]),
                   block([1.0, 2.0, INF, 3.0]), block([5.0, 0.7])])
    out = mx_quantize(x, "e2m1", 0, block=4)
    assert out[:4].tolist() == [0.0] * 4
    assert out[4:8].tolist() == [2.0**20, 0.0, -0.0, 0.0]  # scale 2^18: 1e3 / 2^18 rounds to 0
    assert out[8:16].isnan().all()
    assert out[16:].tolist() == [4.0, 0.5]  # amax 5: scale 2^(2 - 2); 5 ties to 4 (even), 0.7 -> 0.5
    # E4M3 subnormal elements under amax 448 (scale 1): 2^-9 stays, 2^-10 ties to 0, 3 * 2^-10 ties to 2^-8
    sub = mx_quantize(block([448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10]), "e4m3", 0)
    assert sub.tolist() == [448.0, 2.0**-9, 0.0, 2.0**-8]
    # the bottom of E8M0: a block of amax 2^-130 keeps scale 2^-127 and its elements on E4M3's grid there
    tiny = block([2.0**-130, 3 * 2.0**-134, 2.0**-140])
    assert mx_quantize(tiny, "e4m3", 0).tolist() == [2.0**-130, 3 * 2.0**-134, 0.0]
    # MXINT8: amax 1.5 -> scale 2^0, elements in steps of 2^-6
    assert mx_quantize(block([1.5, 0.01, -1.0]), "int8", 0).tolist() == [1.5, 1 / 64, -1.0]


def test_mx_shapes():
    assert mx_quantize(torch.zeros(0, 5), "e4m3", 0).shape == (0, 5)
    assert mx_quantize(torch.zeros(3, 0), "e4m3", -1).shape == (3, 0)
    assert mx_quantize(torch.full((7, 9), 3.0), "e2m1", 1).eq(3.0).all()  # a constant tensor
    x = torch.randn(64, 3)
    assert torch.equal(mx_quantize(x, "e3m2", 0), mx_quantize(x.T.contiguous(), "e3m2", 1).T)
    with pytest.raises(ValueError, match="not one of"):
        mx_quantize(x, "fp4", 0)


# --- NVFP4 ------------------------------------------------------------------------------------------

def _torchao_nvfp4(x: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    scale = per_tensor_amax_to_scale(x.abs().amax())
    return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(torch.float32)


@pytest.mark.parametrize("shape,low,high", [((16, 64), -8, 8), ((3, 4, 32), -30, 30), ((32, 128), -60, 40)])
def test_nvfp4_equals_torchao(shape, low, high):
    x = _spread(shape, -1, 16, low, high, seed=4)
    x.view(-1)[::13] = -0.0
    _assert_same_bits(nvfp4_quantize(x, -1), _torchao_nvfp4(x))
    if x.dim() == 2:  # along dim 0: torchao's blocks along the last dimension of the transposed tensor
        _assert_same_bits(nvfp4_quantize(x, 0), _torchao_nvfp4(x.movedim(0, -1).contiguous()).movedim(-1, 0))


def test_nvfp4_2d_tiles_equal_a_tile_reference_and_commute_with_transpose():
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    w = _spread((48, 32), -1, 16, -6, 6, seed=5) * _spread((48, 32), 0, 16, -6, 6, seed=6)
    out = nvfp4_quantize(w, -1, two_d=True)
    assert torch.equal(out, nvfp4_quantize(w.T.contiguous(), 0, two_d=True).T)
    # the reference: torchao's order of operations with each 16 x 16 tile's amax
    tensor_scale = w.abs().amax() / 2688.0
    tiles = w.reshape(3, 16, 2, 16)
    tile_amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    block_scale = (tile_amax / 6.0 / tensor_scale).clamp(2.0**-6, 448.0).to(torch.float8_e4m3fn).float()
    scaled = (tiles * ((1.0 / tensor_scale) / block_scale)).clamp(-6, 6)
    ref = f4_unpacked_to_f32(f32_to_f4_unpacked(scaled.contiguous())) * (tensor_scale * block_scale)
    _assert_same_bits(out, ref.reshape(48, 32))


def test_nvfp4_edges_by_hand():
    assert nvfp4_quantize(torch.zeros(4, 32), -1).eq(0).all()  # torchao divides by a zero tensor scale here
    x = torch.cat([torch.full((16,), 1.0), torch.tensor([NAN] + [1.0] * 15), torch.tensor([INF] + [2.0] * 15),
                   torch.tensor([3.0, 0.5])])
    out = nvfp4_quantize(x, 0)  # tensor amax 3 (over the finite values): ones come back as 0.964 (E4M3 block scale 144)
    assert torch.allclose(out[:16], torch.ones(16), rtol=0.05) and out[16:48].isnan().all() and not out[48:].isnan().any()
    assert nvfp4_quantize(torch.zeros(0, 16), -1).shape == (0, 16)
    # partial 2-D tiles at both edges
    w = torch.randn(20, 18)
    assert torch.equal(nvfp4_quantize(w, -1, two_d=True), nvfp4_quantize(w.T.contiguous(), -1, two_d=True).T)


# --- the random Hadamard transform ------------------------------------------------------------------

def test_random_hadamard_keeps_gemm_products_and_norms():
    torch.manual_seed(0)
    a, b = torch.randn(12, 80), torch.randn(80, 7)
    ha, hb = random_hadamard(a, 1), random_hadamard(b, 0)
    assert torch.allclose(ha @ hb, a @ b, atol=1e-4, rtol=1e-5)
    assert torch.allclose(ha.norm(dim=1), a.norm(dim=1), rtol=1e-5)
    assert not torch.allclose(ha, a)
    assert torch.equal(random_hadamard(a, 1), ha)  # deterministic
    assert not torch.equal(random_hadamard(a, 1, seed=1), ha)
    assert torch.equal(random_hadamard(a, -1, size=32), torch.cat([random_hadamard(a[:, :64], 1, size=32), a[:, 64:]], 1))
    q = random_hadamard(torch.eye(16), 1)  # rows of Q^T: an orthogonal matrix with entries ±1/4
    assert torch.allclose(q @ q.T, torch.eye(16), atol=1e-6) and torch.all(q.abs() == 0.25)


# --- FP8 per-tensor scaling -------------------------------------------------------------------------

def test_fp8_scale_by_hand():
    amax = torch.tensor([2.0, 0.0, NAN, INF, 1e-45, 448.0])
    assert fp8_scale(amax, "e4m3").tolist() == [224.0, 1.0, 1.0, 1.0, fp8_scaling.FLOAT32_MAX, 1.0]
    assert fp8_scale(torch.tensor(2.0), "e4m3", margin=1).item() == 112.0
    assert fp8_scale(torch.tensor(0.0), "e5m2", previous=torch.tensor(8.0)).item() == 8.0
    assert fp8_scale(torch.tensor(3.0), "e5m2").item() == torch.tensor(57344.0 / 3, dtype=torch.float32).item()


@pytest.mark.parametrize("name", list(FP8_CASTS))
def test_scaled_fp8_equals_torch_cast_of_the_scaled_tensor(name):
    torch.manual_seed(0)
    x = torch.cat([torch.randn(5000) * torch.exp2(torch.randint(-20, 20, (5000,)).float()), SPECIALS])
    largest = ELEMENTS[name].max_normal
    for scale in (torch.tensor(3.7), torch.tensor(2.0**-5), torch.tensor(1000.0)):
        scaled = x * scale
        ref = scaled.clamp(-largest, largest).to(FP8_CASTS[name]).float()
        if name == "e5m2":  # infinities stay; a finite x whose product overflows float32 saturates like the rest
            ref = torch.where(x.isinf(), scaled, ref)
        _assert_same_bits(scaled_fp8(x, name, scale), ref * (1 / scale))
    current = fp8_scale(x.abs().amax(), name)
    _assert_same_bits(current_scaled_fp8(x, name), scaled_fp8(x, name, current))
    finite = x[x.abs() < INF]
    amax_scale = fp8_scale(finite.abs().amax(), name, margin=2)
    _assert_same_bits(current_scaled_fp8(finite, name, margin=2), scaled_fp8(finite, name, amax_scale))
    assert current_scaled_fp8(torch.zeros(0), name).shape == (0,)


@pytest.mark.parametrize("name", MX_FLOATS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_finite_value_the_scale_takes_past_float32_saturates(name, rounding):
    # a step of near-zero amax leaves float32's largest scale (fp8_scale of 1e-45); the next step's normal values
    # overflow float32 when scaled, and must come out at the format's largest value like any finite overflow
    scale = fp8_scale(torch.tensor(1e-45), name)
    assert scale.item() == fp8_scaling.FLOAT32_MAX
    x = torch.tensor([3.0, -2.0, 1e30, -1.0, 0.0, -0.0])
    out = scaled_fp8(x, name, scale, rounding)
    largest = torch.tensor(ELEMENTS[name].max_normal) * torch.reciprocal(scale)
    assert out[:4].tolist() == [largest.item(), -largest.item(), largest.item(), -largest.item()]
    assert out[4:].tolist() == [0.0, 0.0] and out[5].signbit()
    specials = scaled_fp8(torch.tensor([INF, -INF, NAN]), name, scale, rounding)
    assert specials[2].isnan()
    if name == "e5m2":  # the one element format with infinities keeps them
        assert specials[:2].tolist() == [INF, -INF]


def _scales(history: AmaxHistory, amaxes: list[float]) -> list[float]:
    """The scale of each step (E4M3) when step i's tensor has amax ``amaxes[i]``: scale first, then record."""
    out = []
    for amax in amaxes:
        out.append(history.scale("e4m3").item())
        history.record(torch.tensor(amax))
    return out


def test_delayed_scaling_max_over_the_window():
    scales = _scales(AmaxHistory(3, "max"), [1.0, 4.0, 2.0, 0.5, 0.25, NAN, 0.125, 0.0, 0.0, 0.0, 0.0])
    # step 0: no amax yet -> 1; then 448 / max of the last three amaxes (NaN ignored); all zeros keep the last scale
    windows = [1.0, 4.0, 4.0, 4.0, 2.0, 0.5, 0.25, 0.125, 0.125]
    assert scales == [1.0] + [448.0 / w for w in windows] + [448.0 / 0.125]


def test_delayed_scaling_most_recent():
    scales = _scales(AmaxHistory(4, "most_recent"), [2.0, 8.0, NAN, 0.0, 1.0, INF, 4.0])
    assert scales == [1.0, 224.0, 56.0, 56.0, 56.0, 448.0, 448.0]


def test_delayed_scaling_resumes_exactly():
    amaxes = [3.0, 1.0, 7.0, 0.5, 2.0, 0.0, 9.0]
    whole = _scales(AmaxHistory(3, "max"), amaxes)
    first = AmaxHistory(3, "max")
    head = _scales(first, amaxes[:4])
    resumed = AmaxHistory(3, "max")
    resumed.load_state_dict(first.state_dict())
    assert head + _scales(resumed, amaxes[4:]) == whole
    with pytest.raises(RuntimeError, match="size mismatch for history"):
        AmaxHistory(2, "max").load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="not one of"):
        AmaxHistory(2, "mean")


def test_blocks_are_32_elements_long_for_mx_and_16_for_nvfp4_and_their_scales_8_bits():
    # one large element flushes the ones of its own block only: MX's 2^20 at scale 2^18, NVFP4's 64 at block
    # scale 448 (under the tensor scale 64 / 2688), where the next block's ones keep scale 7 and stay 1
    x = torch.ones(64)
    x[0] = 2.0**20
    out = mx_quantize(x, "e2m1", 0)
    assert (out[1:32] == 0).all() and (out[32:] == 1).all()
    x = torch.ones(32)
    x[0] = 64.0
    out = nvfp4_quantize(x, 0)
    assert (out[1:16] == 0).all() and (out[16:] == 1).all()
    # the cost meter's scale bits: E8M0 (MX) and E4M3 (NVFP4) are both 8-bit codes
    assert microscaling.SCALE_BITS == ELEMENTS["e4m3"].bits == 8
