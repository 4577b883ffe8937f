"""Quantizers: a number format with its parameters and state, as a module (tensor in, tensor out) that a layer holds
for one operand (weight, activation, gradient). Their state, rounding and what backward saves: docs/formats.md."""

from __future__ import annotations

import torch
from torch import nn

from qtrain.quant import formats
from qtrain.quant.formats import Granularity, Rounding
from qtrain.quant.rounding import device_constant


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

    def forward_with_mask(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``self(x)`` and where a straight-through gradient passes (a bool tensor; None: everywhere).

        :func:`qtrain.quant.autograd.quantize_ste` calls it, so a quantizer that clamps can zero the
        gradient of the elements it clamped.
        """
        return self(x), None

    def compact(self, x: torch.Tensor, bits: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``self(x, bits)`` and what backward saves to rebuild it with :meth:`expand` (here: the tensor itself)."""
        out = self(x, bits)
        return out, (out,)

    def expand(self, saved: tuple[torch.Tensor, ...], shape: torch.Size) -> torch.Tensor:
        """The quantized tensor that :meth:`compact` saved."""
        return saved[0]

    def masked_grad(self, grad: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The straight-through gradient w.r.t. the input of :meth:`compact`, from ``grad`` w.r.t. its output."""
        return grad


def fixed_code_dtype(bits: int) -> torch.dtype | None:
    """The integer dtype of a ``bits``-bit fixed-point grid's saved codes: 1 byte up to 8 bits, 2 up to 16, else None."""
    return torch.int8 if bits <= 8 else torch.int16 if bits <= 16 else None


def fixed_codes(out: torch.Tensor, fl: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...] | None:
    """What backward saves of a tensor on the fixed-point grid <bits, fl>: its integer codes
    (:func:`fixed_code_dtype`), the step ``2^-fl``, which give it back exactly, and the code that stands for
    NaN; None where codes save nothing (over 16 bits).

    A NaN is saved as the dtype's lowest code, and the third tensor holds that code where ``out`` has a NaN,
    else infinity, which no code equals: decided on the device, without reading anything back to the host. Below
    8 (16) bits the lowest code is off the grid; at exactly 8 (16) bits it is also the grid's lowest value
    (``-2^(bits-1)`` steps), which comes back as NaN too where the tensor holds a NaN (its loss is NaN then).
    """
    dtype = fixed_code_dtype(bits)
    if dtype is None:
        return None
    return formats.fixed_point_codes(out, fl.to(device=out.device, dtype=torch.int32), code_dtype=dtype)


def expand_codes(saved: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The tensor :func:`fixed_codes` saved (a float tensor saved as itself comes back as it is)."""
    if saved[0].is_floating_point():
        return saved[0]
    codes, step, nan_code = saved[:3]
    return formats.decode_fixed_point_codes(codes, step, nan_code)


class FixedPoint(Quantizer):
    """Fixed point <wl, fl>; ``clamp=False`` rounds without saturating (QPyTorch's ``clamp``).

    ``clamp_grad_zero`` (QPyTorch's ``clamping_grad_zero``) makes the straight-through estimator pass
    zero gradient to the elements the forward clamped, in :func:`~qtrain.quant.autograd.quantize_ste`
    and for the activations of the quantized layers.
    """

    fmt = "fixed"

    def __init__(
        self,
        wl: int,
        fl: int,
        rounding: Rounding = "stochastic",
        symmetric: bool = False,
        clamp: bool = True,
        clamp_grad_zero: bool = False,
    ) -> None:
        super().__init__()
        if clamp_grad_zero and not clamp:
            raise ValueError("clamp_grad_zero zeroes the gradient of clamped values: it needs clamp=True")
        self.bits, self.fl, self.rounding, self.symmetric = wl, fl, rounding, symmetric
        self.clamp, self.clamp_grad_zero = clamp, clamp_grad_zero

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return formats.fixed_point(x, self.bits, self.fl, self.rounding, self.symmetric, self.clamp)

    def forward_with_mask(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.clamp_grad_zero:
            return self(x), None
        return formats.fixed_point_with_mask(x, self.bits, self.fl, self.rounding, self.symmetric)

    def compact(self, x: torch.Tensor, bits: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """In training, saves integer codes up to 16 bits (clamped formats), else the quantized tensor;
        with ``clamp_grad_zero``, also the mask of unclamped elements."""
        if bits is not None:
            return super().compact(x, bits)  # refuses: no per-sample bit-widths
        out, passes = self.forward_with_mask(x)
        fl = device_constant(self.fl, torch.int32, out.device)
        codes = fixed_codes(out, fl, self.bits) if self.training and self.clamp else None
        saved = codes if codes is not None else (out,)
        return out, saved if passes is None else (*saved, passes)

    def expand(self, saved: tuple[torch.Tensor, ...], shape: torch.Size) -> torch.Tensor:
        return expand_codes(saved)

    def masked_grad(self, grad: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.where(saved[-1], grad, 0.0) if saved[-1].dtype == torch.bool else grad

    def extra_repr(self) -> str:
        extra = "" if self.clamp else ", clamp=False"
        extra += ", clamp_grad_zero=True" if self.clamp_grad_zero else ""
        return f"wl={self.bits}, fl={self.fl}, rounding={self.rounding}{extra}"


class DynamicFixedPoint(Quantizer):
    """MuPPET's dynamic fixed point: ``wl`` bits, the scale 2^fl recomputed from each tensor it quantizes.

    ``fl`` (a buffer) holds the scale exponent of the last tensor, for the precision log.
    """

    fmt = "dynamic-fixed"

    def __init__(self, wl: int, rounding: Rounding = "stochastic") -> None:
        super().__init__()
        self.bits, self.rounding = wl, rounding
        self.register_buffer("fl", torch.zeros((), dtype=torch.int32))

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        out, fl = formats.dynamic_fixed_point(x, self.bits, self.rounding)
        self.fl.copy_(fl)
        return out

    def compact(self, x: torch.Tensor, bits: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """In training, saves integer codes up to 16 bits and the tensor's step instead of float32 values
        (made in the kernel that quantizes)."""
        code_dtype = fixed_code_dtype(self.bits) if self.training else None
        if bits is not None or code_dtype is None:
            return super().compact(x, bits)
        out, fl, *codes = formats.dynamic_fixed_point(x, self.bits, self.rounding, code_dtype)
        self.fl.copy_(fl)
        return out, tuple(codes)

    def expand(self, saved: tuple[torch.Tensor, ...], shape: torch.Size) -> torch.Tensor:
        return expand_codes(saved)

    def extra_repr(self) -> str:
        return f"wl={self.bits}, rounding={self.rounding}"


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
        width = self.bits if bits is None else bits
        running = self._running()
        if running is not None:
            return formats.range_linear(x, width, *running, self.rounding)
        out, lo, hi = formats.range_linear_from_data(x, width, self.granularity, self.rounding)
        if self.momentum is not None and self.training:
            self._track(lo, hi)
        return out

    def compact(self, x: torch.Tensor, bits: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """In training, saves integer codes (1 byte each up to 8 bits) instead of float32 values.

        Per-sample ``bits`` may not exceed ``self.bits``, which sizes the codes.
        """
        if not self.training or formats.code_dtype(self.bits) is None:
            return super().compact(x, bits)
        width = self.bits if bits is None else bits
        out, lo, hi, codes = formats.range_linear_codes(x, width, self.granularity, self.rounding, max_bits=self.bits)
        if self.momentum is not None:
            self._track(lo, hi)
        return out, codes

    def expand(self, saved: tuple[torch.Tensor, ...], shape: torch.Size) -> torch.Tensor:
        return saved[0] if len(saved) == 1 else formats.decode_codes(saved, shape)

    @torch.no_grad()
    def _track(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        # chosen on the device: reading ``tracked`` on the host would wait for the GPU's queued work at every layer
        batch = torch.stack([lo.min(), hi.max()])
        self.running_range.copy_(torch.where(self.tracked, self.running_range.lerp(batch, 1 - self.momentum), batch))
        self.tracked.fill_(True)

    def extra_repr(self) -> str:
        return f"bits={self.bits}, granularity={self.granularity}, rounding={self.rounding}"


def quantize_twice(first: Quantizer, second: Quantizer, x: torch.Tensor,
                   bits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``first(x, bits)`` and ``second(x)``, in that order: one kernel, one range pass, where both are range-linear
    over ``x``'s own range at one width each (SBM's FW-8/BW-16 gradient bifurcation), the same bits and draws."""
    shared = (bits is None and type(first) is RangeLinear and type(second) is RangeLinear  # not a subclass's forward
              and first.momentum is None and second.momentum is None and first.granularity == second.granularity
              and first.granularity in ("tensor", "channel") and first.rounding == second.rounding)
    if not shared:
        return first(x, bits), second(x)
    return formats.range_linear_two_widths(x, first.bits, second.bits, first.granularity, first.rounding)


class BlockFloatingPoint(Quantizer):
    fmt = "block-fp"

    def __init__(
        self,
        wl: int,
        rounding: Rounding = "stochastic",
        block: int | None = None,
        dims: tuple[int, int] = (0, 1),
        dim: int | None = None,
    ) -> None:
        super().__init__()
        if block is not None and dim is not None:
            raise ValueError("block floating point takes k x k tiles (block) or per-slice exponents (dim), not both")
        self.bits, self.rounding, self.block, self.dims, self.dim = wl, rounding, block, dims, dim

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return formats.block_floating_point(x, self.bits, self.rounding, self.block, self.dims, self.dim)

    def extra_repr(self) -> str:
        return f"wl={self.bits}, block={self.block}, dim={self.dim}, rounding={self.rounding}"


class DensityTracked(Quantizer):
    """A weight quantizer that keeps the share of non-zero values in its last output (``density``, a buffer).

    AdaPT's penalty and performance model need each step's density of the quantized weights
    (AdaPT paper Sec. 3.4, 4.1.2); reading it here costs one count over the weights, where quantizing
    again would draw new stochastic rounding. ``inner`` is the quantizer that does the work.
    """

    def __init__(self, inner: Quantizer) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("density", torch.ones(()))

    @property
    def fmt(self) -> str:  # type: ignore[override]
        return self.inner.fmt

    @property
    def bits(self) -> int:  # type: ignore[override]
        return self.inner.bits

    def forward(self, x: torch.Tensor, bits: torch.Tensor | None = None) -> torch.Tensor:
        return self._track(self.inner(x, bits))

    def forward_with_mask(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, passes = self.inner.forward_with_mask(x)
        return self._track(out), passes

    def _track(self, out: torch.Tensor) -> torch.Tensor:
        if out.numel():
            self.density.copy_(out.detach().count_nonzero() / out.numel())
        return out

