"""Rounding onto integer grids: nearest (half to even) and stochastic (draws from a counter-based hash keyed by torch's
default generator, so runs repeat and resume), exact power-of-two scaling (:func:`scale_pow2`) and the fused
torch.compile kernels (:func:`fused`). Why each choice: docs/formats.md."""

from __future__ import annotations

import functools
import math
import types
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch

from qtrain.quant.choices import ROUNDINGS

Rounding = Literal["nearest", "stochastic"]
_M2 = 0x846CA68B - (1 << 32)  # the second lowbias32 multiplier as a signed 32-bit value
_FUSED = {"enabled": True}
INT32_INDEX_LIMIT = 1 << 31  # tensors with fewer elements index their draws with int32
MIN_LANES, MAX_LANES = 16, 1024  # the lanes a row of stochastic draws may be taken in (lane_count)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` (C. Wellons' hash prospector), a low-bias bijection on 32-bit words.

    Runs on int32 (native vector multiplies on the CPU); multiplication wraps modulo 2^32 and the
    right shifts are masked so they act as the logical shifts of the unsigned original.
    """
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * 0x7FEB352D
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _M2
    return h ^ ((h >> 16) & 0xFFFF)


def uniform_at(index: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1) with 24 random bits each: the hash of each (int32 or int64) index and ``key``.

    An int64 index splits into its low and high 32 bits; the high bits enter through the key,
    ``key ^ mix(high)``, and ``mix(0) = 0``, so any index below 2^31 draws the same value on both paths.
    """
    if index.dtype == torch.int64:
        key = key ^ _mix32((index >> 32).to(torch.int32))
        index = (((index & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000).to(torch.int32)  # low 32 bits, two's complement
    h = _mix32(index ^ key)
    return ((h >> 8) & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))


def hashed_uniform(shape: torch.Size, key: torch.Tensor, device: torch.device) -> torch.Tensor:
    """:func:`uniform_at` of every element's flat index: int32 indices below 2^31 elements, int64 above.

    ``key`` is the 0-d key, or the key of each lane (:func:`lane_keys`) of a tensor whose last dimension
    is the lanes: the same draws. A row's index ``r * L`` has no bits below ``L`` (a power of two) and a
    lane's ``l`` none above, so ``(r * L + l) ^ key = (r * L) ^ (l ^ key)``, and the kernel reads the lanes'
    keys where it would otherwise build each element's index (Inductor's CPU code builds a vector of
    indices per 16 elements, which cost half of a stochastic rounding's time). Lanes are at least
    :data:`MIN_LANES` and the tensor below 2^31 elements; any other key (a ``(1,)`` one too) draws as a 0-d key.
    """
    numel = shape.numel()
    if key.dim() == 1 and len(shape) and key.numel() == shape[-1] >= MIN_LANES and numel < INT32_INDEX_LIMIT:
        lanes = shape[-1]
        rows = torch.arange(numel // lanes, device=device, dtype=torch.int32).reshape(*shape[:-1], 1)
        return uniform_at(rows * lanes, key)
    dtype = torch.int32 if numel < INT32_INDEX_LIMIT else torch.int64
    return uniform_at(torch.arange(numel, device=device, dtype=dtype).reshape(shape), key)


def lane_count(numel: int, row_length: int | None = None) -> int:
    """How many lanes a tensor of ``numel`` elements, in rows of ``row_length`` (all of them where None), is read
    in (and its draws taken in): the row's largest power-of-two divisor up to :data:`MAX_LANES`, or 1 (no lanes: each
    element's index is built in the kernel) where that is below :data:`MIN_LANES` or the tensor needs 64-bit
    indices."""
    lanes = math.gcd(numel if row_length is None else row_length, MAX_LANES)
    return lanes if numel and MIN_LANES <= lanes and numel < INT32_INDEX_LIMIT else 1


@functools.cache
def _lane_indices(lanes: int, device: torch.device) -> torch.Tensor:
    return torch.arange(lanes, dtype=torch.int32, device=device)


def lane_keys(key: torch.Tensor, lanes: int) -> torch.Tensor:
    """``key`` for draws taken in ``lanes`` lanes (:func:`hashed_uniform`): ``l ^ key`` for each lane ``l``."""
    return _lane_indices(lanes, key.device) ^ key


def round_codes(t: torch.Tensor, key: torch.Tensor, *, stochastic: bool, draws: torch.Size | None = None) -> torch.Tensor:
    """``t`` rounded to integers (as floats): half to even, or up with probability ``t - floor(t)``.

    The uniform draws are indexed by the elements of ``t``, or of ``draws`` (a shape that broadcasts
    against ``t``: rows of one tensor at several scales then share each element's draw).
    """
    if not stochastic:
        return torch.round(t)
    low = torch.floor(t)
    return torch.where(hashed_uniform(t.shape if draws is None else draws, key, t.device) < t - low, low + 1, low)


def draw_key(device: torch.device) -> torch.Tensor:
    """A 32-bit key for :func:`hashed_uniform`, drawn from torch's default (CPU) generator on every device.

    The key is written on the device as a fill with a number, not copied from the host: a copy of a host
    tensor to a GPU waits for the GPU's queued work, once per quantizer call.
    """
    key = int(torch.randint(-(1 << 31), 1 << 31, (), dtype=torch.int32))
    return torch.full((), key, dtype=torch.int32, device=device)


@functools.cache
def device_constant(values: float | tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device``, made once per values, dtype and device and shared (never written to):
    building it from Python numbers at each call copies it from the host, and on a GPU that copy waits for the
    work queued before it."""
    return torch.tensor(values, dtype=dtype, device=device)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k as float32 for int32 ``k`` in [-126, 127], built from its exponent bits (exact on every device)."""
    return ((k + 127) << 23).view(torch.float32)


def pow2_float64(k: torch.Tensor) -> torch.Tensor:
    """2^k as float64 for integer ``k`` in [-1022, 1023], built from its exponent bits (exact on every device)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def scale_pow2(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``x * 2^k`` for int32 ``k`` in [-252, 252], exact wherever the result is: two power-of-two steps.

    The halves lie between ``x`` and the result, so no intermediate overflows where the result does
    not, nor falls into the subnormals where the result is normal; no float64 is needed.
    """
    half = k >> 1
    return x * pow2(half) * pow2(k - half)


def set_fused(enabled: bool) -> None:
    """Use torch.compile-fused kernels (default) or eager ones; both give identical results."""
    _FUSED["enabled"] = enabled


def _specialized(fn: Callable[..., Any], static: dict[str, Any], shapes: str) -> Callable[..., Any]:
    """A copy of ``fn`` with its keyword-only ``static`` arguments bound, under a code object of its own.

    Dynamo keeps its compiled variants and its recompile limit per code object; a copy per static
    signature and shape class (``shapes``) keeps the variants of one from crowding out those of another.
    """
    tag = "_".join([*(str(v) for v in static.values()), shapes])
    code = fn.__code__.replace(co_name=f"{fn.__name__}__{tag}")
    clone = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = {**(fn.__kwdefaults__ or {}), **static}
    return clone


def _compile_options() -> dict[str, Any]:
    """Inductor's options for a fused kernel: the eager kernels' arithmetic, so both give the same bits.

    No fused multiply-add contraction (Triton's default): the eager ops round each product. On the GPU, Triton's
    float division is approximate and flushes subnormals to zero unless told otherwise (options of recent torch
    releases, left out where a release lacks them). The thread count is fixed into the generated CPU code: naming
    it keys inductor's cache on it, so a kernel compiled by a single-threaded process is not reused by a
    multi-threaded one.
    """
    options: dict[str, Any] = {"emulate_precision_casts": True, "cpp.threads": torch.get_num_threads()}
    eager = getattr(torch._inductor.config, "eager_numerics", None)
    for name in ("division_rounding", "disable_ftz"):
        if hasattr(eager, name):
            options[f"eager_numerics.{name}"] = True
    return options


def fused(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn(*tensors, **static)`` as a torch.compile-fused kernel, one per set of static keywords and
    pattern of size-1 dimensions of the tensors.

    Static arguments must be keyword-only and are compiled in as constants. Tensor arguments are detached and
    made contiguous, so a compiled kernel is guarded on shapes alone. The whole function must compile as one graph
    (``fullgraph``) and without contracting ``a * b + c`` into an FMA, so it gives the eager result
    bit for bit. Where one kernel fails to compile, that kernel (that static signature and shape pattern)
    runs the same function eagerly from then on, with one warning per function; its other kernels stay fused.
    """
    kernels: dict[tuple, Callable[..., Any]] = {}  # a failed kernel's entry is ``fn`` itself

    @functools.wraps(fn)
    def call(*tensors: torch.Tensor, **static: Any) -> Any:
        tensors = tuple(t.detach().contiguous() for t in tensors)
        if not _FUSED["enabled"]:
            return fn(*tensors, **static)
        # dynamic shapes still specialize every dimension of size 1: one kernel per such pattern (and rank)
        shapes = "x".join("".join("1" if d == 1 else "n" for d in t.shape) for t in tensors)
        signature = (tuple(sorted(static.items())), shapes)
        if signature not in kernels:
            # dynamic=True would make the static integers symbolic too (a format's exponent range computed in the
            # kernel at run time): they are compiled in as the constants they are
            kernels[signature] = torch._dynamo.config.patch(specialize_int=True)(torch.compile(
                _specialized(fn, static, shapes), dynamic=True, fullgraph=True, options=_compile_options()))
        kernel = kernels[signature]
        if kernel is fn:
            return fn(*tensors, **static)
        try:
            return kernel(*tensors)
        except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the same eager math
            if fn not in kernels.values():  # the function's first failure
                warnings.warn(f"torch.compile failed for {fn.__name__} ({type(err).__name__}: {err}); that kernel "
                              "runs eagerly from now on", stacklevel=2)
            kernels[signature] = fn
            return fn(*tensors, **static)

    return call


def key_for(stochastic: bool, device: torch.device) -> torch.Tensor:
    """A fresh key for stochastic rounding, or a dummy for nearest (no random draw)."""
    return draw_key(device) if stochastic else torch.zeros((), dtype=torch.int32, device=device)


def is_stochastic(rounding: Rounding) -> bool:
    """Whether ``rounding`` (one of :data:`~qtrain.quant.choices.ROUNDINGS`) is stochastic; any other value is refused."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding {rounding!r} is not one of {ROUNDINGS}")
    return rounding == "stochastic"


def in_lanes(rows: torch.Tensor, stochastic: bool, per_row: bool, *keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
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
