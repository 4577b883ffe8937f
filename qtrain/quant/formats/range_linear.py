"""Range-linear (SBM, Banner et al. 2018): 2^b levels from lo to hi, per tensor, per output channel or the mean of
per-sample ranges; integer codes and their decoding, for saved activations (docs/formats.md)."""

from __future__ import annotations

import math
from typing import Literal

import torch

from qtrain.quant.rounding import (
    Rounding,
    device_constant,
    fused,
    in_lanes,
    is_stochastic,
    key_for,
    round_codes,
)

Granularity = Literal["tensor", "channel", "sample_mean"]
GRANULARITIES = ("tensor", "channel", "sample_mean")


def _rows(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """``x`` as a 2-D view: one row for "tensor", one per slice of dimension 0 otherwise."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"range granularity {granularity!r} is not one of {GRANULARITIES}")
    return x.reshape(1, -1) if granularity == "tensor" else x.reshape(x.shape[0], math.prod(x.shape[1:]))


def finite_bounds(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of each row's finite values (NaN and ±inf do not widen the range), as ``(rows, 1)``."""
    finite = rows.abs() < math.inf
    # amin and amax apart: 5x faster than aminmax(dim=1) on the CPU
    lo = torch.where(finite, rows, math.inf).amin(1, keepdim=True)
    hi = torch.where(finite, rows, -math.inf).amax(1, keepdim=True)
    return lo, hi


_fused_bounds = fused(finite_bounds)


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
    return _sample_mean_range(rows) if granularity == "sample_mean" else finite_bounds(rows)


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
    lo, hi = finite_bounds(rows.reshape(1, -1) if whole else rows.reshape(rows.shape[0], -1))
    out, *compact = _grid(rows, lo, hi, levels, key, stochastic=stochastic, code_dtype=code_dtype)
    return out, lo, hi, *compact


@fused
def _range_linear_two_widths(rows: torch.Tensor, levels: torch.Tensor, other_levels: torch.Tensor, key: torch.Tensor,
                             other_key: torch.Tensor, *, stochastic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = finite_bounds(rows.reshape(rows.shape[0], -1))
    return (_grid(rows, lo, hi, levels, key, stochastic=stochastic, code_dtype=None)[0],
            _grid(rows, lo, hi, other_levels, other_key, stochastic=stochastic, code_dtype=None)[0])


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
    stochastic = is_stochastic(rounding)
    rows = x.reshape(x.shape[0], -1) if isinstance(bits, torch.Tensor) else x.reshape(lo.shape[0], -1)
    rows, key = in_lanes(rows, stochastic, rows.shape[0] > 1, key_for(stochastic, x.device))  # bits or range per row
    return _range_linear(rows, lo, hi, _levels(bits, x), key, stochastic=stochastic, code_dtype=None)[0].view_as(x)


def _from_data(x: torch.Tensor, bits: Bits, granularity: Granularity, rounding: Rounding, dtype: torch.dtype | None) -> tuple:
    stochastic = is_stochastic(rounding)
    rows = _grid_rows(x, bits, granularity)
    if rows.numel() == 0:  # no elements to take a range from: (0, 0)
        zero = x.new_zeros(1 if granularity == "sample_mean" or isinstance(bits, torch.Tensor) else rows.shape[0], 1)
        out = x.clone()
        return (out, zero, zero) if dtype is None else (out, zero, zero, rows.to(dtype), zero)
    levels = _levels(bits, x)
    if granularity != "sample_mean":  # range and grid in one kernel
        whole = isinstance(bits, torch.Tensor)  # per-sample rows, one range over all of them
        rows, key = in_lanes(rows, stochastic, rows.shape[0] > 1, key_for(stochastic, x.device))
        return _range_linear_from_data(rows, levels, key, whole=whole, stochastic=stochastic, code_dtype=dtype)
    lo, hi = _sample_mean_range(rows)
    rows, key = in_lanes(rows, stochastic, isinstance(bits, torch.Tensor), key_for(stochastic, x.device))
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
    stochastic = is_stochastic(rounding)
    rows = _rows(x, granularity)
    if rows.numel() == 0:
        return x.clone(), x.clone()
    keys = [key_for(stochastic, x.device) for _ in range(2)]  # in the order of two calls
    rows, *keys = in_lanes(rows, stochastic, rows.shape[0] > 1, *keys)
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
