"""Block-scaled formats: OCP Microscaling (MX: blocks of 32 with an E8M0 scale), NVIDIA's NVFP4 (blocks of 16 with an
E4M3 scale under a float32 one per tensor) and NVFP4's random Hadamard transform. Each function returns the tensor
dequantized, in float32, in the input's shape. The formats and the cost meter's constants: docs/formats.md."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from qtrain.quant.choices import MX_SCALE_RULES
from qtrain.quant.elements import ELEMENTS, element_math
from qtrain.quant.rounding import Rounding, device_constant, fused, is_stochastic, key_for, scale_pow2

SCALE_BITS = 8  # E8M0 (MX) and E4M3 (NVFP4) block scales alike
MX_BLOCK = 32
NVFP4_BLOCK = 16
E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT = -127, 127  # 0xFF is NaN; E8M0 has no zero and no infinity
NVFP4_TENSOR_SCALE_MIN = 2.0**-120  # the per-tensor scale's floor (see nvfp4_quantize)
E4M3_SMALLEST_NORMAL = 2.0**-6  # NVFP4's smallest block scale
MX_ELEMENTS = tuple(ELEMENTS)
# 1 / the element's largest magnitude, computed in double and rounded to float32 (Transformer Engine's max_norm_rcp)
MAX_NORMAL_RCP = {name: float(torch.tensor(1.0 / fmt.max_normal, dtype=torch.float32)) for name, fmt in ELEMENTS.items()}


def _block_view(x: torch.Tensor, dim: int, block: int) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``x`` as ``(outer, blocks, block, inner)``: runs of ``block`` consecutive elements along ``dim`` (dimension 2
    of the view), the last one zero-padded; and the function that takes a tensor of that shape back to ``x``'s
    layout. Nothing moves: without padding the view shares ``x``'s memory and the result is contiguous. A dimension
    shorter than a block is one block as it is (zero padding changes no block's amax, and copying is slow)."""
    dim = dim % x.dim()
    n = x.shape[dim]
    block = min(block, n)
    rows = x.reshape(math.prod(x.shape[:dim]), n, math.prod(x.shape[dim + 1:]))
    if n % block:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, -n % block))
    view = rows.reshape(rows.shape[0], -1, block, rows.shape[2])
    return view, lambda y: y.reshape(rows.shape)[:, :n].reshape(x.shape)


