"""Number formats as pure tensor functions (the grids, rounding and their checks: docs/formats.md).

- fixed point <WL, FL> (QPyTorch's grid), with or without clamping or with the clamped elements' mask for
  a straight-through estimator; MuPPET's dynamic fixed point (a power-of-two scale per tensor); integer codes
  of a fixed-point tensor and their decoding for saved activations;
- range-linear (SBM): 2^b levels from lo to hi, per tensor, per output channel or the mean of per-sample
  ranges; integer codes and their decoding for saved activations;
- block floating point: one power-of-two exponent per block (tensor, k x k tiles, or one dimension's index);
- float <exp, man>: the IEEE 754 grid; <5,10> and <8,7> equal torch's float16 and bfloat16 casts bit for bit.

Each takes ``rounding`` = "nearest" (half to even) or "stochastic" and runs as one fused kernel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import torch

from qtrain.quant.choices import ROUNDINGS
from qtrain.quant.rounding import (
    device_constant,
    fused,
    key_for,
    lane_count,
    lane_keys,
    pow2,
    pow2_float64,
    round_codes,
    scale_pow2,
)

Rounding = Literal["nearest", "stochastic"]
Granularity = Literal["tensor", "channel", "sample_mean"]
GRANULARITIES = ("tensor", "channel", "sample_mean")


def _stochastic(rounding: Rounding) -> bool:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding {rounding!r} is not one of {ROUNDINGS}")
    return rounding == "stochastic"


def _fixed_point_math(x: torch.Tensor, scale: torch.Tensor, bounds: torch.Tensor, key: torch.Tensor, *, stochastic: bool,
                      clamp: bool, mask: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fixed point of ``x`` at ``scale`` (2^FL) and ``bounds`` (the code range), broadcast against each other.

    Stochastic draws are indexed by the elements of ``x``: where ``scale`` holds a column of formats,
    every row rounds an element with the same draw.
    """
    t = x * scale
    codes = round_codes(t, key, stochastic=stochastic, draws=x.shape)
    if clamp:
        out = torch.clamp(codes, bounds[0], bounds[1]) / scale
    else:  # from 2^23 steps up every float32 is on the grid: keep x (x * scale may have overflowed)
        out = torch.where(t.abs() >= 2.0**23, x, codes / scale)
    if not mask:
        return out
    return out, ~((codes < bounds[0]) | (codes > bounds[1]))


# Two kernels of one computation, so that neither recompiles for the other's shapes: a (1, n) tensor (or
# (1, rows, lanes), _in_lanes) at one format, and at a column of formats (AdaPT's PushDown).
_fixed_point_flat = fused(_fixed_point_math)
_fixed_point_rows = fused(_fixed_point_math)


