"""The three training GEMMs of a layer on operands in scaled formats (FP8, OCP MX, NVFP4), each GEMM quantizing its
operands from their float32 values along the dimension it reduces over. The dimensions of each GEMM, for a Conv2d, a
Linear and a MatMul, and why: docs/methods/mx.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qtrain.precision import Bits
from qtrain.quant.autograd import conv_grads, linear_grads
from qtrain.quant.microscaling import random_hadamard
from qtrain.quant.scaled_quantizers import ScaledQuantizer


@dataclass(frozen=True)
class Reductions:
    """The dimension each GEMM reduces each operand over: forward (x, w), error (G, w), weight gradient (x, G)."""

    forward: tuple[int, int]
    error: tuple[int, int]
    weight_grad: tuple[int, int]


CONV = Reductions((1, 1), (1, 0), (0, 0))
LINEAR = Reductions((-1, 1), (-1, 0), (0, 0))  # the weight gradient's operands as (rows, features)
MATMUL = Reductions((-1, -2), (-1, -1), (-2, -2))


def _reductions(layer: nn.Module) -> Reductions:
    return CONV if isinstance(layer, nn.Conv2d) else LINEAR


class ScaledOperands(nn.Module):
    """The scaled-format quantizers of one layer's operands (None: float32), and the weight-gradient rotation."""

    def __init__(self, weight: ScaledQuantizer | None, act: ScaledQuantizer | None, grad: ScaledQuantizer | None,
                 hadamard_wgrad: bool = False) -> None:
        super().__init__()
        self.weight, self.act, self.grad, self.hadamard_wgrad = weight, act, grad, hadamard_wgrad

    def bits(self) -> Bits:
        """Bits per operand as the cost meter charges them: element plus amortized scale bits (32: float32)."""
        w, a, g = (q.bits if q is not None else 32 for q in (self.weight, self.act, self.grad))
        return Bits(w, a, g, g)

    def fmt(self) -> str:
        """The operands' formats, each named once (weight, activation, gradient order)."""
        names = [q.fmt if q is not None else "float32" for q in (self.weight, self.act, self.grad)]
        return "/".join(dict.fromkeys(names))

    def datapath(self) -> Bits:
        """The widths the MAC units multiply (an integer element's bits; NaN for a float element, which the hardware
        models leave unpriced; 32 for float32): what the hardware models time."""
        w, a, g = (q.datapath_bits() if q is not None else 32 for q in (self.weight, self.act, self.grad))
        return Bits(w, a, g, g)


def _quantize(q: ScaledQuantizer | None, x: torch.Tensor, dim: int) -> torch.Tensor:
    return q(x, dim) if q is not None else x


def _scale(q: ScaledQuantizer | None) -> torch.Tensor | None:
    """The per-tensor scale ``q`` used in its last call (None: blocks carry their own, or float32)."""
    return q.used_scale if q is not None else None


def _again(q: ScaledQuantizer | None, x: torch.Tensor, dim: int, scale: torch.Tensor | None) -> torch.Tensor:
    """The float32 operand ``x`` for another GEMM: re-blocked along ``dim``, or at the per-tensor ``scale`` its first
    GEMM used (the same values again: backward keeps the float32 operand, which the layer before holds anyway,
    not a quantized copy)."""
    return q.requantize(x, dim, scale) if q is not None else x


