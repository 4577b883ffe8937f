"""Quantizers of the scaled formats: FP8 with a per-tensor scale, OCP MX and NVFP4 with per-block scales, and unscaled
bfloat16 for the layers a recipe keeps out of its scaled format (:class:`Bfloat16`). What ``bits`` charges:
docs/cost.md ("Scaled formats"); the formats themselves: docs/formats.md."""

from __future__ import annotations

import math

import torch
from torch import nn

from qtrain.quant import fp8_scaling, microscaling
from qtrain.quant.choices import BLOCK_FORMATS, MX_ELEMENTS_OF
from qtrain.quant.elements import ELEMENTS, ElementFormat

TENSOR_SCALE_BITS = 32  # a float32 per-tensor scale (FP8, NVFP4's second level)


class ScaledQuantizer(nn.Module):
    """Base: ``forward(x, dim)`` gives ``x`` on the format's grid, dequantized to float32; ``dim`` is the dimension the
    GEMM reduces ``x`` over (:mod:`qtrain.quant.scaled_gemm`)."""

    # True: blocks form along each call's ``dim``, so an operand that enters two GEMMs is quantized for each along its
    # own reduction dimension; False: one quantization serves the step (a per-tensor scale ignores ``dim``)
    per_gemm = False
    fmt = "scaled"
    element: ElementFormat

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0  # of the last tensor quantized: what a per-tensor scale is amortized over
        self.used_scale: torch.Tensor | None = None  # the per-tensor scale of the last call (None: per block)

    def scale_bits_per_element(self) -> float:
        raise NotImplementedError

    @property
    def bits(self) -> float:
        return self.element.bits + self.scale_bits_per_element()

    def datapath_bits(self) -> float:
        """The operand width an integer MAC unit multiplies: an integer element's own bits; NaN for a float element,
        which the hardware models (integer accelerators) do not price (docs/cost.md)."""
        return self.element.bits if self.element.name == "int8" else math.nan

    def forward(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` quantized for a GEMM, as training counts it (the tensor's size, a delayed scale's amax)."""
        self.elements = x.numel()
        return self.quantize(x, dim)

    def quantize(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` on the format's grid, changing no state (what a report may look at)."""
        raise NotImplementedError

    def requantize(self, x: torch.Tensor, dim: int, scale: torch.Tensor | None) -> torch.Tensor:
        """``x`` for another GEMM of the same step: blocked along that GEMM's ``dim`` (per-tensor quantizers: at the
        ``scale`` the first GEMM used, the same values again)."""
        return self(x, dim)


class TensorScaledFP8(ScaledQuantizer):
    """FP8 (E4M3 or E5M2) with one float32 scale per tensor, saturating (Transformer Engine's recipes).

    ``scaling="current"`` scales by this tensor's own amax; ``"delayed"`` by the amax history of the previous
    steps (``history`` steps, reduced by ``reduction``: "max" or "most_recent"), recording this tensor's amax
    while training. The history is a submodule's buffer, so it lands in the model's state_dict and a resumed run
    goes on with the same scales.
    """

    def __init__(self, element: str, scaling: str, margin: int = 0, history: int = 1, reduction: str = "max",
                 rounding: str = "nearest") -> None:
        super().__init__()
        self.element, self.margin, self.rounding = ELEMENTS[element], margin, rounding
        self.fmt = f"fp8_{element}"
        self.history = fp8_scaling.AmaxHistory(history, reduction) if scaling == "delayed" else None

    def scale_bits_per_element(self) -> float:
        return TENSOR_SCALE_BITS / self.elements if self.elements else 0.0

    def forward(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self.elements, self.used_scale = x.numel(), self._scale(x)
        out = fp8_scaling.scaled_fp8(x, self.element, self.used_scale, self.rounding)
        if self.history is not None and self.training:
            self.history.record(x.detach().abs().amax())
        return out

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        """This step's scale: from the amax history (delayed), else from ``x``'s own amax (current scaling)."""
        if self.history is not None:
            return self.history.scale(self.element, self.margin)
        amax = x.detach().abs().amax() if x.numel() else torch.zeros((), device=x.device)
        return fp8_scaling.fp8_scale(amax, self.element, self.margin)

    def quantize(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return fp8_scaling.scaled_fp8(x, self.element, self._scale(x), self.rounding)

    def requantize(self, x: torch.Tensor, dim: int, scale: torch.Tensor | None) -> torch.Tensor:
        return fp8_scaling.scaled_fp8(x, self.element, scale, self.rounding)


class BlockScaled(ScaledQuantizer):
    """An OCP MX format (blocks of 32, E8M0 scales) or NVFP4 (blocks of 16, E4M3 scales and a float32 one per
    tensor), blocked along the GEMM's reduction dimension; NVFP4 weights may use 16 x 16 blocks (``two_d``)."""

    per_gemm = True

    def __init__(self, fmt: str, rounding: str = "nearest", two_d: bool = False, scale_rule: str = "floor") -> None:
        """``scale_rule``: an MX format's shared exponent (:data:`qtrain.quant.choices.MX_SCALE_RULES`); NVFP4 has its own."""
        super().__init__()
        if fmt not in BLOCK_FORMATS:
            raise ValueError(f"block format {fmt!r} is not one of {BLOCK_FORMATS}")
        if two_d and fmt != "nvfp4":
            raise ValueError(f"2-D blocks are NVFP4's weight recipe, not {fmt}'s")
        self.fmt, self.rounding, self.two_d, self.scale_rule = fmt, rounding, two_d, scale_rule
        self.per_gemm = not two_d  # a 16 x 16 block is the same block in the weight and its transpose: quantized once
        self.element = ELEMENTS["e2m1" if fmt == "nvfp4" else MX_ELEMENTS_OF[fmt]]

    def scale_bits_per_element(self) -> float:
        if self.fmt != "nvfp4":
            return microscaling.SCALE_BITS / microscaling.MX_BLOCK
        # 16 x 16 weight tiles share a scale, yet the format stores one per 16 elements (Transformer Engine's layout,
        # what an NVFP4 GEMM reads): a tile's 16 scales are equal, not fewer
        return microscaling.SCALE_BITS / microscaling.NVFP4_BLOCK + (TENSOR_SCALE_BITS / self.elements if self.elements else 0.0)

    def quantize(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.two_d:  # tiles over the output and input channels (dims 0 and 1), for a convolution's kernel too
            moved = x.movedim((0, 1), (-2, -1))
            return microscaling.nvfp4_quantize(moved, -1, rounding=self.rounding, two_d=True).movedim((-2, -1), (0, 1))
        if self.fmt == "nvfp4":
            return microscaling.nvfp4_quantize(x, dim, rounding=self.rounding)
        return microscaling.mx_quantize(x, MX_ELEMENTS_OF[self.fmt], dim, rounding=self.rounding, scale_rule=self.scale_rule)


class Bfloat16(ScaledQuantizer):
    """bfloat16 operands, unscaled (round half to even, as torch's cast): a layer that a recipe keeps in 16-bit."""

    fmt = "bf16"

    @property
    def bits(self) -> float:
        return 16.0

    def datapath_bits(self) -> float:
        return math.nan

    def quantize(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.to(torch.bfloat16).to(x.dtype)
