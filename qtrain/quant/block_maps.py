"""Block floating point under a per-block bit-width map, with per-block sensitivities (DYNASTY Sec. 3.1-3.2):
the weight's and the activation's quantizers by map (:class:`WeightMap`, :class:`ActivationMap`) and the backward
observer that adds up each block's eq. 1 sensitivity (:class:`Sensitivity`). The layouts: docs/formats.md."""

from __future__ import annotations

import math

import torch
from torch import nn

from qtrain.quant import formats
from qtrain.quant.choices import DYNASTY_STATIC_BITS as STATIC_BITS
from qtrain.quant.formats import Rounding
from qtrain.quant.quantizers import Quantizer
from qtrain.quant.rounding import fused, pow2_float64

BLOCK = 4
WEIGHT_DIMS = (0, 1)  # (C_out, C_in, ...): C_out x C_in blocks at each kernel position

Dims = tuple[int, int]


def operand_dims(layer: nn.Module) -> Dims:
    """The dimensions that the blocks of ``layer``'s activation and ``grad_output`` span: batch x channels.

    A Conv2d's (N, C, H, W): (0, 1), at each spatial position; a Linear's (N, ..., C): (0, -1), at each
    index of the middle dimensions (a Transformer's tokens).
    """
    return (0, 1) if isinstance(layer, nn.Conv2d) else (0, -1)


def tile_count(x: torch.Tensor, dims: Dims) -> int:
    """How many 4 x 4 blocks over ``dims`` ``x`` has (the length of its map)."""
    return math.prod(formats.tile_grid(x.shape, BLOCK, dims))


def block_ranges(max_abs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's exponent e = E + 1 (2^e bounds its finite magnitudes) and whether it holds a non-zero value."""
    return formats.block_exponent(max_abs) + 1, max_abs > 0


@fused
def sensitivity(square_sums: torch.Tensor, exponent: torch.Tensor, nonzero: torch.Tensor) -> torch.Tensor:
    """Eq. 1 from each block's sum of squared gradients: ``(2^e)^2 / 16 * sum_j g_j^2`` (float64), 0 for zero blocks."""
    return torch.where(nonzero, square_sums.double() * pow2_float64(2 * exponent - 4), 0.0)


class BlockMapped(Quantizer):
    """Shared state of a mapped operand: its bit-width map and its sensitivity accumulator (float64)."""

    fmt = "block-fp-map"
    bits = STATIC_BITS  # the widest a block gets; the method's record carries the map's shares

    def __init__(self, rounding: Rounding, initial_bits: int, dims: Dims = WEIGHT_DIMS) -> None:
        super().__init__()
        self.rounding, self.initial_bits, self.dims = rounding, initial_bits, dims
        self.map: torch.Tensor | None = None
        self.sensitivity: torch.Tensor | None = None

    def allocate(self, blocks: int, device: torch.device) -> None:
        """A map of ``blocks`` entries at the initial width and a zero accumulator, where none exists yet."""
        if self.map is None:
            self.map = torch.full((blocks,), self.initial_bits, dtype=torch.int32, device=device)
        if self.sensitivity is None:
            self.sensitivity = torch.zeros(blocks, dtype=torch.float64, device=device)

    def accumulate(self, grad: torch.Tensor, exponent: torch.Tensor, nonzero: torch.Tensor) -> None:
        """Add eq. 1 of the blocks of ``grad`` (the gradient w.r.t. this operand) to the first accumulator rows."""
        sums = formats.tile_square_sums(grad, BLOCK, self.dims)
        self.sensitivity[: sums.shape[0]] += sensitivity(sums, exponent, nonzero)

    def extra_repr(self) -> str:
        return f"block={BLOCK}, dims={self.dims}, rounding={self.rounding}"


class WeightMap(BlockMapped):
    """The weight quantized per block by its map; remembers its last blocks' exponents for the sensitivity."""

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        self.allocate(tile_count(x, self.dims), x.device)
        out, max_abs = formats.tile_floating_point(x, self.map, self.rounding, BLOCK, self.dims)
        self.last_range = block_ranges(max_abs)
        return out


class ActivationMap(BlockMapped):
    """The activation at 8 bits for the forward GEMM (by its map with ``in_forward``), and by its map for the
    weight-gradient GEMM.

    ``batch_size`` (set before the first training step) sizes the map for a full batch; ``dims`` starts with
    the batch (0), so the blocks of the first samples come first in the map. The map covers the rows of a
    training batch, so a forward without gradients (evaluation) takes the activation at 8 bits either way.
    """

    batch_size: int = 0
    sample_shape: tuple[int, ...] | None = None  # of the samples the map was made for (set by the first batch)

    def __init__(self, rounding: Rounding, initial_bits: int, dims: Dims = WEIGHT_DIMS, in_forward: bool = False) -> None:
        super().__init__(rounding, initial_bits, dims)
        self.in_forward = in_forward

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return formats.block_floating_point(x, STATIC_BITS, self.rounding, BLOCK, self.dims)

    def compact(self, x: torch.Tensor, bits: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        if bits is not None:
            raise ValueError("DYNASTY's activation map has no per-sample bit-widths")
        sample_blocks, channel_blocks, positions = formats.tile_grid(x.shape, BLOCK, self.dims)
        rows = sample_blocks * channel_blocks * positions
        self.allocate(-(-max(self.batch_size, x.shape[0]) // BLOCK) * channel_blocks * positions, x.device)
        if self.map.shape[0] < rows:
            raise ValueError(f"a batch of {x.shape[0]} is larger than the {self.batch_size} the activation map was sized for")
        sample_shape = tuple(x.shape[1:])
        if self.sample_shape not in (None, sample_shape):  # the map's blocks would land on other positions
            raise ValueError(f"samples of shape {sample_shape} do not fit the activation map made for {self.sample_shape}")
        self.sample_shape, self.last_rows = sample_shape, rows
        kept, max_abs = formats.tile_codes(x, self.map[:rows], self.rounding, BLOCK, self.dims)
        saved = (*kept, *block_ranges(max_abs))
        if self.in_forward:  # the one mapped activation in both GEMMs (decoded from the codes the backward keeps)
            return self.expand(saved, x.shape), saved
        static, _ = formats.tile_floating_point(x, STATIC_BITS, self.rounding, BLOCK, self.dims, max_abs)
        return static, saved

    def expand(self, saved: tuple[torch.Tensor, ...], shape: torch.Size) -> torch.Tensor:
        """The mapped activation, from its int8 codes and the blocks' steps (or as saved, where it held NaN or inf)."""
        kept = saved[:-2]
        return formats.tile_decode(*kept, shape, self.dims) if len(kept) == 2 else kept[0]


class Sensitivity(nn.Module):
    """The backward observer of a DYNASTY layer: eq. 1 for the weight's and the activation's blocks.

    Called with the gradients w.r.t. the layer's input and weight (the input's is computed also where
    the layer is the first, whose input needs none) and what :meth:`ActivationMap.compact` saved.
    """

    def __init__(self, weight: WeightMap, act: ActivationMap) -> None:
        super().__init__()
        self.maps = (weight, act)  # a tuple: not submodules a second time

    def forward(self, grad_input: torch.Tensor, grad_weight: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> None:
        weight, act = self.maps
        weight.accumulate(grad_weight, *weight.last_range)
        act.accumulate(grad_input, *saved[-2:])  # the activation blocks' exponents and non-zero flags
