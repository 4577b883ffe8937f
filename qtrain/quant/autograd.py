"""Autograd primitives of quantized training: the straight-through quantizer (:func:`quantize_ste`), the gradient
quantizer (:func:`quantize_grad`), and the three quantized GEMMs of a Conv2d or Linear (:class:`QuantizedGEMM`)
and of two activations (:class:`QuantizedMatMul`). docs/formats.md ("Quantizers and layers") describes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from qtrain.quant.quantizers import quantize_twice

Fn = Callable[[torch.Tensor], torch.Tensor]


class _QuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, quantize: Fn) -> torch.Tensor:
        with_mask = getattr(quantize, "forward_with_mask", None)  # a Quantizer may zero clamped gradients
        out, passes = with_mask(x) if with_mask is not None else (quantize(x), None)
        ctx.masked = passes is not None
        if ctx.masked:
            ctx.save_for_backward(passes)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (torch.where(ctx.saved_tensors[0], grad, 0.0) if ctx.masked else grad), None


class _QuantizeGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, quantize: Fn) -> torch.Tensor:
        ctx.quantize = quantize
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.quantize(grad.contiguous()), None


def quantize_ste(x: torch.Tensor, quantize: Fn) -> torch.Tensor:
    """``quantize(x)`` forward, identity backward (straight-through estimator).

    Where ``quantize`` is a :class:`~qtrain.quant.quantizers.Quantizer` its ``forward_with_mask`` runs
    instead, and the gradient is zero where that mask is False (elements it clamped, if so configured).
    """
    return _QuantizeSTE.apply(x, quantize)


def quantize_grad(x: torch.Tensor, quantize: Fn) -> torch.Tensor:
    """Identity forward; the gradient flowing back through it is ``quantize(grad)``."""
    return _QuantizeGrad.apply(x, quantize)


def conv_grads(layer: Any, grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, mask: list[bool]) -> tuple:
    return torch.ops.aten.convolution_backward(
        grad, x, w, [w.shape[0]] if mask[2] else None,
        layer.stride, layer.padding, layer.dilation, False, [0, 0], layer.groups, mask,
    )


def linear_grads(layer: Any, grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, mask: list[bool]) -> tuple:
    grad_x = grad @ w if mask[0] else None
    flat = grad.reshape(-1, grad.shape[-1])
    grad_w = flat.t() @ x.reshape(-1, x.shape[-1]) if mask[1] else None
    grad_b = flat.sum(0) if mask[2] else None
    return grad_x, grad_w, grad_b


class QuantizedGEMM(torch.autograd.Function):
    """A Conv2d or Linear on a quantized activation, with quantized gradients in backward.

    ``layer`` is the module (its GEMM and conv parameters), ``quant`` its operand quantizers;
    ``weight`` arrives already quantized. The activation is quantized here so that backward can keep
    its compact form (integer codes where the quantizer has one) rather than a float32 copy. In
    backward ``grad_output`` is quantized by ``quant.grad`` for the error GEMM and, where
    ``quant.grad_weight`` is set (SBM's FW-8/BW-16 gradient bifurcation), separately for the
    weight-gradient GEMM. ``act_bits``/``grad_bits`` (``(N,)`` tensors or None) give each sample its
    own activation and gradient bit-width (DFQ); the gradient's are captured here for backward.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Any, quant: Any,
        act_bits: torch.Tensor | None = None, grad_bits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        act = quant.act
        xq, saved = act.compact(x, act_bits) if act is not None else (x, (x,))
        ctx.save_for_backward(weight, *saved)
        ctx.layer, ctx.quant, ctx.has_bias, ctx.x_shape, ctx.grad_bits = layer, quant, bias is not None, x.shape, grad_bits
        return layer.gemm(xq, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        weight, *saved = ctx.saved_tensors
        layer, q = ctx.layer, ctx.quant
        x = q.act.expand(tuple(saved), ctx.x_shape) if q.act is not None else saved[0]
        grads_of = conv_grads if isinstance(layer, torch.nn.Conv2d) else linear_grads
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        want_x, want_w = need_x or q.observer is not None, need_w or q.observer is not None
        grad = grad.contiguous()
        if q.grad_weight is None:
            grad_err = q.grad(grad, ctx.grad_bits) if q.grad is not None else grad
            gx, gw, gb = grads_of(layer, grad_err, x, weight, [want_x, want_w, need_b])
        else:
            grad_err, grad_w = (quantize_twice(q.grad, q.grad_weight, grad, ctx.grad_bits) if q.grad is not None
                                else (grad, q.grad_weight(grad)))
            gx = grads_of(layer, grad_err, x, weight, [want_x, False, False])[0] if want_x else None
            _, gw, gb = grads_of(layer, grad_w, x, weight, [False, want_w, need_b])
        if q.observer is not None:
            q.observer(gx, gw, tuple(saved))
        if gx is not None and need_x and q.act is not None:  # straight-through for the activation quantizer
            gx = q.act.masked_grad(gx, tuple(saved))
        gx, gw = (gx if need_x else None), (gw if need_w else None)
        return gx, gw, gb, None, None, None, None


class QuantizedMatMul(torch.autograd.Function):
    """``a @ b`` on operands quantized by ``quant.act`` (``a``) and ``quant.weight`` (``b``), in compact form for backward.

    Backward: ``grad_a = q.grad(G) @ b^T`` and ``grad_b = a^T @ q.grad_weight(G)`` (``q.grad`` where no
    separate weight-gradient quantizer is set), each passed straight through its operand's quantizer.
    ``a`` and ``b`` share their batch dimensions (no broadcasting).
    """

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, quant: Any) -> torch.Tensor:
        aq, saved_a = quant.act.compact(a) if quant.act is not None else (a, (a,))
        bq, saved_b = quant.weight.compact(b) if quant.weight is not None else (b, (b,))
        ctx.save_for_backward(*saved_a, *saved_b)
        ctx.quant, ctx.split, ctx.shapes = quant, len(saved_a), (a.shape, b.shape)
        return aq @ bq

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        q, saved = ctx.quant, ctx.saved_tensors
        saved_a, saved_b = tuple(saved[:ctx.split]), tuple(saved[ctx.split:])
        a = q.act.expand(saved_a, ctx.shapes[0]) if q.act is not None else saved_a[0]
        b = q.weight.expand(saved_b, ctx.shapes[1]) if q.weight is not None else saved_b[0]
        grad = grad.contiguous()
        grad_err = q.grad(grad) if q.grad is not None else grad
        grad_w = q.grad_weight(grad) if q.grad_weight is not None else grad_err
        grad_a = grad_err @ b.transpose(-2, -1) if ctx.needs_input_grad[0] else None
        grad_b = a.transpose(-2, -1) @ grad_w if ctx.needs_input_grad[1] else None
        if grad_a is not None and q.act is not None:
            grad_a = q.act.masked_grad(grad_a, saved_a)
        if grad_b is not None and q.weight is not None:
            grad_b = q.weight.masked_grad(grad_b, saved_b)
        return grad_a, grad_b, None
