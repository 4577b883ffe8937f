"""Quantizers: a number format with its parameters and state, as a module (tensor in, tensor out).

A quantizer is what a layer holds for one operand (weight, activation, gradient). Being modules,
they follow ``.train()``/``.eval()`` and their state (the running activation range that SBM uses at
evaluation) lands in the model's ``state_dict`` and so in every checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from qtrain.quant import formats
from qtrain.quant.formats import Granularity, Rounding


class Quantizer(nn.Module):
    """Base class: ``bits`` is the width charged by the cost model, ``fmt`` the format's name.

    ``quantizer(x)`` quantizes at ``bits``; ``quantizer(x, bits)`` with an ``(N,)`` tensor gives each
    sample (slice of dimension 0) its own bit-width, where the format supports it.
    """

    fmt = "float32"
    bits: int = 32

    def forward(self, x: torch.Tensor, bits: torch.Tensor | None = None) -> torch.Tensor:
        if bits is not None:
            raise ValueError(f"{type(self).__name__} has no per-sample bit-widths")
        return self.quantize(x)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compact(self, x: torch.Tensor, bits: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``self(x, bits)`` and what backward saves to rebuild it with :meth:`expand` (here: the tensor itself)."""
        out = self(x, bits)
        return out, (out,)

    def expand(self, saved: tuple[torch.Tensor, ...], shape: torch.Size) -> torch.Tensor:
        """The quantized tensor that :meth:`compact` saved."""
        return saved[0]


class FixedPoint(Quantizer):
    fmt = "fixed"

    def __init__(self, wl: int, fl: int, rounding: Rounding = "stochastic", symmetric: bool = False) -> None:
        super().__init__()
        self.bits, self.fl, self.rounding, self.symmetric = wl, fl, rounding, symmetric

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return formats.fixed_point(x, self.bits, self.fl, self.rounding, self.symmetric)

    def extra_repr(self) -> str:
        return f"wl={self.bits}, fl={self.fl}, rounding={self.rounding}"


class RangeLinear(Quantizer):
    """Range-linear quantization; with ``momentum`` set it keeps a running range for evaluation.

    In training mode the range comes from the tensor itself and, when ``momentum`` is given, updates
    a running average as the SBM and FracTrain reference code do: ``running <- momentum * running +
    (1 - momentum) * batch`` (of the range's ends; the code averages range and zero point, the same
    linear map). In evaluation mode that average is used. The reference starts the average at zero;
    here the first training batch sets it, so that early evaluations are not biased toward zero (the
    two agree after a few times ``1 / (1 - momentum)`` steps). Before any training step evaluation
    uses the batch's own range.

    Per-sample bit-widths (``quantizer(x, bits)``) share one range over the whole tensor (granularity
    "tensor" or "sample_mean") and round each sample onto its own ``2^bits`` levels.
    """

    fmt = "range-linear"

    def __init__(self, bits: int, granularity: Granularity, rounding: Rounding, momentum: float | None = None) -> None:
        super().__init__()
        self.bits, self.granularity, self.rounding, self.momentum = bits, granularity, rounding, momentum
        if momentum is not None:
            self.register_buffer("running_range", torch.zeros(2))
            self.register_buffer("tracked", torch.zeros((), dtype=torch.bool))

    def _running(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The running range where evaluation uses it, else None."""
        if self.momentum is not None and not self.training and bool(self.tracked):
            return self.running_range[0].reshape(1, 1), self.running_range[1].reshape(1, 1)
        return None

    def forward(self, x: torch.Tensor, bits: torch.Tensor | None = None) -> torch.Tensor:
        running = self._running()
        if bits is not None:
            if self.granularity == "channel":
                raise ValueError("per-sample bit-widths need one range for the whole tensor, not per channel")
            lo, hi = running if running is not None else formats.tensor_range(x, self.granularity)
            if running is None and self.momentum is not None and self.training:
                self._track(lo, hi)
            return _per_sample(x, bits, lo, hi, self.rounding)
        if running is not None:
            return formats.range_linear(x, self.bits, *running, self.rounding)
        out, lo, hi = formats.range_linear_from_data(x, self.bits, self.granularity, self.rounding)
        if self.momentum is not None and self.training:
            self._track(lo, hi)
        return out

    def compact(self, x: torch.Tensor, bits: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """In training, saves integer codes (1 byte each up to 8 bits) instead of float32 values."""
        if bits is not None or not self.training or formats.code_dtype(self.bits) is None:
            return super().compact(x, bits)
        out, lo, hi, codes = formats.range_linear_codes(x, self.bits, self.granularity, self.rounding)
        if self.momentum is not None:
            self._track(lo, hi)
        return out, codes

    def expand(self, saved: tuple[torch.Tensor, ...], shape: torch.Size) -> torch.Tensor:
        return saved[0] if len(saved) == 1 else formats.decode_codes(saved, shape)

    @torch.no_grad()
    def _track(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        batch = torch.stack([lo.min(), hi.max()])
        if bool(self.tracked):
            self.running_range.lerp_(batch, 1 - self.momentum)
        else:
            self.running_range.copy_(batch)
            self.tracked.fill_(True)

    def extra_repr(self) -> str:
        return f"bits={self.bits}, granularity={self.granularity}, rounding={self.rounding}"


def _per_sample(x: torch.Tensor, bits: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    out = torch.empty_like(x)
    for b in bits.unique().tolist():
        rows = (bits == b).nonzero().squeeze(1)
        out[rows] = formats.range_linear(x[rows].contiguous(), int(b), lo, hi, rounding)
    return out


class BlockFloatingPoint(Quantizer):
    fmt = "block-fp"

    def __init__(
        self, wl: int, rounding: Rounding = "stochastic", block: int | None = None, dims: tuple[int, int] = (0, 1)
    ) -> None:
        super().__init__()
        self.bits, self.rounding, self.block, self.dims = wl, rounding, block, dims

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return formats.block_floating_point(x, self.bits, self.rounding, self.block, self.dims)

    def extra_repr(self) -> str:
        return f"wl={self.bits}, block={self.block}, rounding={self.rounding}"


class FloatingPoint(Quantizer):
    fmt = "float"

    def __init__(self, exp: int, man: int, rounding: Rounding = "nearest") -> None:
        super().__init__()
        self.exp, self.man, self.rounding = exp, man, rounding
        self.bits = 1 + exp + man

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return formats.floating_point(x, self.exp, self.man, self.rounding)

    def extra_repr(self) -> str:
        return f"exp={self.exp}, man={self.man}, rounding={self.rounding}"
