"""Float <exp, man>: the IEEE 754 grid (<5,10> and <8,7> equal torch's float16 and bfloat16 casts bit for bit), and
the kernel that rounds onto any binary float grid, shared with the FP8 and MX elements (docs/formats.md)."""

from __future__ import annotations

import math

import torch

from qtrain.quant.rounding import (
    Rounding,
    fused,
    is_stochastic,
    key_for,
    pow2,
    round_codes,
    scale_pow2,
)


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


fused_float_grid = fused(float_grid)  # one kernel per grid (its static keywords)


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
    stochastic = is_stochastic(rounding)
    bias = 2 ** (exp - 1) - 1
    return fused_float_grid(x, key_for(stochastic, x.device), man=man, emin=1 - bias, emax=bias, top=2 ** (man + 1) - 1,
                           stochastic=stochastic, overflow="saturate_finite" if saturate else "inf")
