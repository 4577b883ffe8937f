"""Quantized Conv2d and Linear, and the one call that installs them in a model (torchao's style).

A quantized layer keeps the float32 master weight as its parameter and holds one or more
:class:`OperandQuantizers` (one quantizer, or None for float32, per operand of its three GEMMs): one
per precision option. A layer with several options runs each contiguous group of samples of the
batch at its own option when ``option_groups`` is set (DFQ's per-sample precision, FracTrain Sec. 3.2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from qtrain.precision import Bits
from qtrain.quant.autograd import QuantizedGEMM, quantize_grad, quantize_ste
from qtrain.quant.quantizers import Quantizer


class OperandQuantizers(nn.Module):
    """Quantizers of a layer's operands; ``grad_weight`` None means the weight-gradient path reuses ``grad``."""

    def __init__(
        self,
        weight: Quantizer | None = None,
        act: Quantizer | None = None,
        grad: Quantizer | None = None,
        grad_weight: Quantizer | None = None,
    ) -> None:
        super().__init__()
        if grad_weight is not None and grad is None:
            raise ValueError("a separate weight-gradient quantizer needs an error-path quantizer too")
        self.weight, self.act, self.grad, self.grad_weight = weight, act, grad, grad_weight

    def bits(self) -> Bits:
        """Bits per operand as the cost model charges them (32 where an operand stays float32)."""
        width = {name: (q.bits if q is not None else 32)
                 for name, q in (("weight", self.weight), ("act", self.act), ("grad", self.grad))}
        grad_weight = self.grad_weight.bits if self.grad_weight is not None else width["grad"]
        return Bits(**width, grad_weight=grad_weight)


class _Quantized:
    """Forward shared by the quantized layers: quantize the weight (straight-through), then the GEMM."""

    quants: nn.ModuleList
    # (option, sample count) of each contiguous group of the batch, set around one forward; None: option 0
    option_groups: tuple[tuple[int, int], ...] | None = None

    @property
    def quant(self) -> OperandQuantizers:
        """The quantizers of the first (for most methods the only) precision option."""
        return self.quants[0]

    def quantized_weight(self) -> torch.Tensor:
        q = self.quant.weight
        return q(self.weight) if q is not None else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.option_groups is None or len(self.quants) == 1:
            return self._forward_at(x, self.quant)
        parts = x.split([count for _, count in self.option_groups])
        return torch.cat([self._forward_at(part, self.quants[option]) for (option, _), part in zip(self.option_groups, parts)])

    def _forward_at(self, x: torch.Tensor, q: OperandQuantizers) -> torch.Tensor:
        weight = quantize_ste(self.weight, q.weight) if q.weight is not None else self.weight
        if torch.is_grad_enabled() and (q.act is not None or q.grad_weight is not None):
            # one node that keeps the activation's compact codes and can split the gradient paths
            return QuantizedGEMM.apply(x, weight, self.bias, self, q)
        out = self.gemm(q.act(x) if q.act is not None else x, weight, self.bias)
        return quantize_grad(out, q.grad) if q.grad is not None else out


class QConv2d(_Quantized, nn.Conv2d):
    def gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)


class QLinear(_Quantized, nn.Linear):
    def gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)


def _quantized_copy(layer: nn.Module, quants: Sequence[OperandQuantizers]) -> nn.Module:
    """A QConv2d/QLinear that shares ``layer``'s parameters and buffers (no copy of the weights)."""
    cls = QConv2d if isinstance(layer, nn.Conv2d) else QLinear
    new = cls.__new__(cls)
    new.__dict__.update(layer.__dict__)
    new._modules = dict(layer._modules)
    new.quants = nn.ModuleList(quants)
    return new


def set_groups(module: nn.Module, groups: tuple[tuple[int, int], ...] | None) -> None:
    """Set the per-group precision options of every quantized layer inside ``module``."""
    for layer in module.modules():
        if isinstance(layer, _Quantized):
            layer.option_groups = groups


QuantizersFor = Callable[[str, nn.Module], OperandQuantizers | Sequence[OperandQuantizers] | None]


def swap_layers(model: nn.Module, quantizers_for: QuantizersFor) -> list[str]:
    """Replace every Conv2d and Linear for which ``quantizers_for(name, layer)`` gives quantizers.

    It gives one :class:`OperandQuantizers`, or one per precision option of a per-sample layer.

    Parameters are shared, not copied, so an optimizer built before or after sees the same tensors.
    Returns the names of the swapped layers, in model order.
    """
    swapped = []
    for name, layer in list(model.named_modules()):
        if type(layer) not in (nn.Conv2d, nn.Linear):
            continue
        quant = quantizers_for(name, layer)
        if quant is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        quants = [quant] if isinstance(quant, OperandQuantizers) else list(quant)
        setattr(parent, child, _quantized_copy(layer, quants))
        swapped.append(name)
    return swapped
