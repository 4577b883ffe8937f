"""The shared shape of the methods on scaled formats (FP8, OCP MX, NVFP4): every Conv2d, Linear and MatMul
trains its three GEMMs on operands in one scaled format for the whole run (:mod:`qtrain.quant.scaled_gemm`),
the first and last layer optionally in float32. The record charges each operand its element bits plus the
amortized scale bits, and tells the hardware models the significand widths they multiply.
"""

from __future__ import annotations

from omegaconf import DictConfig
from torch import nn

from qtrain.methods.base import Method
from qtrain.methods.sbm import float_ends
from qtrain.precision import LayerPrecision, PrecisionRecord
from qtrain.quant.layers import swap_layers
from qtrain.quant.scaled_gemm import ScaledOperands


class ScaledFormats(Method):
    """Base class: a subclass says which quantizers a layer's operands get (:meth:`operands`)."""

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        self.operand_quantizers: dict[str, ScaledOperands] = {}  # of each swapped layer, by name

    def operands(self, layer: nn.Module) -> ScaledOperands:
        raise NotImplementedError

    def prepare(self, model: nn.Module) -> nn.Module:
        keep_float = float_ends(self.cfg, [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))])
        swapped = swap_layers(model, lambda n, m: None if n in keep_float else self.operands(m), matmuls=True)
        self.operand_quantizers = {name: model.get_submodule(name).quant for name in swapped}
        return model

    def precision(self) -> PrecisionRecord:
        """Each layer's operand bits, read now: a per-tensor scale is amortized over the last tensor it scaled."""
        return {name: LayerPrecision(((1.0, q.bits()),), q.fmt(), q.datapath()) for name, q in self.operand_quantizers.items()}
