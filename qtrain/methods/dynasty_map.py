"""DYNASTY's Adaptive Bit-Width Map Generator (DYNASTY paper Sec. 3.2.2 and 3.3), as pure tensor functions: eqs. 3a-3b,
the first lambda, Algorithm 1's tuning of lambda, eq. 4's smoothing and the rounding to {0, 2, 4, 6, 8}.
The weighted average, the edge cases and why: docs/methods/dynasty.md."""

from __future__ import annotations

import torch

from qtrain.quant.rounding import device_constant


def relative_sensitivity(sensitivity: torch.Tensor, computation: torch.Tensor) -> torch.Tensor:
    """Eq. 3b: ``1/2 log2(S / T)`` per block (float64; -inf where S = 0, and where T = 0: a block that takes part
    in no MAC, such as inputs a strided 1x1 convolution skips)."""
    computation = computation.double()
    r = 0.5 * torch.log2(sensitivity.double() / computation)
    return torch.where(computation > 0, r, -torch.inf)


def bit_widths(r: torch.Tensor, lam: float, beta: float) -> torch.Tensor:
    """Eq. 3a: ``max(0, min(r - lambda, beta))`` (0 where r = -inf)."""
    return (r - lam).clamp(0.0, beta)


def average_weights(computation: torch.Tensor, average: str) -> torch.Tensor:
    """The weights of the average held at alpha: T_i (``macs``), or 1 for each block of T_i > 0 (``blocks``)."""
    if average == "macs":
        return computation
    return (computation > 0).to(computation.dtype)


def weighted_average(bits: torch.Tensor, computation: torch.Tensor) -> float:
    """The computation-weighted average bit-width (eq. 2b's left side)."""
    weight = computation.double()
    return float((bits.double() * weight).sum() / weight.sum())


def first_lambda(r: torch.Tensor, computation: torch.Tensor, alpha: float) -> float:
    """lambda^ = mean(r) - alpha over the blocks of finite r (weighted by computation)."""
    finite = torch.isfinite(r)
    if not finite.any():
        return 0.0
    return weighted_average(r[finite], computation[finite]) - alpha


def tune_lambda(lam_in: float, r: torch.Tensor, computation: torch.Tensor, alpha: float, beta: float,
                iterations: int) -> float:
    """Algorithm 1: lambda so that the computation-weighted average of eq. 3a is ``alpha``."""
    finite = r[torch.isfinite(r)]
    if finite.numel() == 0:
        return lam_in

    def average(lam: float) -> float:
        return weighted_average(bit_widths(r, lam, beta), computation)

    lam_out = lam_in
    lam0, lam1 = float(finite.min()) - alpha, float(finite.max()) - alpha
    if average(lam0) < alpha:  # unreachable: the most bits the bracket gives
        return lam0
    for _ in range(iterations):
        b0, b1, b = average(lam0), average(lam1), average(lam_out)
        if b > alpha:
            if b == b1:
                break
            t = (b - alpha) / (b - b1)
            lam0, lam_out = lam_out, (1 - t) * lam_out + t * lam1
        else:
            if b == b0:
                break
            t = (b - alpha) / (b - b0)
            lam_out, lam1 = (1 - t) * lam_out + t * lam0, lam_out
    return lam_out


def smooth(last: torch.Tensor, new: torch.Tensor, gamma: float) -> torch.Tensor:
    """Eq. 4: ``gamma * b_last + (1 - gamma) * b_new``."""
    return gamma * last + (1 - gamma) * new


def round_to_levels(bits: torch.Tensor, levels: tuple[int, ...]) -> torch.Tensor:
    """Each width to the nearest of ``levels`` (ascending; int32), a tie to the level of even index.

    On {0, 2, 4, 6, 8} that is round half to even on bits / 2: 1 -> 0, 3 -> 4, 5 -> 4, 7 -> 8, so ties
    do not shift the average one way.
    """
    grid = device_constant(levels, bits.dtype, bits.device)
    distance = (bits.unsqueeze(-1) - grid).abs()
    lower = distance.argmin(dim=-1)  # the first of equal distances: the lower level
    upper = (lower + 1).clamp(max=len(levels) - 1)
    tie = distance.gather(-1, upper.unsqueeze(-1)) == distance.gather(-1, lower.unsqueeze(-1))
    nearest = torch.where(tie.squeeze(-1) & (lower % 2 == 1), upper, lower)
    return grid[nearest].to(torch.int32)
