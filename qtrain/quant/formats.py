"""Number formats as pure tensor functions (DESIGN.md, "Quantization core").

- fixed point <WL, FL>: step 2^-FL, range [-2^(WL-FL-1), 2^(WL-FL-1) - 2^-FL] (QPyTorch's grid);
- range-linear (SBM, Banner et al. 2018): 2^b levels from lo to hi, zero point at lo, with lo/hi
  per tensor, per output channel or the mean of per-sample ranges (:func:`tensor_range`);
- block floating point: one power-of-two exponent per block (the whole tensor or k x k tiles of two
  dimensions), WL-bit signed mantissas, QPyTorch's grid (step 2^(E+2-WL) for block maximum in
  [2^E, 2^(E+1)), magnitudes up to 2^(E+1) - step);
- float <exp, man>: QPyTorch's emulation (exponent range [2 - 2^(exp-1), 2^(exp-1)], no codes
  reserved for inf/NaN, subnormals share the smallest exponent, overflow clamps to the largest value).

Each takes ``rounding`` = "nearest" (round half to even) or "stochastic" (``floor(t + u)``).
"""

from __future__ import annotations

from typing import Literal

import torch

from qtrain.quant.rounding import fused, grid_round, key_for, round_to_grid

Rounding = Literal["nearest", "stochastic"]
Granularity = Literal["tensor", "channel", "sample_mean"]
ROUNDINGS = ("nearest", "stochastic")
GRANULARITIES = ("tensor", "channel", "sample_mean")


def _stochastic(rounding: Rounding) -> bool:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding {rounding!r} is not one of {ROUNDINGS}")
    return rounding == "stochastic"


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full((1, 1), value, dtype=like.dtype, device=like.device)


def fixed_point(x: torch.Tensor, wl: int, fl: int, rounding: Rounding = "nearest", symmetric: bool = False) -> torch.Tensor:
    """Quantize to signed fixed point with ``wl`` bits in all, ``fl`` of them fractional."""
    qmax = 2.0 ** (wl - 1) - 1
    qmin = -qmax if symmetric else -(2.0 ** (wl - 1))
    flat = x.reshape(1, -1)
    out = round_to_grid(flat, _const(2.0**fl, x), _const(0.0, x), qmin, qmax, _stochastic(rounding))
    return out.view_as(x)


def tensor_range(x: torch.Tensor, granularity: Granularity) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) of ``x`` as ``(rows, 1)`` tensors: one row per tensor, or per slice of dimension 0.

    "channel" gives one range per output channel (dim 0 of a weight); "sample_mean" the mean over
    the batch (dim 0) of each sample's min and max, one range for the whole tensor.
    """
    if granularity == "tensor":
        lo, hi = torch.aminmax(x)
        return lo.reshape(1, 1), hi.reshape(1, 1)
    if granularity not in GRANULARITIES:
        raise ValueError(f"range granularity {granularity!r} is not one of {GRANULARITIES}")
    rows = x.reshape(x.shape[0], -1)
    lo, hi = rows.amin(1, keepdim=True), rows.amax(1, keepdim=True)  # 5x faster than aminmax(dim=1) on CPU
    if granularity == "sample_mean":
        return lo.mean().reshape(1, 1), hi.mean().reshape(1, 1)
    return lo, hi


def _range_linear(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bounds: torch.Tensor, key: torch.Tensor, stochastic: bool
) -> torch.Tensor:
    scale = bounds[1] / (hi - lo).clamp_min(1e-30)
    rows = x.reshape(lo.shape[0], -1)
    return grid_round(rows, scale, lo * scale, bounds, key, stochastic).view_as(x)


_range_linear_fused = fused(_range_linear)


@fused
def _range_linear_from_data(
    x: torch.Tensor, bounds: torch.Tensor, key: torch.Tensor, *, granularity: Granularity, stochastic: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lo, hi = tensor_range(x, granularity)
    return _range_linear(x, lo, hi, bounds, key, stochastic), lo, hi


def _levels(bits: int, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([0.0, 2.0**bits - 1], dtype=like.dtype, device=like.device)


def range_linear(x: torch.Tensor, bits: int, lo: torch.Tensor, hi: torch.Tensor, rounding: Rounding = "nearest") -> torch.Tensor:
    """Affine quantization onto ``2^bits`` levels from ``lo`` to ``hi`` (both exactly representable).

    As in the SBM reference code: ``step = (hi - lo) / (2^b - 1)``, code ``clamp(round((x - lo) / step),
    0, 2^b - 1)``, value ``code * step + lo``. ``lo``/``hi`` are ``(rows, 1)``: one row for the whole
    tensor, or one per slice of dimension 0.
    """
    stochastic = _stochastic(rounding)
    return _range_linear_fused(x, lo, hi, _levels(bits, x), key_for(stochastic, x.device), stochastic=stochastic)


def range_linear_from_data(
    x: torch.Tensor, bits: int, granularity: Granularity, rounding: Rounding = "nearest"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`range_linear` over ``x``'s own range (:func:`tensor_range`), in one fused kernel.

    Returns the quantized tensor and the range ``(lo, hi)`` it used.
    """
    stochastic = _stochastic(rounding)
    if granularity not in GRANULARITIES:
        raise ValueError(f"range granularity {granularity!r} is not one of {GRANULARITIES}")
    key = key_for(stochastic, x.device)
    return _range_linear_from_data(x, _levels(bits, x), key, granularity=granularity, stochastic=stochastic)


