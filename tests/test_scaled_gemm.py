"""The scaled-format GEMMs (qtrain.quant.scaled_gemm) and the fp8 and mx methods: each GEMM quantizes its operands
along its own reduction dimension, checked against the three GEMMs written out with the format functions; a
per-tensor operand is quantized once a step; what the cost meter and the hardware models charge."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from qtrain.config.methods import check_method
from qtrain.cost import bit_serial, bitfusion
from qtrain.cost.hardware import price_layer
from qtrain.cost.profile import OperandSizes
from qtrain.errors import ConfigError
from qtrain.methods import build_method
from qtrain.precision import Bits, LayerPrecision
from qtrain.quant.fp8_scaling import current_scaled_fp8
from qtrain.quant.layers import MatMul, swap_layers
from qtrain.quant.microscaling import mx_quantize, nvfp4_quantize
from qtrain.quant.scaled_gemm import ScaledOperands
from qtrain.quant.scaled_quantizers import Bfloat16, BlockScaled, TensorScaledFP8

from .conftest import make_config, prepared


def _mx(fmt: str) -> ScaledOperands:
    return ScaledOperands(BlockScaled(fmt), BlockScaled(fmt), BlockScaled(fmt))


def _swapped(layer: nn.Module, operands: ScaledOperands) -> nn.Module:
    model = nn.Sequential(layer)
    swap_layers(model, lambda name, module: operands, matmuls=True)
    return model[0]


def _grads(module: nn.Module, *inputs: torch.Tensor, grad: torch.Tensor) -> tuple:
    inputs = [x.clone().requires_grad_() for x in inputs]
    out = module(*inputs)
    out.backward(grad)
    return (out, *(x.grad for x in inputs))


def test_a_linear_layer_blocks_each_gemm_along_its_reduction_dimension():
    torch.manual_seed(0)
    layer = _swapped(nn.Linear(64, 96), _mx("mxfp4_e2m1"))
    x, g = torch.randn(2, 48, 64), torch.randn(2, 48, 96)
    out, gx = _grads(layer, x, grad=g)
    w, q = layer.weight.detach(), lambda t, d: mx_quantize(t, "e2m1", d)
    torch.testing.assert_close(out, F.linear(q(x, -1), q(w, 1), layer.bias), rtol=0, atol=0)
    torch.testing.assert_close(gx, q(g, -1) @ q(w, 0), rtol=0, atol=0)
    rows_x, rows_g = x.reshape(-1, 64), g.reshape(-1, 96)
    torch.testing.assert_close(layer.weight.grad, q(rows_g, 0).t() @ q(rows_x, 0), rtol=0, atol=0)
    torch.testing.assert_close(layer.bias.grad, rows_g.sum(0))  # from the float32 gradient


def test_a_convolution_blocks_each_gemm_along_its_reduction_dimension():
    torch.manual_seed(1)
    conv = nn.Conv2d(40, 36, 3, padding=1, bias=False)
    layer = _swapped(conv, _mx("mxfp8_e4m3"))
    x = torch.randn(34, 40, 5, 5)
    g = torch.randn(34, 36, 5, 5)
    out, gx = _grads(layer, x, grad=g)
    w, q = layer.weight.detach(), lambda t, d: mx_quantize(t, "e4m3", d)
    torch.testing.assert_close(out, F.conv2d(q(x, 1), q(w, 1), padding=1), rtol=0, atol=0)
    ref_x = torch.nn.grad.conv2d_input(x.shape, q(w, 0), q(g, 1), padding=1)
    torch.testing.assert_close(gx, ref_x, rtol=1e-6, atol=1e-6)
    ref_w = torch.nn.grad.conv2d_weight(q(x, 0), w.shape, q(g, 0), padding=1)
    torch.testing.assert_close(layer.weight.grad, ref_w, rtol=1e-6, atol=1e-6)


def test_a_matmul_blocks_each_gemm_along_its_reduction_dimension():
    torch.manual_seed(2)
    layer = _swapped(MatMul(), _mx("mxfp6_e3m2"))
    a, b, g = torch.randn(3, 40, 36), torch.randn(3, 36, 33), torch.randn(3, 40, 33)
    out, ga, gb = _grads(layer, a, b, grad=g)
    q = lambda t, d: mx_quantize(t, "e3m2", d)  # noqa: E731
    torch.testing.assert_close(out, q(a, -1) @ q(b, -2), rtol=0, atol=0)
    torch.testing.assert_close(ga, q(g, -1) @ q(b, -1).transpose(-2, -1), rtol=0, atol=0)
    torch.testing.assert_close(gb, q(a, -2).transpose(-2, -1) @ q(g, -2), rtol=0, atol=0)


def test_nvfp4_weights_in_2d_blocks_are_one_tensor_in_both_gemms():
    torch.manual_seed(3)
    weight = BlockScaled("nvfp4", two_d=True)
    layer = _swapped(nn.Linear(32, 48, bias=False), ScaledOperands(weight, None, None))
    x, g = torch.randn(4, 32), torch.randn(4, 48)
    out, gx = _grads(layer, x, grad=g)
    wq = nvfp4_quantize(layer.weight.detach(), 1, two_d=True)
    torch.testing.assert_close(out, x @ wq.t(), rtol=0, atol=0)
    torch.testing.assert_close(gx, g @ wq, rtol=0, atol=0)
    torch.testing.assert_close(wq, nvfp4_quantize(layer.weight.detach(), 0, two_d=True), rtol=0, atol=0)


def test_with_float32_operands_the_gemms_are_float32s_bit_for_bit():
    torch.manual_seed(4)
    conv = nn.Conv2d(3, 5, 3, padding=1)
    reference = nn.Conv2d(3, 5, 3, padding=1)
    reference.load_state_dict(conv.state_dict())
    layer = _swapped(conv, ScaledOperands(None, None, None))
    x, g = torch.randn(2, 3, 6, 6), torch.randn(2, 5, 6, 6)
    for got, want in zip(_grads(layer, x, grad=g), _grads(reference, x, grad=g)):
        assert torch.equal(got, want)
    assert torch.equal(layer.weight.grad, reference.weight.grad) and torch.equal(layer.bias.grad, reference.bias.grad)


def test_a_per_tensor_fp8_operand_is_quantized_once_a_step():
    torch.manual_seed(5)
    fp8 = {name: TensorScaledFP8(element, "delayed", history=4) for name, element in
           (("weight", "e4m3"), ("act", "e4m3"), ("grad", "e5m2"))}
    layer = _swapped(nn.Linear(8, 6, bias=False), ScaledOperands(fp8["weight"], fp8["act"], fp8["grad"]))
    x, g = torch.randn(5, 8), torch.randn(5, 6)
    out, gx = _grads(layer, x, grad=g)
    for name, seen in (("weight", layer.weight.detach()), ("act", x), ("grad", g)):
        history = fp8[name].history.state_dict()
        recorded = [t for t in history.values() if t.numel() == 4][0]
        assert torch.count_nonzero(recorded) == 1 and recorded.max() == seen.abs().amax(), name
    # the first step's scale is 1 (no history yet): x and w each rounded once onto E4M3 at scale 1
    e4m3 = lambda t: t.to(torch.float8_e4m3fn).float()  # noqa: E731
    torch.testing.assert_close(out, e4m3(x) @ e4m3(layer.weight.detach()).t(), rtol=0, atol=0)
    torch.testing.assert_close(gx, g.to(torch.float8_e5m2).float() @ e4m3(layer.weight.detach()), rtol=0, atol=0)


def test_current_scaling_uses_the_tensor_itself():
    torch.manual_seed(6)
    layer = _swapped(nn.Linear(8, 6, bias=False),
                     ScaledOperands(TensorScaledFP8("e4m3", "current"), TensorScaledFP8("e4m3", "current"), None))
    x = torch.randn(5, 8) * 1000
    out = layer(x)
    w = layer.weight.detach()
    torch.testing.assert_close(out, current_scaled_fp8(x, "e4m3") @ current_scaled_fp8(w, "e4m3").t(), rtol=0, atol=0)


@pytest.mark.parametrize("fmt,bits", [("mxfp8_e4m3", 8.25), ("mxfp6_e2m3", 6.25), ("mxfp4_e2m1", 4.25),
                                      ("mxint8", 8.25)])
def test_mx_operands_are_charged_element_and_amortized_scale_bits(fmt, bits):
    assert BlockScaled(fmt).bits == bits
    assert _mx(fmt).bits() == Bits(bits, bits, bits, bits)


def test_nvfp4_and_fp8_amortize_their_tensor_scale_over_the_tensor():
    nvfp4, fp8 = BlockScaled("nvfp4"), TensorScaledFP8("e4m3", "current")
    x = torch.randn(4, 64)
    nvfp4(x, -1)
    fp8(x, -1)
    assert nvfp4.bits == 4 + 8 / 16 + 32 / 256
    assert fp8.bits == 8 + 32 / 256
    tiles = BlockScaled("nvfp4", two_d=True)
    tiles(x, -1)
    assert tiles.bits == nvfp4.bits  # a 16 x 16 tile stores its scale once per 16 elements all the same


def test_bitfusion_multiplies_mxint8_elements_and_moves_stored_bits():
    # MXINT8: 8-bit integers multiplied (one MAC per fusion unit and cycle), 8.25 stored bits cross DRAM
    layer = LayerPrecision(((1.0, Bits(8.25, 8.25, 8.25, 8.25)),), "mxint8", datapath=Bits(8, 8, 8, 8))
    macs = 10_000_000
    compute_bound = OperandSizes(weight=1000, inputs=100, outputs=100)
    seconds, _ = price_layer(bitfusion.BitFusion(), layer, macs, compute_bound, samples=1)
    assert seconds == pytest.approx(3 * macs / 64 / bitfusion.FREQUENCY_HZ)  # three GEMMs at 64 MACs a cycle
    memory_bound = OperandSizes(weight=1_000_000, inputs=1_000_000, outputs=1_000_000)
    seconds, _ = price_layer(bitfusion.BitFusion(), layer, 1000, memory_bound, samples=1)
    dram_bits = 3 * (2 * 1_000_000 * 8.25 + 1_000_000 * bitfusion.OUTPUT_BITS)  # each GEMM: two operands in, one out
    assert seconds == pytest.approx(dram_bits / bitfusion.DRAM_BITS_PER_CYCLE / bitfusion.FREQUENCY_HZ)


@pytest.mark.parametrize("model", [bitfusion.BitFusion(), bit_serial.BitSerial()], ids=lambda m: m.name)
def test_the_hardware_models_leave_float_elements_unpriced(model):
    sizes = OperandSizes(weight=1000, inputs=100, outputs=100)
    for fmt, element in (("mxfp4_e2m1", "e2m1"), ("fp8_e4m3", "e4m3")):
        quantizer = BlockScaled(fmt) if fmt.startswith("mx") else TensorScaledFP8(element, "current")
        assert math.isnan(quantizer.datapath_bits())
        datapath = ScaledOperands(quantizer, quantizer, quantizer).datapath()
        layer = LayerPrecision(((1.0, Bits(8, 8, 8, 8)),), fmt, datapath=datapath)
        assert all(math.isnan(figure) for figure in price_layer(model, layer, 10_000, sizes, samples=2))
    integer = LayerPrecision(((1.0, Bits(8.25, 8.25, 8.25, 8.25)),), "mxint8", datapath=Bits(8, 8, 8, 8))
    assert all(figure > 0 for figure in price_layer(model, integer, 10_000, sizes, samples=2))


def test_an_mx_run_record_charges_every_gemm_at_its_bits():
    method, model = prepared("mx", "method.weight=mxfp8_e4m3", "method.act=mxfp8_e4m3", "method.grad=mxfp8_e5m2")
    record = method.precision()
    assert record and all(layer.gemm_fractions == pytest.approx((8.25**2 / 1024,) * 3) for layer in record.values())
    assert all(math.isnan(b) for layer in record.values() for gemm in layer.datapath.gemm_operands() for b in gemm)
    integers, _ = prepared("mx", "method.weight=mxint8", "method.act=mxint8", "method.grad=mxint8")
    assert {layer.datapath for layer in integers.precision().values()} == {Bits(8, 8, 8, 8)}


def test_fp8_quantizes_every_layer_unless_told_to_keep_the_ends_in_float32():
    def quantized(*overrides: str) -> tuple[list[str], list[str]]:
        _, model = prepared("fp8", *overrides)
        layers = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
        return [n for n in layers if isinstance(getattr(model.get_submodule(n), "quant", None), ScaledOperands)], layers

    every, layers = quantized()
    assert every == layers
    ends, layers = quantized("method.first_layer=float32", "method.last_layer=float32")
    assert ends == layers[1:-1]


@pytest.mark.parametrize("method", ["fp8", "mx"])
def test_the_ends_and_matmuls_stay_in_bfloat16_or_float32_as_told(method):
    from qtrain.models import build_model

    built = build_method(make_config(f"method={method}", "method.first_layer=bf16", "method.last_layer=float32",
                                     "method.matmuls=bf16").method)
    model = built.prepare(build_model("transformer", {"preset": "tiny"}, vocab_size=50))
    quant = {n: getattr(m, "quant", None) for n, m in model.named_modules() if isinstance(m, (nn.Linear, MatMul))}
    matmuls = [n for n, m in model.named_modules() if isinstance(m, MatMul)]
    linears = [n for n in quant if n not in matmuls]
    assert matmuls and all(quant[n].fmt() == "bf16" for n in matmuls)
    assert quant[linears[0]].fmt() == "bf16" and quant[linears[-1]] is None  # float32: not swapped
    assert all(isinstance(quant[n].act, TensorScaledFP8 if method == "fp8" else BlockScaled) for n in linears[1:-1])
    record = built.precision()
    assert record[linears[0]].gemm_fractions == (16 * 16 / 1024,) * 3 and linears[-1] not in record


def test_bfloat16_operands_round_half_to_even_saturate_to_inf_and_keep_specials():
    x = torch.tensor([1 + 2.0**-8,  # halfway between 1 and 1 + 2^-7: to the even 1
                      1 + 3 * 2.0**-8,  # halfway between 1 + 2^-7 and 1 + 2^-6: to the even 1 + 2^-6
                      -(1 + 2.0**-8), torch.finfo(torch.float32).max,  # past bfloat16's largest and the halfway: inf
                      2.0**-133, 2.0**-134,  # bfloat16's smallest subnormal; half of it, a tie: to 0
                      float("inf"), float("nan")])
    expected = torch.tensor([1.0, 1 + 2.0**-6, -1.0, float("inf"), 2.0**-133, 0.0, float("inf"), float("nan")])
    torch.testing.assert_close(Bfloat16()(x, -1), expected, rtol=0, atol=0, equal_nan=True)
    assert Bfloat16().bits == 16 and math.isnan(Bfloat16().datapath_bits())


@pytest.mark.parametrize("overrides,message", [
    (["method.weight=mxfp5"], r"^method.weight='mxfp5' is not allowed \(choose from: mxfp8_e4m3, "),
    (["method.weight_blocks=2d"], r"^method.weight_blocks='2d' is not allowed: 2-D weight blocks are NVFP4's"),
    (["method.hadamard_wgrad=true"], r"^method.hadamard_wgrad=True is not allowed: the weight-gradient GEMM's "),
    (["method.matmuls=fp16"], r"^method.matmuls='fp16' is not allowed \(choose from: quantized, bf16, float32\)"),
    (["method.first_layer=half"], r"^method.first_layer='half' is not allowed \(choose from: quantized, bf16, float32\)"),
])
def test_bad_mx_values_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_method(make_config("method=mx", *overrides).method)


def test_bad_fp8_values_are_refused():
    with pytest.raises(ConfigError, match=r"^method.grad='e3m2' is not allowed \(choose from: e4m3, e5m2\)"):
        check_method(make_config("method=fp8", "method.grad=e3m2").method)
    with pytest.raises(ConfigError, match=r"^method.amax_history_len=0 is not allowed"):
        check_method(make_config("method=fp8", "method.amax_history_len=0").method)
