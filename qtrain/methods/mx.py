"""OCP Microscaling training (OCP MX v1.0; Rouhani et al. 2023, "Microscaling Data Formats for Deep Learning",
Sec. 6) and NVFP4 training (NVIDIA 2025): every GEMM operand in blocks that share a scale, blocked along each GEMM's
own reduction dimension, with NVFP4's recipe as options. Defaults, their sources and every departure from the spec,
the paper and the reference codes: docs/methods/mx.md."""

from __future__ import annotations

from torch import nn

from qtrain.config import methods as schemas
from qtrain.methods.scaled import ScaledFormats
from qtrain.quant.layers import MatMul
from qtrain.quant.scaled_gemm import ScaledOperands
from qtrain.quant.scaled_quantizers import BlockScaled


class MX(ScaledFormats):
    cfg: schemas.MX

    def operands(self, layer: nn.Module) -> ScaledOperands:
        cfg = self.cfg
        if isinstance(layer, MatMul):  # the second operand is an activation, in the activations' format
            weight = BlockScaled(cfg.act.value, scale_rule=cfg.scale_rule.value)
        else:
            weight = BlockScaled(cfg.weight.value, two_d=cfg.weight_blocks is schemas.WeightBlocks.TWO_D,
                                 scale_rule=cfg.scale_rule.value)
        return ScaledOperands(weight, BlockScaled(cfg.act.value, scale_rule=cfg.scale_rule.value),
                              BlockScaled(cfg.grad.value, rounding=cfg.grad_rounding.value, scale_rule=cfg.scale_rule.value),
                              hadamard_wgrad=cfg.hadamard_wgrad)