def _weight_grad_operands(q: ScaledOperands, x: torch.Tensor, g: torch.Tensor, g_err: torch.Tensor,
                          dims: tuple[int, int], act_scale: torch.Tensor | None,
                          rotate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation and gradient of the weight-gradient GEMM, rotated (``hadamard_wgrad``, where ``rotate``) and
    quantized (the activation at ``act_scale`` where its quantizer scales per tensor)."""
    if q.hadamard_wgrad and rotate:
        x, g = random_hadamard(x, dims[0]), random_hadamard(g, dims[1])
        return _quantize(q.act, x, dims[0]), _quantize(q.grad, g, dims[1])
    grad = q.grad(g, dims[1]) if q.grad is not None and q.grad.per_gemm else g_err
    return _again(q.act, x, dims[0], act_scale), grad


class ScaledGEMM(torch.autograd.Function):
    """A Conv2d or Linear whose three training GEMMs each quantize their operands (:class:`ScaledOperands`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Any,
                q: ScaledOperands) -> torch.Tensor:
        dims = _reductions(layer)
        xq, wq = _quantize(q.act, x, dims.forward[0]), _quantize(q.weight, weight, dims.forward[1])
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.q, ctx.dims, ctx.has_bias = layer, q, dims, bias is not None
        ctx.scales = _scale(q.act), _scale(q.weight)
        return layer.gemm(xq, wq, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        layer, q, dims = ctx.layer, ctx.q, ctx.dims
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        grad = grad.contiguous()
        g_err = _quantize(q.grad, grad, dims.error[0])
        conv = isinstance(layer, nn.Conv2d)
        grads_of = conv_grads if conv else linear_grads
        act_scale, weight_scale = ctx.scales
        w_err = _again(q.weight, w, dims.error[1], weight_scale) if need_x else None
        gx = grads_of(layer, g_err, x, w_err, [True, False, False])[0] if need_x else None
        gw = None
        if need_w:
            rows_x, rows_g = (x, grad) if conv else (x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1]))
            rows_err = g_err if conv else g_err.reshape(-1, g_err.shape[-1])
            xw, gwq = _weight_grad_operands(q, rows_x, rows_g, rows_err, dims.weight_grad, act_scale)
            gw = grads_of(layer, gwq, xw, w, [False, True, False])[1]
        gb = grads_of(layer, grad, x, w, [False, False, True])[2] if need_b else None  # from the float32 gradient
        return gx, gw, gb, None, None


class ScaledMatMul(torch.autograd.Function):
    """``a @ b`` with ``q.act`` quantizing ``a`` and ``q.weight`` ``b`` in each of the three GEMMs."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, q: ScaledOperands) -> torch.Tensor:
        aq, bq = _quantize(q.act, a, MATMUL.forward[0]), _quantize(q.weight, b, MATMUL.forward[1])
        ctx.save_for_backward(a, b)
        ctx.q, ctx.scales = q, (_scale(q.act), _scale(q.weight))
        return aq @ bq

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        a, b = ctx.saved_tensors
        q = ctx.q
        grad = grad.contiguous()
        g_err = _quantize(q.grad, grad, MATMUL.error[0])
        a_scale, b_scale = ctx.scales
        grad_a = None
        if ctx.needs_input_grad[0]:
            grad_a = g_err @ _again(q.weight, b, MATMUL.error[1], b_scale).transpose(-2, -1)
        grad_b = None
        if ctx.needs_input_grad[1]:
            # a MatMul's second operand is an activation: NVFP4's rotation is the weight gradients' alone
            aw, gw = _weight_grad_operands(q, a, grad, g_err, MATMUL.weight_grad, a_scale, rotate=False)
            grad_b = aw.transpose(-2, -1) @ gw
        return grad_a, grad_b, None


def forward_weight(layer: Any) -> torch.Tensor:
    """The weight as a quantized Conv2d's or Linear's forward GEMM sees it, changing no quantizer state."""
    q = layer.quant.weight
    return q.quantize(layer.weight, _reductions(layer).forward[1]) if q is not None else layer.weight


def scaled_gemm(layer: Any, x: torch.Tensor, q: ScaledOperands) -> torch.Tensor:
    """A quantized Conv2d or Linear's forward on scaled formats (only the forward GEMM where no gradient is taken)."""
    if torch.is_grad_enabled():
        return ScaledGEMM.apply(x, layer.weight, layer.bias, layer, q)
    dims = _reductions(layer)
    return layer.gemm(_quantize(q.act, x, dims.forward[0]), _quantize(q.weight, layer.weight, dims.forward[1]), layer.bias)


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, q: ScaledOperands) -> torch.Tensor:
    """A quantized :class:`MatMul`'s forward on scaled formats."""
    if torch.is_grad_enabled():
        return ScaledMatMul.apply(a, b, q)
    return _quantize(q.act, a, MATMUL.forward[0]) @ _quantize(q.weight, b, MATMUL.forward[1])