def _fixed_point(x: torch.Tensor, scale: torch.Tensor, bounds: torch.Tensor, key: torch.Tensor, *, stochastic: bool,
                 clamp: bool, mask: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`_fixed_point_math` on ``x`` flattened, in rows of lanes where it can be (:func:`_in_lanes`: the same
    element indices, so the same stochastic draws)."""
    flat, key = _in_lanes(x.reshape(1, -1), stochastic, False, key)
    out = _fixed_point_flat(flat, scale, bounds, key, stochastic=stochastic, clamp=clamp, mask=mask)
    if mask:
        return out[0].view(x.shape), out[1].view(x.shape)
    return out.view(x.shape)


def _fixed_args(x: torch.Tensor, wl: int, fl: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    qmax = 2.0 ** (wl - 1) - 1
    qmin = -qmax if symmetric else -(2.0 ** (wl - 1))
    return device_constant(2.0**fl, x.dtype, x.device), device_constant((qmin, qmax), x.dtype, x.device)


def fixed_point(
    x: torch.Tensor, wl: int, fl: int, rounding: Rounding = "nearest", symmetric: bool = False, clamp: bool = True,
    key: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize to signed fixed point with ``wl`` bits in all, ``fl`` of them fractional.

    With ``clamp=False`` values beyond the range are rounded onto the grid but not clamped (QPyTorch's
    ``clamp=False``: the precision of the format without its range). NaN stays NaN; ±inf clamp to the
    ends of the range, or stay ±inf without clamping. Codes are float32: from ``wl = 26`` the top code
    ``2^(wl-1) - 1`` is not a float32 and the range's upper end rounds to ``2^(wl-1)``. ``key`` gives the
    stochastic draws (:func:`~qtrain.quant.rounding.key_for`; drawn here where None).
    """
    stochastic = _stochastic(rounding)
    scale, bounds = _fixed_args(x, wl, fl, symmetric)
    key = key_for(stochastic, x.device) if key is None else key.to(x.device)
    return _fixed_point(x, scale, bounds, key, stochastic=stochastic, clamp=clamp, mask=False)


def fixed_point_with_mask(
    x: torch.Tensor, wl: int, fl: int, rounding: Rounding = "nearest", symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fixed_point` (clamped) and a boolean mask of the elements it did not clamp.

    An element is clamped where its rounded code fell outside the range, as in QPyTorch's
    ``clamping_grad_zero``; the mask is where a straight-through gradient passes (NaN passes).
    """
    stochastic = _stochastic(rounding)
    scale, bounds = _fixed_args(x, wl, fl, symmetric)
    return _fixed_point(x, scale, bounds, key_for(stochastic, x.device), stochastic=stochastic, clamp=True, mask=True)


def fixed_point_candidates(
    x: torch.Tensor, wl: torch.Tensor, fl: torch.Tensor, rounding: Rounding = "stochastic", key: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` quantized at every <wl[i], fl[i]> at once: a ``(len(wl), x.numel())`` tensor, row i in <wl[i], fl[i]>.

    One batched kernel for a search over formats (AdaPT's PushDown); each row equals :func:`fixed_point`
    of ``x`` at its format (clamped) with the same key: every row rounds an element with the same draw,
    so formats that differ only in range give the same values wherever neither clamps. Passing the
    same ``key`` (:func:`~qtrain.quant.rounding.key_for`) to several calls gives them the same draws.
    """
    stochastic = _stochastic(rounding)
    fl = fl.to(torch.int32).reshape(-1, 1)
    half = scale_pow2(torch.ones_like(fl, dtype=x.dtype), wl.to(torch.int32).reshape(-1, 1) - 1)
    scale = scale_pow2(torch.ones_like(fl, dtype=x.dtype), fl)
    bounds = torch.stack([-half, half - 1])
    key = key_for(stochastic, x.device) if key is None else key
    flat, key = _in_lanes(x.reshape(1, -1), stochastic, False, key)
    if flat.dim() == 3:  # in lanes: each format's scale and bounds get a dimension to match
        scale, bounds = scale[..., None], bounds[..., None]
    out = _fixed_point_rows(flat, scale, bounds, key, stochastic=stochastic, clamp=True, mask=False)
    return out.reshape(out.shape[0], x.numel())


def _largest_scale(extreme: torch.Tensor, limit: float) -> torch.Tensor:
    """The largest integer ``s`` with ``extreme * 2^s <= limit``, exactly, for float32 ``extreme > 0`` and ``limit > 0``.

    With ``extreme = m·2^e`` and ``limit = M·2^E`` (mantissas in [0.5, 1)): ``s = E - e``, less one where
    ``m > M``. ``m`` and ``e`` are read from the float32 bits (a subnormal scaled by 2^64 first, exactly);
    ``m·2^24`` is an integer, so ``m > M`` is ``m·2^24 > floor(M·2^24)``: no quotient is rounded.
    """
    subnormal = extreme < 2.0**-126
    bits = torch.where(subnormal, extreme * 2.0**64, extreme).view(torch.int32)
    exponent = (bits >> 23) - 126 - subnormal.to(torch.int32) * 64
    significand = (bits & 0x7FFFFF) | 0x800000
    limit_mantissa, limit_exponent = math.frexp(limit)
    return limit_exponent - exponent - (significand > math.floor(limit_mantissa * 2**24)).to(torch.int32)


def _dynamic_scale(lo: torch.Tensor, hi: torch.Tensor, wl: int) -> torch.Tensor:
    """MuPPET's scale exponent from a tensor's finite min ``lo`` and max ``hi`` (:func:`dynamic_fixed_point`)."""
    half_range = 2.0 ** (wl - 1)
    upper = torch.where(hi > 0, _largest_scale(hi, half_range - 0.5), 127)
    lower = torch.where(lo < 0, _largest_scale(-lo, half_range + 0.5), 127)
    return torch.where((hi > 0) | (lo < 0), torch.minimum(upper, lower), 0).clamp(-126, 126)


def _fixed_codes(out: torch.Tensor, fl: torch.Tensor, *, code_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``out`` on the grid 2^-fl as integer codes, the step, and the code that stands for NaN
    (:func:`qtrain.quant.quantizers.fixed_codes` says how a NaN is saved)."""
    nan = out != out  # not isnan: Inductor's CPU code tests isnan one lane at a time
    lowest, highest = torch.iinfo(code_dtype).min, torch.iinfo(code_dtype).max
    # a grid whose top codes lie beyond float32 rounds the largest values to ±inf: clamped, their codes decode to
    # ±inf again (an infinity's conversion to an integer is undefined, and eager and compiled code differed there)
    codes = torch.where(nan, lowest, scale_pow2(out, fl).clamp(lowest, highest)).to(code_dtype)
    step = scale_pow2(torch.ones((), dtype=out.dtype, device=out.device), -fl)
    return codes, step, torch.where(nan.any(), lowest, torch.inf)  # float: a 0-dim int would take the codes' dtype


fixed_point_codes = fused(_fixed_codes)


@fused
def decode_fixed_point_codes(codes: torch.Tensor, step: torch.Tensor, nan_code: torch.Tensor) -> torch.Tensor:
    """The float32 tensor :func:`fixed_point_codes` encoded, exactly (NaN where a code equals ``nan_code``)."""
    values = codes.float()
    return torch.where(values == nan_code, torch.nan, values * step)


@fused
def _dynamic_fixed_point(rows: torch.Tensor, bounds: torch.Tensor, key: torch.Tensor, *, wl: int, stochastic: bool,
                         code_dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
    """One kernel: the range, the scale, the rounding and (with ``code_dtype``) the codes of MuPPET's dynamic fixed point."""
    lo, hi = _finite_bounds(rows.reshape(1, -1))
    fl = _dynamic_scale(lo.reshape(()), hi.reshape(()), wl)
    scale = scale_pow2(torch.ones((), dtype=rows.dtype, device=rows.device), fl)
    out = _fixed_point_math(rows, scale, bounds, key, stochastic=stochastic, clamp=True, mask=False)
    return (out, fl) if code_dtype is None else (out, fl, *_fixed_codes(out, fl, code_dtype=code_dtype))


def dynamic_fixed_point(x: torch.Tensor, wl: int, rounding: Rounding = "stochastic",
                        code_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """MuPPET's dynamic fixed point: <``wl``, s> with the scale exponent ``s`` found from ``x`` itself.

    ``s = floor(log2(min((UB + 0.5) / max X, (LB - 0.5) / min X)))`` (AdaPT paper Sec. 2.2, describing
    MuPPET) with ``UB = 2^(wl-1) - 1`` and ``LB = -2^(wl-1)``, over the finite values of ``x``: the
    largest power-of-two scale at which the tensor's extremes still round inside the ``wl``-bit range.
    A term whose extreme has the wrong sign (no positive or no negative values) does not bound it; a
    tensor of zeros gets ``s = 0``. ``s`` is kept in [-126, 126] so that ``2^s`` is a normal float32,
    and it is exact: no quotient is rounded (:func:`_largest_scale`). MuPPET's
    ``round(x * 2^s + U(-0.5, 0.5))`` is stochastic rounding (up with probability equal to the
    fraction), clamped to the ``wl``-bit range.

    Returns the float32 tensor and ``s`` (an int32 0-d tensor), and with ``code_dtype`` also its codes
    (:func:`fixed_point_codes`): the range, the scale, the rounding and the codes are one kernel.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"dynamic fixed point reads float32 bits; got a {x.dtype} tensor")
    stochastic = _stochastic(rounding)
    if x.numel() == 0:
        fl = torch.zeros((), dtype=torch.int32, device=x.device)
        return (x.clone(), fl) if code_dtype is None else (x.clone(), fl, *_fixed_codes(x, fl, code_dtype=code_dtype))
    bounds = device_constant((-(2.0 ** (wl - 1)), 2.0 ** (wl - 1) - 1), x.dtype, x.device)
    rows, key = _in_lanes(x.reshape(1, -1), stochastic, False, key_for(stochastic, x.device))
    out, fl, *codes = _dynamic_fixed_point(rows, bounds, key, wl=wl, stochastic=stochastic, code_dtype=code_dtype)
    return out.view(x.shape), fl, *([codes[0].view(x.shape), *codes[1:]] if codes else [])


def _rows(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """``x`` as a 2-D view: one row for "tensor", one per slice of dimension 0 otherwise."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"range granularity {granularity!r} is not one of {GRANULARITIES}")
    return x.reshape(1, -1) if granularity == "tensor" else x.reshape(x.shape[0], math.prod(x.shape[1:]))


def _finite_bounds(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of each row's finite values (NaN and ±inf do not widen the range), as ``(rows, 1)``."""
    finite = rows.abs() < math.inf
    # amin and amax apart: 5x faster than aminmax(dim=1) on the CPU
    lo = torch.where(finite, rows, math.inf).amin(1, keepdim=True)
    hi = torch.where(finite, rows, -math.inf).amax(1, keepdim=True)
    return lo, hi


_fused_bounds = fused(_finite_bounds)


def _mean(column: torch.Tensor) -> torch.Tensor:
    """Mean of a ``(rows, 1)`` column as ``(1, 1)``, taken about its first entry: exact when all are equal."""
    return column[:1] + (column - column[:1]).mean()


def _sample_mean_range(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean over rows of each row's finite min and max.

    The mean runs eagerly on the small ``(rows, 1)`` columns in every mode: a compiled reduction sums
    in another order, and the fused kernels must give the eager results bit for bit.
    """
    lo, hi = _fused_bounds(rows)
    return _mean(lo), _mean(hi)


def tensor_range(x: torch.Tensor, granularity: Granularity) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) of ``x``'s finite values as ``(rows, 1)`` tensors: one row per tensor, or per slice of dim 0.

    "channel" gives one range per output channel (dim 0 of a weight); "sample_mean" the mean over
    the batch (dim 0) of each sample's min and max, one range for the whole tensor.
    """
    rows = _rows(x, granularity)
    return _sample_mean_range(rows) if granularity == "sample_mean" else _finite_bounds(rows)


def _range_codes(
    rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: torch.Tensor, key: torch.Tensor, stochastic: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of ``rows`` on the grid of ``levels + 1`` points from ``lo`` to ``hi`` (per row), and the step.

    ``t = (x - lo) * (levels / (hi - lo))`` subtracts before it scales, so values far from zero keep
    their codes. A constant row (``hi == lo``) has step 0 and every code 0; a span below 2^-64 is
    scaled up by 2^64 (exactly) first, so that ``levels / span`` cannot overflow, and a span above the
    float32 range is halved (exactly), so that ``hi - lo`` cannot.
    """
    shrink = torch.where(torch.isinf(hi - lo), 0.5, 1.0)  # a span beyond float32 is taken in halves (exact)
    span = hi * shrink - lo * shrink
    boost = torch.where(span < 2.0**-64, 2.0**64, 1.0)
    inv = torch.where(span > 0, levels / (span * boost), 0.0)
    t = (rows.clamp(lo, hi) * shrink - lo * shrink) * boost * inv  # in [0, levels * (1 + 2^-23)]
    return torch.minimum(round_codes(t, key, stochastic=stochastic), levels), span / levels / shrink


def _affine(codes: torch.Tensor, step: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``codes * step + lo``; in halves where that overflows and the grid's value does not (a span near 2^128)."""
    out = codes * step + lo
    # |out| == inf rather than isinf: Inductor's CPU code tests isinf one lane at a time (3x this kernel's time)
    return torch.where(out.abs() == math.inf, (codes * (step * 0.5) + lo * 0.5) * 2, out)


def _column(v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A per-row ``(R, 1)`` (or 0-d) value shaped to broadcast against ``rows``, ``(R, D)`` or ``(R, D / L, L)``."""
    return v if v.dim() == 0 else v.reshape(v.shape[0], *[1] * (rows.dim() - 1))


def _grid(rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: torch.Tensor, key: torch.Tensor, *,
          stochastic: bool, code_dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
    """The values of ``rows`` on their grids, and the codes (as ``(R, D)``) and steps where ``code_dtype`` asks."""
    lo = _column(lo, rows)
    codes, step = _range_codes(rows, lo, _column(hi, rows), _column(levels, rows), key, stochastic)
    out = _affine(codes, step, lo)
    return (out,) if code_dtype is None else (out, codes.to(code_dtype).reshape(rows.shape[0], -1), step.reshape(-1, 1))


_range_linear = fused(_grid)  # the grid of given ranges, one kernel


@fused
def _range_linear_from_data(
    rows: torch.Tensor, levels: torch.Tensor, key: torch.Tensor, *, whole: bool, stochastic: bool,
    code_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, ...]:
    lo, hi = _finite_bounds(rows.reshape(1, -1) if whole else rows.reshape(rows.shape[0], -1))
    out, *compact = _grid(rows, lo, hi, levels, key, stochastic=stochastic, code_dtype=code_dtype)
    return out, lo, hi, *compact


@fused
def _range_linear_two_widths(rows: torch.Tensor, levels: torch.Tensor, other_levels: torch.Tensor, key: torch.Tensor,
                             other_key: torch.Tensor, *, stochastic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = _finite_bounds(rows.reshape(rows.shape[0], -1))
    return (_grid(rows, lo, hi, levels, key, stochastic=stochastic, code_dtype=None)[0],
            _grid(rows, lo, hi, other_levels, other_key, stochastic=stochastic, code_dtype=None)[0])


def _in_lanes(rows: torch.Tensor, stochastic: bool, per_row: bool, *keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``rows`` ``(R, D)`` as ``(R, D / L, L)`` where it can be read in lanes (:func:`~qtrain.quant.rounding.lane_count`),
    each key then made the key of each lane where the rounding draws; as they are otherwise. The draws are the same
    either way. Nearest rounding takes lanes too: Inductor's CPU code runs a ``(1, D)`` kernel that also reduces
    on one thread, and spreads rows of lanes over the threads.

    Not where the grid has a parameter per row (``per_row``: a range per channel, bits per sample): Inductor's
    CPU code for those in lanes took 16-18 ms for 2M elements against 3.3 ms without (per-sample bits).
    """
    lanes = lane_count(rows.numel(), rows.shape[1]) if not per_row else 1
    if lanes == 1:
        return rows, *keys
    return rows.reshape(rows.shape[0], -1, lanes), *(lane_keys(key, lanes) if stochastic else key for key in keys)


@fused
def _decode(codes: torch.Tensor, step: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return _affine(codes.to(step.dtype), step, lo)


Bits = int | torch.Tensor  # one bit-width, or an (N,) tensor: one per slice of dimension 0 (per sample)


def _levels(bits: Bits, like: torch.Tensor) -> torch.Tensor:
    """``2^bits - 1`` as a 0-d tensor, or as an ``(N, 1)`` column for per-sample bit-widths."""
    if isinstance(bits, torch.Tensor):
        return torch.exp2(bits.to(like.dtype)).sub_(1).view(-1, 1)
    return device_constant(2.0**bits - 1, like.dtype, like.device)


def _grid_rows(x: torch.Tensor, bits: Bits, granularity: Granularity) -> torch.Tensor:
    """The rows a range-linear call rounds: per sample where each sample has its own bit-width."""
    if not isinstance(bits, torch.Tensor):
        return _rows(x, granularity)
    if granularity == "channel":
        raise ValueError("per-sample bit-widths share one range: granularity 'tensor' or 'sample_mean', not 'channel'")
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def range_linear(x: torch.Tensor, bits: Bits, lo: torch.Tensor, hi: torch.Tensor, rounding: Rounding = "nearest") -> torch.Tensor:
    """Affine quantization onto ``2^bits`` levels from ``lo`` to ``hi``, values outside clamped to the ends.

    The SBM reference code's rule: ``step = (hi - lo) / (2^b - 1)``, code ``clamp(round((x - lo) *
    ((2^b - 1) / (hi - lo))), 0, 2^b - 1)``, value ``code * step + lo`` (the reference divides by ``step`` where
    this multiplies: at a near-tie the two can land a level apart, docs/methods/sbm.md). ``lo``/``hi`` are ``(rows, 1)``:
    one row for the whole tensor, or one per slice of dimension 0. A constant range (``hi == lo``)
    maps everything to ``lo``. NaN stays NaN; ±inf saturate to ``hi``/``lo`` like any value outside.
    ``bits`` may be an ``(N,)`` tensor: each sample (slice of dimension 0) on its own ``2^bits``
    levels of the one range ``lo``/``hi`` (``(1, 1)``).
    """
    stochastic = _stochastic(rounding)
    rows = x.reshape(x.shape[0], -1) if isinstance(bits, torch.Tensor) else x.reshape(lo.shape[0], -1)
    rows, key = _in_lanes(rows, stochastic, rows.shape[0] > 1, key_for(stochastic, x.device))  # bits or range per row
    return _range_linear(rows, lo, hi, _levels(bits, x), key, stochastic=stochastic, code_dtype=None)[0].view_as(x)


def _from_data(x: torch.Tensor, bits: Bits, granularity: Granularity, rounding: Rounding, dtype: torch.dtype | None) -> tuple:
    stochastic = _stochastic(rounding)
    rows = _grid_rows(x, bits, granularity)
    if rows.numel() == 0:  # no elements to take a range from: (0, 0)
        zero = x.new_zeros(1 if granularity == "sample_mean" or isinstance(bits, torch.Tensor) else rows.shape[0], 1)
        out = x.clone()
        return (out, zero, zero) if dtype is None else (out, zero, zero, rows.to(dtype), zero)
    levels = _levels(bits, x)
    if granularity != "sample_mean":  # range and grid in one kernel
        whole = isinstance(bits, torch.Tensor)  # per-sample rows, one range over all of them
        rows, key = _in_lanes(rows, stochastic, rows.shape[0] > 1, key_for(stochastic, x.device))
        return _range_linear_from_data(rows, levels, key, whole=whole, stochastic=stochastic, code_dtype=dtype)
    lo, hi = _sample_mean_range(rows)
    rows, key = _in_lanes(rows, stochastic, isinstance(bits, torch.Tensor), key_for(stochastic, x.device))
    out, *compact = _range_linear(rows, lo, hi, levels, key, stochastic=stochastic, code_dtype=dtype)
    return out, lo, hi, *compact


def range_linear_two_widths(
    x: torch.Tensor, bits: int, other_bits: int, granularity: Granularity, rounding: Rounding = "nearest"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``range_linear_from_data(x, bits, ...)[0]`` and ``range_linear_from_data(x, other_bits, ...)[0]``, the same
    bits and draws (the first call's key drawn first), from one kernel that finds the range once and reads ``x``
    once for both grids: SBM's FW-8/BW-16 bifurcation rounds each gradient at two widths. Granularity "tensor" or
    "channel"."""
    if granularity not in ("tensor", "channel"):
        raise ValueError(f"two widths over one range take granularity 'tensor' or 'channel', not {granularity!r}")
    stochastic = _stochastic(rounding)
    rows = _rows(x, granularity)
    if rows.numel() == 0:
        return x.clone(), x.clone()
    keys = [key_for(stochastic, x.device) for _ in range(2)]  # in the order of two calls
    rows, *keys = _in_lanes(rows, stochastic, rows.shape[0] > 1, *keys)
    out, other = _range_linear_two_widths(rows, _levels(bits, x), _levels(other_bits, x), *keys, stochastic=stochastic)
    return out.view_as(x), other.view_as(x)


def range_linear_from_data(
    x: torch.Tensor, bits: Bits, granularity: Granularity, rounding: Rounding = "nearest"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`range_linear` over ``x``'s own range (:func:`tensor_range`), fused.

    With per-sample ``bits`` (an ``(N,)`` tensor) the range is one over the whole tensor (its min and
    max, or for "sample_mean" the mean of the samples' ranges) and each sample rounds on its own grid.

    One kernel finds the range and rounds; "sample_mean" runs the per-sample bounds kernel, the mean
    over samples (eager, so that the fused and the eager path agree bit for bit) and the grid kernel.

    Returns the quantized tensor and the range ``(lo, hi)`` it used. The range spans the finite
    values; a constant tensor (or row) comes back unchanged, and a row with no finite value as NaN.
    """
    out, lo, hi = _from_data(x, bits, granularity, rounding, None)
    return out.view_as(x), lo, hi


def code_dtype(bits: int) -> torch.dtype | None:
    """The smallest integer dtype that holds range-linear codes of ``bits`` bits (None: none saves memory)."""
    return torch.uint8 if bits <= 8 else torch.int16 if bits <= 15 else None


def range_linear_codes(
    x: torch.Tensor, bits: Bits, granularity: Granularity, rounding: Rounding = "nearest", max_bits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Like :func:`range_linear_from_data`, plus the compact form ``(codes, step, lo)``.

    ``codes`` are integers of :func:`code_dtype` (1 byte each up to 8 bits), one row per row of the
    range; ``step`` is ``(hi - lo) / (2^bits - 1)`` per row. :func:`decode_codes` rebuilds the
    quantized tensor from them bit for bit (``codes * step + lo``), so backward can keep codes, not floats.
    Codes hold no NaN: a NaN element decodes to a value on the grid. Per-sample ``bits`` need
    ``max_bits``, a bound on them that sizes the codes (no host round trip to find it).
    """
    width = bits if not isinstance(bits, torch.Tensor) else max_bits
    if width is None:
        raise ValueError("per-sample bit-widths need max_bits to size their codes")
    dtype = code_dtype(width)
    if dtype is None:
        raise ValueError(f"range-linear codes of {width} bits do not fit a 16-bit integer")
    out, lo, hi, codes, step = _from_data(x, bits, granularity, rounding, dtype)
    return out.view_as(x), lo, hi, (codes, step, lo)


def decode_codes(compact: tuple[torch.Tensor, torch.Tensor, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The quantized tensor of shape ``shape`` that :func:`range_linear_codes` encoded."""
    return _decode(*compact).view(shape)


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
    stochastic = _stochastic(rounding)
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
    stochastic = _stochastic(rounding)
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
    stochastic = _stochastic(rounding)
    key = key_for(stochastic, x.device)
    max_abs, up1, up2, down1, down2, qmax = _block_factors(view, _tile_widths(wl, view))
    codes, finite = _tile_codes(view, up1, up2, qmax, key, stochastic=stochastic)
    if not finite:
        return (back(_block_quantize(view, up1, up2, down1, down2, qmax, key, stochastic=stochastic)),), max_abs.reshape(-1)
    return (codes, torch.where(qmax > 0, down1 * down2, 0.0)), max_abs.reshape(-1)  # 2^-k >= 2^-149: an exact product


def tile_decode(codes: torch.Tensor, step: torch.Tensor, shape: torch.Size, dims: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """The tensor of ``shape`` whose :func:`tile_codes` are ``codes`` and ``step``."""
    return _untile(_tile_decode(codes, step), shape, dims)


def float_grid(x: torch.Tensor, key: torch.Tensor, *, man: int, emin: int, emax: int, top: int, stochastic: bool,
               overflow: str) -> torch.Tensor:
    """``x`` (float32) rounded onto a binary floating-point grid with ``man`` mantissa bits.

    Normal exponents run from ``emin`` to ``emax``, with gradual underflow below ``2^emin`` (step
    ``2^(emin - man)``); the largest magnitude is ``top * 2^(emax - man)`` (``top = 2^(man+1) - 1`` on the
    IEEE grid, less where the top codes are reserved, as E4M3's NaN). ``overflow`` says where results
    beyond it go: "inf" (±inf, IEEE), "saturate_finite" (finite values to ±largest, ±inf stay) or
    "saturate" (±inf too). NaN stays NaN; a negative value rounded to zero is -0.
    """
    largest = top * 2.0 ** (emax - man)
    # floor(log2|x|) from the exponent bits; float32 subnormals (bits 0 -> -127) lie below every
    # format's smallest normal exponent, where the step stays fixed
    e = (((x.view(torch.int32) >> 23) & 0xFF) - 127).clamp(emin, emax)
    # Where both shifts stay within float32's normal exponents (every format but the widest IEEE ones), one
    # multiplication by 2^(man - e) or 2^(e - man) gives scale_pow2's result at half its work: x * 2^(man - e)
    # is exact (at least 2^man for x at or above 2^emin, a shift up below it) or overflows in both; a nonzero
    # code times 2^(e - man) is at least 2^(emin - man), a normal float32.
    narrow = max(man - emin, emax - man) <= 126

    def shift(t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return t * pow2(k) if narrow else scale_pow2(t, k)

    codes = round_codes(shift(x, man - e), key, stochastic=stochastic)
    out = torch.copysign(shift(codes, e - man), x)  # a negative value rounded to zero is -0
    too_large = out.abs() > largest
    if overflow == "inf":
        return torch.where(too_large, torch.where(x < 0, -math.inf, math.inf), out)
    if overflow == "saturate_finite":
        too_large = too_large & (x.abs() != math.inf)
    return torch.where(too_large, torch.where(x < 0, -largest, largest), out)


_floating_point = fused(float_grid)


def floating_point(
    x: torch.Tensor, exp: int, man: int, rounding: Rounding = "nearest", saturate: bool = False
) -> torch.Tensor:
    """Round float32 ``x`` to IEEE 754 binary floating point with ``exp`` exponent and ``man`` mantissa bits.

    The IEEE grid: bias ``2^(exp-1) - 1``, exponents ``1 - bias .. bias`` (the top code is reserved for
    inf/NaN), gradual underflow (subnormals below ``2^(1 - bias)`` with step ``2^(1 - bias - man)``),
    largest finite ``2^bias * (2 - 2^-man)``. Results beyond it overflow to ±inf, or with ``saturate``
    clamp to ±largest finite (FP8 recipes); ±inf and NaN inputs come back unchanged in every mode.
    With nearest rounding <5,10> equals ``x.half().float()`` and <8,7> ``x.bfloat16().float()`` bit
    for bit. ``exp`` in 2..8, ``man`` in 1..23 (<8,23> is float32 itself).
    """
    if not (2 <= exp <= 8 and 1 <= man <= 23):
        raise ValueError(f"float <{exp},{man}> is outside exp 2..8, man 1..23")
    if x.dtype != torch.float32:
        raise TypeError(f"floating_point reads float32 bits; got {x.dtype}")
    stochastic = _stochastic(rounding)
    bias = 2 ** (exp - 1) - 1
    return _floating_point(x, key_for(stochastic, x.device), man=man, emin=1 - bias, emax=bias, top=2 ** (man + 1) - 1,
                           stochastic=stochastic, overflow="saturate_finite" if saturate else "inf")
