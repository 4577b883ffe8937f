"""The quantization choices a config names, as plain values (no torch): the kernels own them, and the config
schemas (:mod:`qtrain.config.methods`) build their checks from them without importing the kernels."""

from __future__ import annotations

ROUNDINGS = ("nearest", "stochastic")  # onto a grid: half to even | stochastic
# method=mx's block formats: OCP MX (blocks of 32 under an E8M0 scale) by their element format, and NVFP4
MX_ELEMENTS_OF = {"mxfp8_e4m3": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp6_e3m2": "e3m2", "mxfp6_e2m3": "e2m3",
                  "mxfp4_e2m1": "e2m1", "mxint8": "int8"}
BLOCK_FORMATS = (*MX_ELEMENTS_OF, "nvfp4")
MX_SCALE_RULES = ("floor", "ceil")  # an MX block's shared exponent: OCP MX v1.0's | Transformer Engine's MXFP8 (up)
# what the scaled-format methods (fp8, mx) do with a layer they may keep out of the format: its first and last
# Conv2d/Linear, its MatMuls (a Transformer's attention products)
SCALED_LAYER_FORMATS = ("quantized", "bf16", "float32")  # the method's format | bfloat16 operands | float32
DYNASTY_STATIC_BITS = 8  # DYNASTY's static operand's mantissa bits, the widest a block gets
