"""Autograd primitives of quantized training (DESIGN.md, "Quantization core"; METHODS.md, "Common ground").

- :func:`quantize_ste`: quantize in forward, pass the gradient straight through.
- :func:`quantize_grad`: identity in forward, quantize ``grad_output`` in backward.
- :class:`BifurcatedGEMM`: a convolution or linear layer whose backward quantizes ``grad_output``
  at one precision for the error path (grad w.r.t. input) and at another for the weight-gradient
  path (SBM's "BW-16" gradient bifurcation). It saves only its (quantized) operands, like the
  float32 layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Fn = Callable[[torch.Tensor], torch.Tensor]


class _QuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, quantize: Fn) -> torch.Tensor:
        return quantize(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _QuantizeGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, quantize: Fn) -> torch.Tensor:
        ctx.quantize = quantize
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.quantize(grad.contiguous()), None


def quantize_ste(x: torch.Tensor, quantize: Fn) -> torch.Tensor:
    """``quantize(x)`` forward, identity backward (straight-through estimator)."""
    return _QuantizeSTE.apply(x, quantize)


def quantize_grad(x: torch.Tensor, quantize: Fn) -> torch.Tensor:
    """Identity forward; the gradient flowing back through it is ``quantize(grad)``."""
    return _QuantizeGrad.apply(x, quantize)


def _conv_grads(layer: Any, grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, mask: list[bool]) -> tuple:
    return torch.ops.aten.convolution_backward(
        grad, x, w, [w.shape[0]] if mask[2] else None,
        layer.stride, layer.padding, layer.dilation, False, [0, 0], layer.groups, mask,
    )


def _linear_grads(layer: Any, grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, mask: list[bool]) -> tuple:
    grad_x = grad @ w if mask[0] else None
    flat = grad.reshape(-1, grad.shape[-1])
    grad_w = flat.t() @ x.reshape(-1, x.shape[-1]) if mask[1] else None
    grad_b = flat.sum(0) if mask[2] else None
    return grad_x, grad_w, grad_b


class BifurcatedGEMM(torch.autograd.Function):
    """A Conv2d or Linear whose backward quantizes ``grad_output`` separately for its two GEMMs.

    ``layer`` is the module (for its conv parameters and ``quant.grad``/``quant.grad_weight``);
    ``x`` and ``weight`` arrive already quantized.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.has_bias = layer, bias is not None
        return layer.gemm(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        grads_of = _conv_grads if isinstance(layer, torch.nn.Conv2d) else _linear_grads
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        grad = grad.contiguous()
        gx = grads_of(layer, layer.quant.grad(grad), x, weight, [need_x, False, False])[0] if need_x else None
        _, gw, gb = grads_of(layer, layer.quant.grad_weight(grad), x, weight, [False, need_w, need_b])
        return gx, gw, gb, None
