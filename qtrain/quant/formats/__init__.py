"""Number formats as pure tensor functions, one module per family (the grids, rounding and their checks:
docs/formats.md): :mod:`.fixed_point` (QPyTorch's <WL, FL>, MuPPET's dynamic fixed point), :mod:`.range_linear`
(SBM's), :mod:`.block_floating_point` (a shared exponent per block or tile), :mod:`.floating_point` (the IEEE grid).
Each takes ``rounding`` = "nearest" (half to even) or "stochastic" and runs as one fused kernel.
"""

from qtrain.quant.formats.block_floating_point import (
    TILE_DIMS,
    block_exponent,
    block_floating_point,
    tile_codes,
    tile_decode,
    tile_floating_point,
    tile_grid,
    tile_square_sums,
    tile_sums,
    tile_view,
)
from qtrain.quant.formats.fixed_point import (
    decode_fixed_point_codes,
    dynamic_fixed_point,
    fixed_point,
    fixed_point_candidates,
    fixed_point_codes,
    fixed_point_with_mask,
)
from qtrain.quant.formats.floating_point import float_grid, floating_point
from qtrain.quant.formats.range_linear import (
    GRANULARITIES,
    Granularity,
    code_dtype,
    decode_codes,
    range_linear,
    range_linear_codes,
    range_linear_from_data,
    range_linear_two_widths,
    tensor_range,
)
from qtrain.quant.rounding import Rounding

__all__ = [
    "GRANULARITIES", "TILE_DIMS", "Granularity", "Rounding", "block_exponent", "block_floating_point", "code_dtype",
    "decode_codes", "decode_fixed_point_codes", "dynamic_fixed_point", "fixed_point", "fixed_point_candidates",
    "fixed_point_codes", "fixed_point_with_mask", "float_grid", "floating_point", "range_linear", "range_linear_codes",
    "range_linear_from_data", "range_linear_two_widths", "tensor_range", "tile_codes", "tile_decode",
    "tile_floating_point", "tile_grid", "tile_square_sums", "tile_sums", "tile_view",
]
