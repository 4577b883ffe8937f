"""The scaled-format GEMMs (qtrain.quant.scaled_gemm) and the fp8 and mx methods: each GEMM quantizes its operands
along its own reduction dimension, checked against the three GEMMs written out with the format functions; a
per-tensor operand is quantized once a step; what the cost meter and the hardware models charge."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from qtrain.config.methods import check_method
from qtrain.cost import bitfusion
from qtrain.cost.hardware import price_layer
from qtrain.cost.profile import OperandSizes
from qtrain.errors import ConfigError
from qtrain.precision import Bits, LayerPrecision
from qtrain.quant.fp8_scaling import current_scaled_fp8
from qtrain.quant.layers import MatMul, swap_layers
from qtrain.quant.microscaling import mx_quantize, nvfp4_quantize
from qtrain.quant.scaled_gemm import ScaledOperands
from qtrain.quant.scaled_quantizers import BlockScaled, TensorScaledFP8

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


def test_bitfusion_multiplies_significands_and_moves_stored_bits():
    # E2M1 x E2M1: 3-bit significands, 2 x 2 MACs per fusion unit and cycle; the stored 4.25 bits cross DRAM
    layer = LayerPrecision(((1.0, Bits(4.25, 4.25, 4.25, 4.25)),), "mxfp4_e2m1", datapath=Bits(3, 3, 3, 3))
    macs, sizes = 10_000_000, OperandSizes(weight=1000, inputs=100, outputs=100)
    seconds, _ = price_layer(bitfusion.BitFusion(), layer, macs, sizes, samples=1)
    compute = 3 * macs / (64 * 2 * 2) / bitfusion.FREQUENCY_HZ  # three GEMMs, compute-bound at these sizes
    assert seconds == pytest.approx(compute)


def test_an_mx_run_record_charges_every_gemm_at_its_bits():
    method, model = prepared("mx", "method.weight=mxfp8_e4m3", "method.act=mxfp8_e4m3", "method.grad=mxfp8_e5m2")
    record = method.precision()
    assert record and all(layer.gemm_fractions == pytest.approx((8.25**2 / 1024,) * 3) for layer in record.values())
    assert {layer.datapath for layer in record.values()} == {Bits(5, 5, 4, 4)}  # E4M3 5-bit, E5M2 4-bit significands


def test_fp8_quantizes_every_layer_unless_told_to_keep_the_ends_in_float32():
    def quantized(*overrides: str) -> tuple[list[str], list[str]]:
        _, model = prepared("fp8", *overrides)
        layers = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
        return [n for n in layers if isinstance(getattr(model.get_submodule(n), "quant", None), ScaledOperands)], layers

    every, layers = quantized()
    assert every == layers
    ends, layers = quantized("method.first_layer=float32", "method.last_layer=float32")
    assert ends == layers[1:-1]


@pytest.mark.parametrize("overrides,message", [
    (["method.weight=mxfp5"], r"^method.weight='mxfp5' is not allowed \(choose from: mxfp8_e4m3, "),
    (["method.weight_blocks=2d"], r"^method.weight_blocks='2d' is not allowed: 2-D weight blocks are NVFP4's"),
    (["method.hadamard_wgrad=true"], r"^method.hadamard_wgrad=True is not allowed: the weight-gradient GEMM's "),
])
def test_bad_mx_values_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_method(make_config("method=mx", *overrides).method)


def test_bad_fp8_values_are_refused():
    with pytest.raises(ConfigError, match=r"^method.grad='e3m2' is not allowed \(choose from: e4m3, e5m2\)"):
        check_method(make_config("method=fp8", "method.grad=e3m2").method)
    with pytest.raises(ConfigError, match=r"^method.amax_history_len=0 is not allowed"):
        check_method(make_config("method=fp8", "method.amax_history_len=0").method)
