"""Block floating point: one power-of-two exponent per block (the tensor, k x k tiles, or one dimension's index),
and the tiles' codes, square sums and grid that DYNASTY's block maps read (docs/formats.md)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from qtrain.quant.rounding import (
    Rounding,
    device_constant,
    fused,
    is_stochastic,
    key_for,
    pow2,
    pow2_float64,
    round_codes,
    scale_pow2,
)


def block_exponent(max_abs: torch.Tensor) -> torch.Tensor:
    """E = floor(log2(m)) of each block's largest finite magnitude ``m`` (int32; -1 where m = 0)."""
    return torch.frexp(max_abs).exponent - 1


def _finite_max(x: torch.Tensor) -> torch.Tensor:
    """Each block's largest finite magnitude: blocks per index of dimension 1 of a 3-D ``x`` (over dimensions 0
    and 2), or per tile of a 5-D one (:func:`tile_view`)."""
    return torch.where(x.abs() < math.inf, x.abs(), 0.0).amax(dim=(0, 2) if x.dim() == 3 else TILE_DIMS, keepdim=True)


def _halves(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2^k as two float32 factors (:func:`~qtrain.quant.rounding.scale_pow2`'s), so k in [-252, 252] never overflows."""
    half = k >> 1
    return pow2(half), pow2(k - half)


def _block_steps(max_abs: torch.Tensor, wl: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per block, as float32 factors: 2^k that takes values to codes (the step is 2^-k = 2^(E + 2 - wl), E at least
    ``wl - 151`` so that the step stays >= 2^-149) and 2^-k back, each as two halves, and the largest code
    (negative for a skipped, 0-bit block)."""
    k = wl - 2 - block_exponent(max_abs).clamp_min(wl - 151)
    qmax = (pow2(wl - 1) - 1).expand(max_abs.shape)  # block-shaped always: one compiled kernel serves every width
    return (*_halves(k), *_halves(-k), qmax)


@fused
def _block_factors(x: torch.Tensor, wl: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The blocks' maxima (:func:`_finite_max`) and their :func:`_block_steps`, in one kernel at block granularity."""
    max_abs = _finite_max(x)
    return max_abs, *_block_steps(max_abs, wl)


_block_steps_fused = fused(_block_steps)


@fused
def _block_quantize(x: torch.Tensor, up1: torch.Tensor, up2: torch.Tensor, down1: torch.Tensor, down2: torch.Tensor,
                    qmax: torch.Tensor, key: torch.Tensor, *, stochastic: bool) -> torch.Tensor:
    """The elements of ``x`` on their blocks' grids (the factors of :func:`_block_steps`, broadcast over the
    blocks); a block whose ``qmax`` is negative (width 0) becomes zero, whatever it held."""
    codes = torch.clamp(round_codes(x * up1 * up2, key, stochastic=stochastic), -qmax, qmax)
    out = torch.where(x.abs() < math.inf, codes * down1 * down2, x)
    return torch.where(qmax >= 0, out, 0.0)


def _blocks(x: torch.Tensor, wl: torch.Tensor, key: torch.Tensor, stochastic: bool,
            max_abs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block floating point of ``x`` (3-D or 5-D, :func:`_finite_max`) at ``wl`` (one width, or one per block in
    the shape of the blocks' maxima); returns the result and the maxima.

    Two kernels, so the per-block factors are computed once per block and not for every element.
    """
    if max_abs is None:
        max_abs, *factors = _block_factors(x, wl)
    else:
        factors = _block_steps_fused(max_abs, wl)
    return _block_quantize(x, *factors, key, stochastic=stochastic), max_abs


TILE_DIMS = (1, 3)  # the dimensions a k x k tile spans in the view of :func:`tile_view`


def tile_view(x: torch.Tensor, block: int, dims: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, Callable]:
    """``x`` as ``(na, k, nb, k, r)``: k x k tiles over ``dims`` (zero-padded at the edges) for every index r of
    the other dimensions, and the function that takes a tensor of that shape back to ``x``'s layout.

    Where ``dims`` are the first two and need no padding, the view shares ``x``'s memory (no copy). The
    tiles, flattened as ``(na, nb, r)``, run over ``dims[0]`` outermost, then ``dims[1]``, then the rest:
    the order of a per-tile width map.
    """
    moved = x.movedim(dims, (0, 1))
    a, b = moved.shape[:2]
    rest = moved.reshape(a, b, -1)
    pa, pb = -a % block, -b % block
    if pa or pb:
        rest = torch.nn.functional.pad(rest, (0, 0, 0, pb, 0, pa))
    na, nb, r = (a + pa) // block, (b + pb) // block, rest.shape[2]
    return rest.reshape(na, block, nb, block, r), lambda y: _untile(y, x.shape, dims)


def _moved_shape(shape: torch.Size, dims: tuple[int, int]) -> torch.Size:
    """``shape`` with ``dims`` (negative ones counted from the end) moved to the front, the rest in order."""
    dims = tuple(d % len(shape) for d in dims)
    return torch.Size([shape[d] for d in dims]) + torch.Size(s for i, s in enumerate(shape) if i not in dims)


def tile_grid(shape: torch.Size, block: int, dims: tuple[int, int] = (0, 1)) -> tuple[int, int, int]:
    """``(na, nb, r)`` of :func:`tile_view` for a tensor of ``shape``: tiles along each of ``dims``, other indices."""
    a, b, *rest = _moved_shape(shape, dims)
    return -(-a // block), -(-b // block), math.prod(rest)


def _untile(tiles: torch.Tensor, shape: torch.Size, dims: tuple[int, int]) -> torch.Tensor:
    """A ``(na, k, nb, k, r)`` tensor (:func:`tile_view`) back in the layout of a tensor of ``shape``."""
    moved = _moved_shape(shape, dims)
    na, k, nb, _, r = tiles.shape
    return tiles.reshape(na * k, nb * k, r)[: moved[0], : moved[1]].reshape(moved).movedim((0, 1), dims)


def tile_sums(x: torch.Tensor, block: int, dims: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """The sum of each k x k tile of ``x`` (:func:`tile_view`), flat in the tiles' order."""
    return tile_view(x, block, dims)[0].sum(dim=TILE_DIMS).reshape(-1)


def _wl(wl: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    return wl.to(device=device, dtype=torch.int32) if isinstance(wl, torch.Tensor) else device_constant(wl, torch.int32, device)


def block_floating_point(
    x: torch.Tensor,
    wl: int,
    rounding: Rounding = "nearest",
    block: int | None = None,
    dims: tuple[int, int] = (0, 1),
    dim: int | None = None,
) -> torch.Tensor:
    """Block floating point with ``wl``-bit signed mantissas and one shared exponent per block.

    Blocks: the whole tensor (``block=None, dim=None``); each k x k tile of dimensions ``dims``
    (``block=k``, separately for every index of the other dimensions); or, as QPyTorch's ``dim``,
    each index of dimension ``dim`` (the maximum over all other dimensions; ``dim=-1`` is the last
    dimension here, where QPyTorch's -1 means the whole tensor).

    The exponent E comes from the largest finite magnitude in the block; NaN and ±inf elements pass
    through unchanged and do not set it (one overflowed element does not flush its block to zero).
    E is at least ``wl - 151``, so the step never falls below float32's smallest subnormal and tiny
    blocks keep their values.
    """
    if block is not None and dim is not None:
        raise ValueError("block floating point takes k x k tiles (block) or per-slice exponents (dim), not both")
    if x.numel() == 0:
        return x.clone()
    if block is not None:
        return tile_floating_point(x, wl, rounding, block, dims)[0]
    if dim is None:
        rows = x.reshape(1, 1, -1)
    else:
        d = dim % x.dim()
        rows = x.reshape(math.prod(x.shape[:d]), x.shape[d], -1)
    stochastic = is_stochastic(rounding)
    out, _ = _blocks(rows, _wl(wl, x.device), key_for(stochastic, x.device), stochastic)
    return out.view_as(x)


def _tile_widths(wl: int | torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``wl`` as int32, one for all tiles or reshaped to the tiles of ``view`` (:func:`tile_view`)."""
    widths = _wl(wl, view.device)
    na, _, nb, _, r = view.shape
    return widths.reshape(na, 1, nb, 1, r) if widths.dim() else widths


def tile_floating_point(
    x: torch.Tensor,
    wl: int | torch.Tensor,
    rounding: Rounding = "nearest",
    block: int = 4,
    dims: tuple[int, int] = (0, 1),
    max_abs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block floating point on the k x k tiles of ``dims`` (:func:`tile_view`) at a width per tile or one for all.

    ``wl`` is one width or an integer tensor with one per tile in the tiles' order (DYNASTY's bit-width
    map); tiles of width 0 become zero (a skipped block). Returns the result and each tile's largest
    finite magnitude (flat, in the tiles' order); given those maxima (``max_abs``), it does not find them again.
    """
    view, back = tile_view(x, block, dims)
    stochastic = is_stochastic(rounding)
    given = None if max_abs is None else max_abs.reshape(view.shape[0], 1, view.shape[2], 1, view.shape[4])
    out, found = _blocks(view, _tile_widths(wl, view), key_for(stochastic, x.device), stochastic, given)
    return back(out), found.reshape(-1)


def _finite_squares(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The squares of ``x``'s finite elements (0 elsewhere) taken in float32 after scaling by 2^-k, and k: the power
    of two that brings the largest finite magnitude to [1, 2)."""
    finite = x.abs() < math.inf
    k = block_exponent(torch.where(finite, x.abs(), 0.0).amax())
    return scale_pow2(torch.where(finite, x, 0.0), -k).square(), k


_fused_finite_squares = fused(_finite_squares)


@fused
def _square_sums_by_rows(view: torch.Tensor) -> torch.Tensor:
    """Each tile's sum of squares (:func:`tile_square_sums`): float64, each tile row left to right, then the rows
    top to bottom. That is the order torch's CPU sum over a tile view's two dimensions takes where the view
    has more than one tile across and tiles of at most 4 x 4 (a test holds it to torch's sum), so the compiled
    kernel gives the sums that an eager ``sum(dim=TILE_DIMS, dtype=float64)`` gave before it, bit for bit."""
    squares, k = _finite_squares(view)
    squares = squares.double()
    block = view.shape[1]
    rows = [functools.reduce(torch.add, [squares[:, i, :, j] for j in range(block)]) for i in range(block)]
    return functools.reduce(torch.add, rows) * pow2_float64(2 * k)


def tile_square_sums(x: torch.Tensor, block: int, dims: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """The sum of squares of each k x k tile's finite elements (float64, flat in the tiles' order).

    The squares are taken in float32 after scaling the tensor by a power of two that brings its largest
    magnitude to [1, 2), so tiny gradients do not underflow and large ones do not overflow, and summed
    in float64 in one fixed order (:func:`_square_sums_by_rows`), in compiled and eager runs alike. With one
    tile across, torch's sum reads a tile's two dimensions as one and sums them in an order of its own, as it
    does for tiles wider than 4 (it groups longer rows otherwise), and DYNASTY's results so far were computed
    with it: those cases keep it.
    """
    view = tile_view(x, block, dims)[0]
    if view.shape[2] > 1 and block <= 4:
        return _square_sums_by_rows(view).reshape(-1)
    squares, k = _fused_finite_squares(view)
    return squares.sum(dim=TILE_DIMS, dtype=torch.float64).reshape(-1) * pow2_float64(2 * k)


@fused
def _tile_codes(x: torch.Tensor, up1: torch.Tensor, up2: torch.Tensor, qmax: torch.Tensor, key: torch.Tensor, *,
                stochastic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_block_quantize`'s codes (the same draws), as int8, and whether every element was finite."""
    codes = torch.clamp(round_codes(x * up1 * up2, key, stochastic=stochastic), -qmax, qmax)
    finite = x.abs() < math.inf
    return torch.where(finite & (qmax >= 0), codes, 0.0).to(torch.int8), finite.all()


@fused
def _tile_decode(codes: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.float32) * step


def tile_codes(x: torch.Tensor, wl: int | torch.Tensor, rounding: Rounding = "nearest", block: int = 4,
               dims: tuple[int, int] = (0, 1)) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """:func:`tile_floating_point` at ``wl`` (at most 8 bits) kept compact: int8 codes (in the tiles' view) and each
    tile's step, a quarter of the memory, decoded exactly by :func:`tile_decode`; where ``x`` holds NaN or
    infinity (no code for them), the float result instead. Returns that and the tiles' maxima (flat).
    """
    view, back = tile_view(x, block, dims)
    stochastic = is_stochastic(rounding)
    key = key_for(stochastic, x.device)
    max_abs, up1, up2, down1, down2, qmax = _block_factors(view, _tile_widths(wl, view))
    codes, finite = _tile_codes(view, up1, up2, qmax, key, stochastic=stochastic)
    if not finite:
        return (back(_block_quantize(view, up1, up2, down1, down2, qmax, key, stochastic=stochastic)),), max_abs.reshape(-1)
    return (codes, torch.where(qmax > 0, down1 * down2, 0.0)), max_abs.reshape(-1)  # 2^-k >= 2^-149: an exact product


def tile_decode(codes: torch.Tensor, step: torch.Tensor, shape: torch.Size, dims: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """The tensor of ``shape`` whose :func:`tile_codes` are ``codes`` and ``step``."""
    return _untile(_tile_decode(codes, step), shape, dims)