def _tile_view(x: torch.Tensor, block: int) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``x`` (2-D or more) as ``(batch, rows // block, block, cols // block, block)``: ``block`` x ``block`` tiles of
    its last two dimensions, zero-padded at the edges; and the function back to ``x``'s layout."""
    r, c = x.shape[-2:]
    flat = x.reshape(-1, r, c)
    if r % block or c % block:
        flat = torch.nn.functional.pad(flat, (0, -c % block, 0, -r % block))
    padded = flat.shape
    view = flat.reshape(padded[0], padded[1] // block, block, padded[2] // block, block)
    return view, lambda y: y.reshape(padded)[:, :r, :c].reshape(x.shape)


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 x) of non-negative float32 ``x`` from its exponent bits (int32); a subnormal or zero reads -127."""
    return ((x.view(torch.int32) >> 23) & 0xFF) - 127


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2 x) of non-negative float32 ``x`` (int32), exact: a power of two is its exponent, any other value
    one more; below 2^-126 (subnormals), -126 down to 2^-127 exclusive and -127 below it (and for zero)."""
    bits = x.view(torch.int32)
    normal = _floor_log2(x) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    subnormal = (x > 2.0**-127).to(torch.int32) - 127
    return torch.where(bits >= 0x800000, normal, subnormal)


def _mx_math(blocks: torch.Tensor, amax: torch.Tensor, key: torch.Tensor, max_normal_rcp: torch.Tensor, *, elem: str,
             stochastic: bool, ceil: bool) -> torch.Tensor:
    """MX on ``(outer, blocks, block, inner)`` with each block's ``amax``: shared exponent ``floor(log2 amax) -
    emax_elem`` (``ceil``: ``ceil(log2(amax * max_normal_rcp))``, the reciprocal of the element's largest magnitude
    rounded to float32, as a tensor) clamped to E8M0's range; elements on the element grid at that scale; a block
    with NaN or inf (no E8M0 scale) all NaN."""
    k = _ceil_log2(amax * max_normal_rcp) if ceil else _floor_log2(amax) - ELEMENTS[elem].emax
    k = k.clamp(E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)
    elements = element_math(scale_pow2(blocks, -k), key, elem=elem, stochastic=stochastic)
    return torch.where(amax < math.inf, scale_pow2(elements, k), math.nan)


_mx_with_amax = fused(_mx_math)


@fused
def _mx(blocks: torch.Tensor, key: torch.Tensor, max_normal_rcp: torch.Tensor, *, elem: str, stochastic: bool,
        ceil: bool) -> torch.Tensor:
    """:func:`_mx_math` with the blocks' amax found in the same kernel (NaN propagates)."""
    return _mx_math(blocks, blocks.abs().amax(2, keepdim=True), key, max_normal_rcp, elem=elem, stochastic=stochastic,
                    ceil=ceil)


def mx_quantize(x: torch.Tensor, elem: str, dim: int, block: int = MX_BLOCK, rounding: Rounding = "nearest",
                key: torch.Tensor | None = None, scale_rule: str = "floor") -> torch.Tensor:
    """``x`` in the OCP MX format with element ``elem`` (a key of ``ELEMENTS``), blocks of ``block`` along ``dim``.

    Per block (spec section 6.3): shared scale ``X = 2^(floor(log2 amax) - emax_elem)``, amax the block's
    largest magnitude and emax_elem the element format's largest normal exponent; with ``scale_rule="ceil"``
    ``X = 2^ceil(log2(amax * (1 / max_elem)))``, max_elem the element's largest magnitude and its reciprocal and
    the product rounded to float32 (Transformer Engine's MXFP8 scale, ``float_to_e8m0(amax * max_norm_rcp)``:
    the block's largest element does not saturate). The exponent is clamped to E8M0's -127..127 (a tiny block
    gets scale 2^-127; only an MXINT8 block with amax above 127/64 * 2^127 reaches the top); elements
    ``round_to_element(x / X)``, saturating at ±max normal (half to even, or stochastic with ``key``); returned
    as ``element * X``. An all-zero block stays zero; a block holding NaN or ±inf comes back all NaN (its amax
    has no E8M0 scale: the spec's NaN scale).
    """
    if elem not in ELEMENTS:
        raise ValueError(f"MX element {elem!r} is not one of {MX_ELEMENTS}")
    if scale_rule not in MX_SCALE_RULES:
        raise ValueError(f"MX scale rule {scale_rule!r} is not one of {MX_SCALE_RULES}")
    _check_float32(x)
    if x.numel() == 0:
        return x.clone()
    stochastic = is_stochastic(rounding)
    key = key_for(stochastic, x.device) if key is None else key.to(x.device)
    # a tensor: a compiled kernel would fold a literal into its product in another precision
    max_normal_rcp = device_constant(MAX_NORMAL_RCP[elem], torch.float32, x.device)
    ceil = scale_rule == "ceil"
    view, back = _block_view(x, dim, block)
    if view.shape[3] > 1:
        return back(_mx(view, key, max_normal_rcp, elem=elem, stochastic=stochastic, ceil=ceil))
    # blocks along the last dimension: torch's own reduction finds their amax (NaN propagates), a compiled one over
    # short contiguous runs being several times slower on the CPU; max is exact, so both give the same bits
    return back(_mx_with_amax(view, view.abs().amax(2, keepdim=True), key, max_normal_rcp, elem=elem,
                              stochastic=stochastic, ceil=ceil))


@fused
def _nvfp4(view: torch.Tensor, consts: torch.Tensor, key: torch.Tensor, *, two_d: bool, stochastic: bool) -> torch.Tensor:
    """NVFP4 on a block view (:func:`_block_view`, 4-D) or tile view (:func:`_tile_view`, 5-D), in torchao's order of
    operations; ``consts`` holds 6 (E2M1's max), 448 * 6 and the per-tensor scale's floor, as tensors (a
    compiled division by a literal becomes a multiplication by its rounded reciprocal)."""
    fp4_max, scale_max, floor = consts[0], consts[1], consts[2]
    magnitude = view.abs()
    tensor_amax = torch.where(magnitude < math.inf, magnitude, 0.0).amax()
    tensor_scale = torch.maximum(tensor_amax / scale_max, floor)
    block_amax = magnitude.amax(dim=(2, 4) if two_d else 2, keepdim=True)  # NaN propagates
    block_scale = torch.clamp(block_amax / fp4_max / tensor_scale, E4M3_SMALLEST_NORMAL, ELEMENTS["e4m3"].max_normal)
    block_scale = element_math(block_scale, key, elem="e4m3", stochastic=False)
    scaled = torch.clamp(view * (torch.reciprocal(tensor_scale) / block_scale), -6.0, 6.0)
    elements = element_math(scaled, key, elem="e2m1", stochastic=stochastic)
    return torch.where(block_amax < math.inf, elements * (tensor_scale * block_scale), math.nan)


def nvfp4_quantize(x: torch.Tensor, dim: int, block: int = NVFP4_BLOCK, rounding: Rounding = "nearest",
                   key: torch.Tensor | None = None, two_d: bool = False) -> torch.Tensor:
    """``x`` in NVFP4: E2M1 elements, an E4M3 scale per block of ``block`` along ``dim``, a float32 scale per tensor.

    In torchao's order (``nvfp4_quantize`` with ``per_tensor_amax_to_scale``), each step rounded in float32:
    tensor scale ``s = amax / (448 * 6)`` (amax over the finite values); per block ``e4m3((amax_b / 6) / s)``
    with the quotient clamped to [2^-6, 448] first (``S_b``); elements ``e2m1(clamp(x * ((1 / s) / S_b), -6,
    6))`` (half to even or stochastic); returned as ``element * (s * S_b)``. The tensor scale is at least
    2^-120, so an all-zero tensor stays zero (torchao divides by zero there) and ``1 / s`` stays finite. A
    block holding NaN or ±inf comes back all NaN. With ``two_d``, ``block`` x ``block`` tiles of the last two
    dimensions share a scale, whichever ``dim`` is given.
    """
    _check_float32(x)
    if x.numel() == 0:
        return x.clone()
    stochastic = is_stochastic(rounding)
    key = key_for(stochastic, x.device) if key is None else key.to(x.device)
    if two_d:
        if x.dim() < 2:
            raise ValueError("2-D NVFP4 blocks need a tensor of 2 or more dimensions")
        view, back = _tile_view(x, block)
    else:
        view, back = _block_view(x, dim, block)
    consts = device_constant((6.0, 448.0 * 6.0, NVFP4_TENSOR_SCALE_MIN), torch.float32, x.device)
    return back(_nvfp4(view, consts, key, two_d=two_d, stochastic=stochastic))


def _check_float32(x: torch.Tensor) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"block-scaled formats read float32; got {x.dtype}")


