"""The element formats of FP8 and the OCP Microscaling formats (E4M3, E5M2, E3M2, E2M3, E2M1, INT8), and rounding
onto them, saturating (:func:`round_to_element`). The grids, their special values and sources: docs/formats.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtrain.quant.formats.floating_point import float_grid, fused_float_grid
from qtrain.quant.rounding import Rounding, is_stochastic, key_for


@dataclass(frozen=True)
class ElementFormat:
    """A format of scalar elements: a binary float grid (or, with ``exp = 0``, a fixed-point one).

    ``man`` mantissa bits (for the integer format its fractional bits); normal exponents ``emin`` to
    ``emax`` (the integer format is one binade with ``emin = emax = 0``: step 2^-man everywhere);
    ``max_normal`` its largest finite magnitude. ``has_inf``: ±inf inputs stay ±inf (E5M2); otherwise they
    saturate to ±max_normal. ``has_nan``: the format encodes NaN (E4M3, E5M2); NaN inputs stay NaN in
    every format here (the FP6/FP4 encodings have none, but a NaN scale makes the whole MX block NaN).
    """

    name: str
    bits: int
    exp: int
    man: int
    emin: int
    emax: int
    max_normal: float
    has_inf: bool
    has_nan: bool

    @property
    def top_code(self) -> int:
        """The largest magnitude in units of the top binade's step: ``max_normal / 2^(emax - man)``."""
        return round(self.max_normal * 2.0 ** (self.man - self.emax))


def _float(name: str, exp: int, man: int, max_normal: float, has_inf: bool, has_nan: bool, emax: int) -> ElementFormat:
    bias = 2 ** (exp - 1) - 1
    return ElementFormat(name, 1 + exp + man, exp, man, 1 - bias, emax, max_normal, has_inf, has_nan)


ELEMENTS: dict[str, ElementFormat] = {
    # OCP FP8 E4M3 (float8_e4m3fn): the top exponent holds normal values, only S.1111.111 is NaN; no inf
    "e4m3": _float("e4m3", 4, 3, 448.0, has_inf=False, has_nan=True, emax=8),
    # OCP FP8 E5M2: IEEE-like, the top exponent is inf/NaN
    "e5m2": _float("e5m2", 5, 2, 57344.0, has_inf=True, has_nan=True, emax=15),
    # MX FP6 and FP4: every code is a number
    "e3m2": _float("e3m2", 3, 2, 28.0, has_inf=False, has_nan=False, emax=4),
    "e2m3": _float("e2m3", 2, 3, 7.5, has_inf=False, has_nan=False, emax=2),
    "e2m1": _float("e2m1", 2, 1, 6.0, has_inf=False, has_nan=False, emax=2),
    # MXINT8: two's complement codes -128..127 times 2^-6; conversion clamps to ±127/64 (symmetric, see docs)
    "int8": ElementFormat("int8", 8, 0, 6, 0, 0, 127 / 64, has_inf=False, has_nan=False),
}


def element_format(fmt: ElementFormat | str) -> ElementFormat:
    """``fmt`` itself, or the format of ``ELEMENTS`` it names."""
    if isinstance(fmt, ElementFormat):
        return fmt
    if fmt not in ELEMENTS:
        raise ValueError(f"element format {fmt!r} is not one of {tuple(ELEMENTS)}")
    return ELEMENTS[fmt]


def element_grid(fmt: ElementFormat) -> dict:
    """The static keywords of :func:`~qtrain.quant.formats.float_grid` for ``fmt`` (saturating)."""
    return {"man": fmt.man, "emin": fmt.emin, "emax": fmt.emax, "top": fmt.top_code,
            "overflow": "saturate_finite" if fmt.has_inf else "saturate"}


def element_math(x: torch.Tensor, key: torch.Tensor, *, elem: str, stochastic: bool) -> torch.Tensor:
    """:func:`round_to_element`'s arithmetic for the format ``ELEMENTS[elem]``, for the fused kernels that scale first."""
    return float_grid(x, key, stochastic=stochastic, **element_grid(ELEMENTS[elem]))


def round_to_element(x: torch.Tensor, fmt: ElementFormat | str, rounding: Rounding = "nearest",
                     key: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``x`` rounded onto the element format ``fmt``'s grid (float32 out), saturating.

    Nearest is round half to even; stochastic rounds up with probability equal to the fraction of a step
    (``key`` gives the draws, :func:`~qtrain.quant.rounding.key_for`; drawn here where None). The element
    format's subnormals are on its grid. Finite values beyond ``max_normal`` (after rounding) become
    ±max_normal; ±inf stays ±inf in E5M2 and becomes ±max_normal in every other format; NaN stays NaN; -0
    and negative values rounded to zero are -0.
    """
    fmt = element_format(fmt)
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_element reads float32 bits; got {x.dtype}")
    stochastic = is_stochastic(rounding)
    key = key_for(stochastic, x.device) if key is None else key.to(x.device)
    return fused_float_grid(x, key, stochastic=stochastic, **element_grid(fmt))
