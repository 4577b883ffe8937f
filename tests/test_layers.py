"""Quantized layers and autograd primitives against torch's own float path."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from qtrain.quant import formats
from qtrain.quant.autograd import quantize_grad, quantize_ste
from qtrain.quant.layers import OperandQuantizers, QConv2d, QLinear, swap_layers
from qtrain.quant.quantizers import FixedPoint, Quantizer, RangeLinear


class Halve(Quantizer):
    """A deterministic stand-in quantizer whose effect is easy to see."""

    bits = 16

    def quantize(self, x):
        return x * 0.5


def test_quantize_ste_passes_gradient_straight_through():
    x = torch.randn(50, requires_grad=True)
    y = quantize_ste(x, lambda t: formats.fixed_point(t, 4, 1))
    assert torch.equal(y, formats.fixed_point(x.detach(), 4, 1))
    y.backward(torch.arange(50.0))
    assert torch.equal(x.grad, torch.arange(50.0))


def test_quantize_grad_is_identity_forward_and_quantizes_backward():
    x = torch.randn(50, requires_grad=True)
    y = quantize_grad(x, lambda g: formats.fixed_point(g, 8, 2))
    assert torch.equal(y, x)
    g = torch.randn(50)
    y.backward(g)
    assert torch.equal(x.grad, formats.fixed_point(g, 8, 2))


def _conv_and_input(device: str | torch.device = "cpu"):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, stride=2, padding=1, bias=True).to(device)
    return conv, torch.randn(4, 3, 9, 9).to(device).requires_grad_()


def _swap(model, quant):
    swap_layers(model, lambda name, layer: quant)
    return model


def test_unquantized_qconv_equals_torch_conv():
    conv, x = _conv_and_input()
    ref_out = conv(x)
    ref_out.sum().backward()
    ref = (ref_out.detach(), x.grad.clone(), conv.weight.grad.clone(), conv.bias.grad.clone())
    x.grad = None
    conv.zero_grad()
    model = _swap(nn.Sequential(conv), OperandQuantizers())
    assert isinstance(model[0], QConv2d) and model[0].weight is conv.weight
    out = model(x)
    out.sum().backward()
    for a, b in zip(ref, (out.detach(), x.grad, model[0].weight.grad, model[0].bias.grad)):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("quantize_act", [True, False])
def test_quantized_conv_forward_and_backward_match_hand_composition(quantize_act, device):
    conv, x = _conv_and_input(device)
    fp = lambda t: formats.fixed_point(t, 8, 4, "nearest")  # noqa: E731
    act = FixedPoint(8, 4, "nearest") if quantize_act else None
    quant = OperandQuantizers(weight=FixedPoint(8, 4, "nearest"), act=act, grad=Halve())
    model = _swap(nn.Sequential(conv), quant)
    out = model(x)
    g = torch.randn_like(out)
    out.backward(g)
    xq, wq = fp(x.detach()) if quantize_act else x.detach(), fp(conv.weight.detach())
    assert torch.allclose(out, F.conv2d(xq, wq, conv.bias, 2, 1), atol=1e-6)
    # backward: the error and weight GEMMs both see the quantized grad_output (here g / 2)
    gi = torch.nn.grad.conv2d_input(x.shape, wq, g * 0.5, stride=2, padding=1)
    gw = torch.nn.grad.conv2d_weight(xq, conv.weight.shape, g * 0.5, stride=2, padding=1)
    assert torch.allclose(x.grad, gi, atol=1e-5)
    assert torch.allclose(model[0].weight.grad, gw, atol=1e-5)
    assert torch.allclose(model[0].bias.grad, (g * 0.5).sum((0, 2, 3)), atol=1e-5)


@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_bifurcated_gradient_paths(kind, device):
    torch.manual_seed(1)
    if kind == "conv":
        layer, x = nn.Conv2d(3, 4, 3, padding=1), torch.randn(2, 3, 5, 5)
    else:
        layer, x = nn.Linear(6, 4), torch.randn(3, 2, 6)
    layer, x = layer.to(device), x.to(device).requires_grad_()
    err = lambda g: formats.fixed_point(g, 4, 1)  # noqa: E731 - coarse: visibly different from grad_weight's
    quant = OperandQuantizers(grad=FixedPoint(4, 1, "nearest"), grad_weight=FixedPoint(16, 10, "nearest"))
    model = _swap(nn.Sequential(layer), quant)
    out = model(x)
    g = torch.randn_like(out)
    out.backward(g)
    w = layer.weight.detach()
    gw_in, ge_in = formats.fixed_point(g, 16, 10), err(g)
    if kind == "conv":
        gi = torch.nn.grad.conv2d_input(x.shape, w, ge_in, padding=1)
        gw = torch.nn.grad.conv2d_weight(x.detach(), w.shape, gw_in, padding=1)
        gb = gw_in.sum((0, 2, 3))
    else:
        gi = ge_in @ w
        gw = gw_in.reshape(-1, 4).t() @ x.detach().reshape(-1, 6)
        gb = gw_in.reshape(-1, 4).sum(0)
    assert torch.allclose(x.grad, gi, atol=1e-5)
    assert torch.allclose(model[0].weight.grad, gw, atol=1e-5)
    assert torch.allclose(model[0].bias.grad, gb, atol=1e-5)


def test_swap_layers_replaces_only_selected_layers_and_shares_parameters():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2, 3), nn.Linear(3, 1))
    params = list(model.parameters())
    swapped = swap_layers(model, lambda name, layer: None if name == "4" else OperandQuantizers())
    assert swapped == ["0", "3"]
    assert isinstance(model[0], QConv2d) and isinstance(model[3], QLinear) and type(model[4]) is nn.Linear
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert model(torch.randn(2, 1, 3, 3)).shape == (2, 1)


def test_quantized_activation_is_saved_as_one_byte_codes(device):
    conv, x = _conv_and_input(device)
    model = _swap(nn.Sequential(conv), OperandQuantizers(act=RangeLinear(8, "tensor", "nearest"))).to(device)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(x)
    assert any(t.dtype == torch.uint8 and t.numel() == x.numel() for t in saved)
    assert not any(t.dtype == torch.float32 and t.numel() == x.numel() for t in saved)
    g = torch.randn_like(out)
    out.backward(g)
    lo, hi = formats.tensor_range(x.detach(), "tensor")
    xq = formats.range_linear(x.detach(), 8, lo, hi)
    assert torch.allclose(out, F.conv2d(xq, conv.weight, conv.bias, 2, 1), atol=1e-6)
    gw = torch.nn.grad.conv2d_weight(xq, conv.weight.shape, g, stride=2, padding=1)
    assert torch.allclose(model[0].weight.grad, gw, atol=1e-5)
