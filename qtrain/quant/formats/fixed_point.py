"""Fixed point <WL, FL> (QPyTorch's grid), with or without clamping or with the clamped elements' mask for a
straight-through estimator; MuPPET's dynamic fixed point (a power-of-two scale per tensor); a fixed-point tensor's
integer codes and their decoding, for saved activations (docs/formats.md)."""

from __future__ import annotations

import math

import torch

from qtrain.quant.formats.range_linear import finite_bounds
from qtrain.quant.rounding import (
    Rounding,
    device_constant,
    fused,
    in_lanes,
    is_stochastic,
    key_for,
    round_codes,
    scale_pow2,
)


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
# (1, rows, lanes), in_lanes) at one format, and at a column of formats (AdaPT's PushDown).
_fixed_point_flat = fused(_fixed_point_math)
_fixed_point_rows = fused(_fixed_point_math)


def _fixed_point(x: torch.Tensor, scale: torch.Tensor, bounds: torch.Tensor, key: torch.Tensor, *, stochastic: bool,
                 clamp: bool, mask: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`_fixed_point_math` on ``x`` flattened, in rows of lanes where it can be
    (:func:`~qtrain.quant.rounding.in_lanes`: the same element indices, so the same stochastic draws)."""
    flat, key = in_lanes(x.reshape(1, -1), stochastic, False, key)
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
    stochastic = is_stochastic(rounding)
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
    stochastic = is_stochastic(rounding)
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
    stochastic = is_stochastic(rounding)
    fl = fl.to(torch.int32).reshape(-1, 1)
    half = scale_pow2(torch.ones_like(fl, dtype=x.dtype), wl.to(torch.int32).reshape(-1, 1) - 1)
    scale = scale_pow2(torch.ones_like(fl, dtype=x.dtype), fl)
    bounds = torch.stack([-half, half - 1])
    key = key_for(stochastic, x.device) if key is None else key
    flat, key = in_lanes(x.reshape(1, -1), stochastic, False, key)
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
    lo, hi = finite_bounds(rows.reshape(1, -1))
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
    stochastic = is_stochastic(rounding)
    if x.numel() == 0:
        fl = torch.zeros((), dtype=torch.int32, device=x.device)
        return (x.clone(), fl) if code_dtype is None else (x.clone(), fl, *_fixed_codes(x, fl, code_dtype=code_dtype))
    bounds = device_constant((-(2.0 ** (wl - 1)), 2.0 ** (wl - 1) - 1), x.dtype, x.device)
    rows, key = in_lanes(x.reshape(1, -1), stochastic, False, key_for(stochastic, x.device))
    out, fl, *codes = _dynamic_fixed_point(rows, bounds, key, wl=wl, stochastic=stochastic, code_dtype=code_dtype)
    return out.view(x.shape), fl, *([codes[0].view(x.shape), *codes[1:]] if codes else [])
