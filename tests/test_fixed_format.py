"""Fixed point without saturation and the clamped-gradient straight-through estimator, against QPyTorch.

QPyTorch's fixed point rounds half to even like ours (``nearbyint``), but it first adds and subtracts
0.5 in float32, which can move a value onto a tie; comparisons stay off ties. Its
``quantizer(..., clamping_grad_zero=True)`` zeroes the gradient where the rounded value fell outside
[min, max] (and applies the mask only when a backward number is given: the tests give one that
leaves their gradients exact).
"""

import pytest
import qtorch
import torch
from qtorch.quant import fixed_point_quantize, quantizer
from torch import nn
from torch.nn import functional as F

from qtrain.quant import formats
from qtrain.quant.autograd import quantize_ste
from qtrain.quant.layers import OperandQuantizers, swap_layers
from qtrain.quant.quantizers import FixedPoint

INF, NAN = float("inf"), float("nan")


def _wide(n: int = 8192, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(n) * torch.exp2(torch.randint(-6, 10, (n,)).float())  # |x * 2^10| below 2^22


def _off_ties(x: torch.Tensor, fl: int) -> torch.Tensor:
    r = x.double() * 2.0**fl
    return ((r - torch.floor(r)) - 0.5).abs() > 1e-3


@pytest.mark.parametrize("wl,fl", [(8, 4), (4, 2), (16, 10), (6, 1)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_without_clamp_values_beyond_the_range_are_rounded_not_clamped(wl, fl, symmetric):
    x = _wide()
    keep = _off_ties(x, fl)
    ours = formats.fixed_point(x, wl, fl, symmetric=symmetric, clamp=False)
    ref = fixed_point_quantize(x, wl, fl, clamp=False, symmetric=symmetric, rounding="nearest")
    assert torch.equal(ours[keep], ref[keep])
    top = 2.0 ** (wl - fl - 1)
    assert (ours.abs() > top).any()  # the range does not bind
    lowest = -top + 2.0**-fl if symmetric else -top
    clamped = formats.fixed_point(x, wl, fl, symmetric=symmetric)
    assert torch.equal(clamped[keep], ours.clamp(lowest, top - 2.0**-fl)[keep])


def test_without_clamp_stochastic_stays_on_the_grid_and_inf_stays_inf():
    x = torch.tensor([1000.3, -1000.3, INF, -INF, NAN])
    torch.manual_seed(0)
    out = formats.fixed_point(x.repeat(4096), 8, 4, "stochastic", clamp=False).view(4096, -1)
    assert torch.all((out[:, 0] == 1000.25) | (out[:, 0] == 1000.3125))
    assert abs(out[:, 0].double().mean().item() - 1000.3) < 4 * 0.0625 * 0.5 / 64
    assert torch.all(out[:, 2] == INF) and torch.all(out[:, 3] == -INF) and torch.all(out[:, 4].isnan())
    assert FixedPoint(8, 4, "nearest", clamp=False)(x[:2]).tolist() == [1000.3125, -1000.3125]


def test_without_clamp_huge_values_stay_put():
    # beyond 2^23 steps every float32 lies on the grid; x * 2^8 overflows float32 for 3e38
    x = torch.tensor([3e38, -3e38, 2.0**100 + 2.0**77, 2.0**20 + 0.5])
    for rounding in ("nearest", "stochastic"):
        assert torch.equal(formats.fixed_point(x, 8, 8, rounding, clamp=False), x)


def test_with_clamp_inf_saturates_and_nan_stays_nan():
    out = formats.fixed_point(torch.tensor([INF, -INF, NAN]), 8, 4)
    assert out[:2].tolist() == [127 / 16, -8.0] and out[2].isnan()


def _qtorch_ste(wl: int, fl: int, symmetric: bool, rounding: str):
    return quantizer(forward_number=qtorch.FixedPoint(wl, fl, clamp=True, symmetric=symmetric),
                     backward_number=qtorch.FixedPoint(24, 8, clamp=True), forward_rounding=rounding,
                     backward_rounding="nearest", clamping_grad_zero=True)


def _grad_on_backward_grid(n: int) -> torch.Tensor:
    """Gradients that QPyTorch's backward number <24,8> leaves exact."""
    return torch.randint(-2000, 2000, (n,)).float() / 256


@pytest.mark.parametrize("wl,fl", [(8, 4), (4, 2), (6, 1)])  # QPyTorch needs fl >= 1
@pytest.mark.parametrize("symmetric", [False, True])
def test_clamped_gradient_is_zero_like_qtorch(wl, fl, symmetric):
    x = torch.cat([_wide(4096), torch.tensor([INF, -INF])])
    # QPyTorch's mask: the rounded value outside [min, max]; elements at a tie could round either way
    keep = _off_ties(x, fl) | x.isinf()
    x, g = x[keep], _grad_on_backward_grid(int(keep.sum()))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = quantize_ste(a, FixedPoint(wl, fl, "nearest", symmetric=symmetric, clamp_grad_zero=True))
    ref = _qtorch_ste(wl, fl, symmetric, "nearest")(b)
    assert torch.equal(out, ref)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(a.grad, b.grad)
    assert (a.grad == 0).any() and (a.grad != 0).any()


def test_clamped_gradient_with_stochastic_rounding_marks_the_elements_that_left_the_range():
    torch.manual_seed(0)
    # <4,2>: range [-2, 1.75]; 1.8 rounds to 1.75 or 2.0 (clamped), 1.7 to 1.5 or 1.75 (never clamped)
    x = torch.tensor([1.8, 1.7, -2.1, 5.0]).repeat(1000).requires_grad_()
    out = quantize_ste(x, FixedPoint(4, 2, "stochastic", clamp_grad_zero=True))
    out.backward(torch.ones_like(x))
    grad = x.grad.view(1000, 4)
    assert torch.all(grad[:, 1] == 1) and torch.all(grad[:, 3] == 0)
    assert 0.1 < (grad[:, 0] == 0).double().mean() < 0.3  # P(1.8 -> 2.0) = 0.2
    assert 0.3 < (grad[:, 2] == 0).double().mean() < 0.5  # P(-2.1 -> -2.25, clamped) = 0.4


def test_without_the_option_the_gradient_passes_everywhere():
    x = torch.tensor([100.0, -100.0, 0.3]).requires_grad_()
    quantize_ste(x, FixedPoint(4, 2, "nearest")).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="clamp"):
        FixedPoint(4, 2, clamp=False, clamp_grad_zero=True)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_layers_zero_the_gradient_of_clamped_weights_and_activations(kind):
    torch.manual_seed(1)
    if kind == "linear":
        layer, x = nn.Linear(6, 5), torch.randn(7, 6) * 3
        gemm = F.linear
    else:
        layer, x = nn.Conv2d(3, 4, 3, padding=1), torch.randn(2, 3, 5, 5) * 3
        gemm = lambda t, w, b: F.conv2d(t, w, b, padding=1)  # noqa: E731
    with torch.no_grad():
        layer.weight.mul_(60)  # some weights beyond <6,3>'s range [-4, 3.875]
    ref_w = layer.weight.detach().clone().requires_grad_()
    ref_x = x.clone().requires_grad_()
    fixed = _qtorch_ste(6, 3, False, "nearest")
    ref = gemm(fixed(ref_x), fixed(ref_w), layer.bias.detach())
    g = torch.randint(-64, 64, ref.shape).float() / 8
    ref.backward(g)

    quant = OperandQuantizers(weight=FixedPoint(6, 3, "nearest", clamp_grad_zero=True),
                              act=FixedPoint(6, 3, "nearest", clamp_grad_zero=True))
    model = nn.Sequential(layer)
    swap_layers(model, lambda name, module: quant)
    ours_x = x.clone().requires_grad_()
    out = model(ours_x)
    assert torch.allclose(out, ref.detach(), atol=1e-5)
    out.backward(g)
    assert torch.allclose(ours_x.grad, ref_x.grad, atol=1e-5) and (ours_x.grad == 0).any()
    assert torch.allclose(model[0].weight.grad, ref_w.grad, atol=1e-5) and (model[0].weight.grad == 0).any()