@functools.cache
def _hadamard(size: int, seed: int, device: torch.device) -> torch.Tensor:
    """The ``size`` x ``size`` orthogonal matrix ``H diag(s) / sqrt(size)``: Sylvester's Hadamard matrix H and
    random signs s drawn from a generator seeded with ``seed`` (the same on every device)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return (h * signs / math.sqrt(size)).to(device)  # float64: each caller rounds it once to its dtype


def random_hadamard(x: torch.Tensor, dim: int, size: int = NVFP4_BLOCK, seed: int = 0) -> torch.Tensor:
    """The block-diagonal randomized Hadamard transform of ``x`` along ``dim``: each run of ``size`` elements
    ``v`` becomes ``Q v`` with ``Q = H diag(s) / sqrt(size)`` (orthogonal; H Sylvester's, s random signs from
    ``seed``). A last partial run passes unchanged. The same transform of both operands of a GEMM along its
    reduction dimension leaves the product unchanged up to rounding (``Q^T Q = I``): NVFP4's recipe applies
    it to the inputs of the weight-gradient GEMM.
    """
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two; got {size}")
    dim = dim % x.dim()
    n = x.shape[dim]
    whole = n - n % size
    q = _hadamard(size, seed, x.device).to(x.dtype)
    # the tensor as it lies, (outer, n, inner), so nothing is moved: runs along the last dimension are rows times
    # Q^T, runs along another dimension Q times (size, inner) slices (a batched matmul over the outer indices)
    rows = x.reshape(math.prod(x.shape[:dim]), n, math.prod(x.shape[dim + 1:]))
    runs = rows[:, :whole].reshape(rows.shape[0], whole // size, size, rows.shape[2])
    turned = (runs.squeeze(3) @ q.T).unsqueeze(3) if rows.shape[2] == 1 else q @ runs
    return torch.cat([turned.reshape(rows.shape[0], whole, rows.shape[2]), rows[:, whole:]], dim=1).reshape(x.shape)
