"""FP8 with one float32 scale per tensor, as NVIDIA Transformer Engine scales it: current scaling from the tensor's
own amax (:func:`current_scaled_fp8`) and delayed scaling from a history of earlier amaxes (:class:`AmaxHistory`).
The scale and the order of its updates: docs/formats.md."""

from __future__ import annotations

import math

import torch
from torch import nn

from qtrain.quant.elements import ElementFormat, element_format, element_math
from qtrain.quant.rounding import Rounding, device_constant, fused, is_stochastic, key_for

FLOAT32_MAX = torch.finfo(torch.float32).max
REDUCTIONS = ("max", "most_recent")


def fp8_scale(amax: torch.Tensor, fmt: ElementFormat | str, margin: int = 0,
              previous: torch.Tensor | None = None) -> torch.Tensor:
    """The scale that takes ``amax`` to ``fmt``'s largest value, ``margin`` binades below it: float32.

    Transformer Engine's ``(max_normal / amax) / 2^margin``, each step rounded in float32. Where ``amax``
    is 0, NaN or ±inf the scale is ``previous`` (delayed scaling keeps the last scale; 1.0 where None, as
    current scaling); a scale beyond float32 (a tiny amax) is float32's largest value.
    """
    fmt = element_format(fmt)
    amax = amax.to(torch.float32)
    scale = (device_constant(fmt.max_normal, torch.float32, amax.device) / amax) / device_constant(
        2.0**margin, torch.float32, amax.device)
    fallback = torch.ones_like(amax) if previous is None else previous.to(amax.device, torch.float32)
    scale = torch.where((amax > 0) & (amax < math.inf), scale, fallback)
    return torch.where(scale == math.inf, FLOAT32_MAX, scale)


@fused
def _scaled(x: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, key: torch.Tensor, *, elem: str,
            stochastic: bool) -> torch.Tensor:
    # a finite x that the scale takes past float32's range saturates as any finite value past the format's does
    # (E5M2 would keep the product's inf); infinite and NaN x stay what they are
    scaled = x * scale
    scaled = torch.where(x.abs() < math.inf, scaled.clamp(-FLOAT32_MAX, FLOAT32_MAX), scaled)
    return element_math(scaled, key, elem=elem, stochastic=stochastic) * scale_inv


def scaled_fp8(x: torch.Tensor, fmt: ElementFormat | str, scale: torch.Tensor, rounding: Rounding = "nearest",
               key: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` through FP8 at a per-tensor ``scale``, returned dequantized in float32.

    In this order, each step rounded in float32: ``y = x * scale`` (a finite ``x`` whose product overflows float32
    held at ±float32's largest value); ``q = y`` on ``fmt``'s grid (half to even or stochastic, finite overflow
    saturating to ±max_normal, :func:`~qtrain.quant.elements.
    round_to_element`); ``q * scale_inv`` with ``scale_inv = 1 / scale``, as Transformer Engine dequantizes.
    """
    fmt = element_format(fmt)
    stochastic = is_stochastic(rounding)
    key = key_for(stochastic, x.device) if key is None else key.to(x.device)
    scale = scale.to(x.device, torch.float32)
    return _scaled(x, scale, torch.reciprocal(scale), key, elem=fmt.name, stochastic=stochastic)


def current_scaled_fp8(x: torch.Tensor, fmt: ElementFormat | str, margin: int = 0, rounding: Rounding = "nearest",
                       key: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`scaled_fp8` at the scale of this tensor's own amax (current scaling; a NaN or inf amax gives scale 1)."""
    if x.numel() == 0:
        return x.clone()
    return scaled_fp8(x, fmt, fp8_scale(x.detach().abs().amax(), fmt, margin), rounding, key)


class AmaxHistory(nn.Module):
    """The amaxes of the last ``length`` steps of one tensor, and the delayed scale they give (Transformer Engine's
    ``DelayedScaling``: ``amax_history_len`` and ``amax_compute_algo``).

    A step calls :meth:`scale` to quantize its tensor, then :meth:`record` with that tensor's amax: the scale a
    step uses comes from the amaxes of the steps before it, never its own (step 0 uses scale 1.0). This is
    TE's order: the amax of step i is written into the history during step i, and the history and scale are
    updated after it. The reduction "max" takes the largest amax in the window (NaN entries ignored, as TE's
    ``fmaxf``), "most_recent" the last one recorded; where that amax is 0 or not finite the previous scale is
    kept. The window starts as zeros. The history and the last scale are buffers: a quantizer that holds an
    ``AmaxHistory`` carries them in its model's state_dict, to its device, and into every checkpoint.
    """

    history: torch.Tensor
    last_scale: torch.Tensor

    def __init__(self, length: int, reduction: str) -> None:
        super().__init__()
        if length < 1:
            raise ValueError(f"amax history length must be at least 1; got {length}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"amax reduction {reduction!r} is not one of {REDUCTIONS}")
        self.length, self.reduction = length, reduction
        self.register_buffer("history", torch.zeros(length))  # history[0] the most recent amax
        self.register_buffer("last_scale", torch.ones(()))

    def _amax(self) -> torch.Tensor:
        if self.reduction == "most_recent":
            return self.history[0]
        return torch.where(torch.isnan(self.history), 0.0, self.history).amax()

    def scale(self, fmt: ElementFormat | str, margin: int = 0) -> torch.Tensor:
        """This step's scale, from the amaxes recorded so far (:func:`fp8_scale`); the same until the next record."""
        self.last_scale.copy_(fp8_scale(self._amax(), fmt, margin, previous=self.last_scale))
        return self.last_scale.clone()

    def record(self, amax: torch.Tensor) -> None:
        """Append this step's amax to the window (the oldest falls out)."""
        self.history.copy_(torch.cat([amax.detach().to(self.history).reshape(1), self.history[:-1]]))