def _block_scale(max_abs: torch.Tensor, wl: int) -> torch.Tensor:
    """1 / step for blocks whose largest magnitude is ``max_abs`` (QPyTorch's block grid)."""
    exponent = torch.frexp(max_abs).exponent - 1  # floor(log2(max_abs)); 0 -> -1, harmless
    return torch.exp2((wl - 2 - exponent.clamp_min(-100)).to(max_abs.dtype))


def _to_tiles(x: torch.Tensor, block: int, dims: tuple[int, int]) -> tuple[torch.Tensor, tuple]:
    """View ``x`` as rows of ``block x block`` tiles over ``dims`` (zero-padded at the edges)."""
    moved = x.movedim(dims, (0, 1))
    a, b = moved.shape[:2]
    rest = moved.reshape(a, b, -1)
    pa, pb = -a % block, -b % block
    rest = torch.nn.functional.pad(rest, (0, 0, 0, pb, 0, pa))
    na, nb, r = (a + pa) // block, (b + pb) // block, rest.shape[2]
    tiles = rest.reshape(na, block, nb, block, r).permute(0, 2, 4, 1, 3).reshape(-1, block * block)
    return tiles, (moved.shape, a, b, na, nb, r)


def _from_tiles(tiles: torch.Tensor, block: int, dims: tuple[int, int], layout: tuple) -> torch.Tensor:
    moved_shape, a, b, na, nb, r = layout
    rest = tiles.reshape(na, nb, r, block, block).permute(0, 3, 1, 4, 2).reshape(na * block, nb * block, r)
    return rest[:a, :b].reshape(moved_shape).movedim((0, 1), dims)


def block_floating_point(
    x: torch.Tensor,
    wl: int,
    rounding: Rounding = "nearest",
    block: int | None = None,
    dims: tuple[int, int] = (0, 1),
) -> torch.Tensor:
    """Block floating point with ``wl``-bit signed mantissas and one shared exponent per block.

    ``block=None`` shares one exponent over the whole tensor; ``block=k`` over each k x k tile of
    dimensions ``dims`` (separately for every index of the other dimensions).
    """
    qmax = 2.0 ** (wl - 1) - 1
    if block is None:
        flat = x.reshape(1, -1)
        scale = _block_scale(flat.abs().amax().reshape(1, 1), wl)
        out = round_to_grid(flat, scale, torch.zeros_like(scale), -qmax, qmax, _stochastic(rounding))
        return out.view_as(x)
    tiles, layout = _to_tiles(x, block, dims)
    scale = _block_scale(tiles.abs().amax(dim=1, keepdim=True), wl)
    out = round_to_grid(tiles.contiguous(), scale, torch.zeros_like(scale), -qmax, qmax, _stochastic(rounding))
    return _from_tiles(out, block, dims, layout)


def floating_point(x: torch.Tensor, exp: int, man: int, rounding: Rounding = "nearest") -> torch.Tensor:
    """Emulate a float with ``exp`` exponent and ``man`` mantissa bits inside float32."""
    e_max, e_min = 2 ** (exp - 1), 2 - 2 ** (exp - 1)
    largest = min(2.0**e_max * (2 - 2.0**-man), torch.finfo(x.dtype).max)
    exponent = (torch.frexp(x).exponent - 1).clamp_min(e_min)
    scale = torch.exp2((man - exponent).to(x.dtype)).reshape(-1, 1)
    out = round_to_grid(x.reshape(-1, 1), scale, torch.zeros_like(scale), -float("inf"), float("inf"), _stochastic(rounding))
    return out.view_as(x).clamp(-largest, largest)
