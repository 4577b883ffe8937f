"""The shared shape of the methods on scaled formats (FP8, OCP MX, NVFP4): every Conv2d, Linear and MatMul
trains its three GEMMs on operands in one scaled format for the whole run (:mod:`qtrain.quant.scaled_gemm`),
but the first and last Conv2d/Linear and the MatMuls, which the method may keep in bfloat16 (as the published
recipes keep some layers in 16-bit) or in float32. The record charges each operand its element bits plus the
amortized scale bits, and tells the hardware models the widths they multiply.
"""

from __future__ import annotations

from torch import nn

from qtrain.config import methods as schemas
from qtrain.methods.base import Method
from qtrain.precision import LayerPrecision, PrecisionRecord
from qtrain.quant.choices import SCALED_LAYER_FORMATS
from qtrain.quant.layers import MatMul, swap_layers
from qtrain.quant.scaled_gemm import ScaledOperands
from qtrain.quant.scaled_quantizers import Bfloat16


class ScaledFormats(Method):
    """Base class: a subclass says which quantizers a layer's operands get (:meth:`operands`)."""

    def __init__(self, cfg: schemas.ScaledLayers) -> None:
        super().__init__(cfg)
        self.operand_quantizers: dict[str, ScaledOperands] = {}  # of each swapped layer, by name

    def operands(self, layer: nn.Module) -> ScaledOperands:
        raise NotImplementedError

    def layer_formats(self, model: nn.Module) -> dict[str, schemas.LayerFormat]:
        """Each Conv2d, Linear and MatMul's ``quantized``, ``bf16`` or ``float32`` (a network of one such layer
        takes the wider of ``first_layer`` and ``last_layer``)."""
        cfg, wider = self.cfg, lambda *formats: max(formats, key=SCALED_LAYER_FORMATS.index)
        layers = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
        formats = {name: schemas.LayerFormat.QUANTIZED for name in layers}
        formats[layers[0]] = cfg.first_layer
        formats[layers[-1]] = wider(formats[layers[-1]], cfg.last_layer)
        formats.update({n: cfg.matmuls for n, m in model.named_modules() if isinstance(m, MatMul)})
        return formats

    def prepare(self, model: nn.Module) -> nn.Module:
        formats = self.layer_formats(model)

        def quantizers(name: str, layer: nn.Module) -> ScaledOperands | None:
            if formats[name] is schemas.LayerFormat.BF16:
                return ScaledOperands(Bfloat16(), Bfloat16(), Bfloat16())
            return self.operands(layer) if formats[name] is schemas.LayerFormat.QUANTIZED else None

        swapped = swap_layers(model, quantizers, matmuls=True)
        self.operand_quantizers = {name: model.get_submodule(name).quant for name in swapped}
        return model

    def precision(self) -> PrecisionRecord:
        """Each layer's operand bits, read now: a per-tensor scale is amortized over the last tensor it scaled."""
        return {name: LayerPrecision(((1.0, q.bits()),), q.fmt(), q.datapath()) for name, q in self.operand_quantizers.items()}
