"""Quantized Conv2d, Linear and MatMul, and the one call that installs them in a model (:func:`swap_layers`, torchao's
style). A layer keeps its float32 master weight and holds :class:`OperandQuantizers` or, for FP8, MX and NVFP4,
:class:`~qtrain.quant.scaled_gemm.ScaledOperands`. docs/formats.md ("Quantizers and layers") describes them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from qtrain.precision import Bits
from qtrain.quant.autograd import QuantizedGEMM, QuantizedMatMul, quantize_grad, quantize_ste
from qtrain.quant.quantizers import Quantizer
from qtrain.quant.scaled_gemm import ScaledOperands, forward_weight, scaled_gemm, scaled_matmul


class OperandQuantizers(nn.Module):
    """Quantizers of a layer's operands; ``grad_weight`` None means the weight-gradient path reuses ``grad``.

    ``observer``, where set, sees each backward's gradients w.r.t. the layer's input and weight and
    what the activation quantizer saved (DYNASTY's per-block sensitivities, :mod:`qtrain.quant.block_maps`).
    """

    def __init__(
        self,
        weight: Quantizer | None = None,
        act: Quantizer | None = None,
        grad: Quantizer | None = None,
        grad_weight: Quantizer | None = None,
        observer: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if grad_weight is not None and grad is None:
            raise ValueError("a separate weight-gradient quantizer needs an error-path quantizer too")
        if observer is not None and act is None:
            raise ValueError("a gradient observer needs an activation quantizer (it runs in the quantized GEMM's backward)")
        self.weight, self.act, self.grad, self.grad_weight = weight, act, grad, grad_weight
        self.observer = observer

    def bits(self) -> Bits:
        """Bits per operand as the cost model charges them (32 where an operand stays float32)."""
        width = {name: (q.bits if q is not None else 32)
                 for name, q in (("weight", self.weight), ("act", self.act), ("grad", self.grad))}
        grad_weight = self.grad_weight.bits if self.grad_weight is not None else width["grad"]
        return Bits(**width, grad_weight=grad_weight)


class _Quantized:
    """Forward shared by the quantized layers: quantize the weight (straight-through), then the GEMM.

    ``sample_bits`` set around one forward gives every sample its own activation and gradient
    bit-widths, two ``(N,)`` tensors (DFQ's per-input precision, FracTrain Sec. 3.2): all samples
    share the weight, the GEMM and the quantization range, and each is rounded onto its own grid.
    """

    quant: OperandQuantizers | ScaledOperands
    sample_bits: tuple[torch.Tensor, torch.Tensor] | None = None

    def quantized_weight(self) -> torch.Tensor:
        if isinstance(self.quant, ScaledOperands):
            return forward_weight(self)
        q = self.quant.weight
        return q(self.weight) if q is not None else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        if isinstance(q, ScaledOperands):  # every GEMM quantizes its own operands (scaled formats)
            return scaled_gemm(self, x, q)
        act_bits, grad_bits = self.sample_bits if self.sample_bits is not None else (None, None)
        weight = quantize_ste(self.weight, q.weight) if q.weight is not None else self.weight
        if torch.is_grad_enabled() and (q.act is not None or q.grad_weight is not None or grad_bits is not None):
            # one node that keeps the activation's compact codes and can split the gradient paths
            return QuantizedGEMM.apply(x, weight, self.bias, self, q, act_bits, grad_bits)
        out = self.gemm(q.act(x, act_bits) if q.act is not None else x, weight, self.bias)
        return quantize_grad(out, q.grad) if q.grad is not None else out


class QConv2d(_Quantized, nn.Conv2d):
    def gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)


class QLinear(_Quantized, nn.Linear):
    def gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class MatMul(nn.Module):
    """``a @ b`` of two activations with the same batch dimensions, as a module (float32)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


class QMatMul(MatMul):
    """:class:`MatMul` on quantized operands: ``quant.act`` quantizes ``a``, ``quant.weight`` quantizes ``b``."""

    quant: OperandQuantizers | ScaledOperands

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        q = self.quant
        if isinstance(q, ScaledOperands):
            return scaled_matmul(a, b, q)
        if torch.is_grad_enabled():
            return QuantizedMatMul.apply(a, b, q)
        return (q.act(a) if q.act is not None else a) @ (q.weight(b) if q.weight is not None else b)


SWAPPED = {nn.Conv2d: QConv2d, nn.Linear: QLinear, MatMul: QMatMul}


def _quantized_copy(layer: nn.Module, quant: OperandQuantizers | ScaledOperands) -> nn.Module:
    """The quantized class of ``layer``, sharing its parameters and buffers (no copy of the weights)."""
    cls = SWAPPED[type(layer)]
    new = cls.__new__(cls)
    new.__dict__.update(layer.__dict__)
    new._modules = dict(layer._modules)
    new.quant = quant
    return new


def set_sample_bits(layers: Sequence[nn.Module], bits: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Give ``layers`` per-sample (activation, gradient) bit-widths for the next forward, or clear them (None)."""
    for layer in layers:
        layer.sample_bits = bits


QuantizersFor = Callable[[str, nn.Module], OperandQuantizers | ScaledOperands | None]


def swap_layers(model: nn.Module, quantizers_for: QuantizersFor, matmuls: bool = False) -> list[str]:
    """Replace every Conv2d and Linear (and, with ``matmuls``, every :class:`MatMul`) for which
    ``quantizers_for(name, layer)`` gives quantizers.

    Parameters are shared, not copied, so an optimizer built before or after sees the same tensors.
    Returns the names of the swapped layers, in model order. A method that leaves the MatMuls out
    trains them in float32, and the cost meter charges them so.
    """
    kinds = (nn.Conv2d, nn.Linear, MatMul) if matmuls else (nn.Conv2d, nn.Linear)
    swapped = []
    for name, layer in list(model.named_modules()):
        if type(layer) not in kinds:
            continue
        quant = quantizers_for(name, layer)
        if quant is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _quantized_copy(layer, quant))
        swapped.append(name)
    return swapped
