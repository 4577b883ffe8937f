"""FP8 training (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", Sec. 3-4; NVIDIA Transformer Engine's
recipes): weights and activations in E4M3, gradients in E5M2, one float32 scale per tensor from its own amax
(current scaling) or from an amax history of earlier steps (TE's DelayedScaling), saturating.

Defaults, their sources and every departure from the paper and Transformer Engine: docs/methods/fp8.md.
"""

from __future__ import annotations

from torch import nn

from qtrain.config import methods as schemas
from qtrain.methods.scaled import ScaledFormats
from qtrain.quant.layers import MatMul
from qtrain.quant.scaled_gemm import ScaledOperands
from qtrain.quant.scaled_quantizers import TensorScaledFP8


class FP8(ScaledFormats):
    cfg: schemas.FP8

    def _quantizer(self, element: schemas.Fp8Element) -> TensorScaledFP8:
        cfg = self.cfg
        return TensorScaledFP8(element.value, cfg.scaling.value, cfg.margin, cfg.amax_history_len,
                               cfg.amax_compute_algo.value)

    def operands(self, layer: nn.Module) -> ScaledOperands:
        cfg = self.cfg
        second = cfg.act if isinstance(layer, MatMul) else cfg.weight  # a MatMul's second operand is an activation
        return ScaledOperands(self._quantizer(second), self._quantizer(cfg.act), self._quantizer(cfg.grad))
