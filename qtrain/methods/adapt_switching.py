"""AdaPT's precision switching (AdaPT paper Sec. 3.3, Algorithms 2-4; lorenz0890/AdaPT, optimizers/msgd_fp.py):
PushDown, PushUp and the strategy, lookback and resolution rules (eqs. 1-5), as pure functions and one small state
class, so each rule can be checked on its own. The readings of the paper and the reference: docs/methods/adapt.md."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from qtrain.quant.formats import Rounding, fixed_point, fixed_point_candidates
from qtrain.quant.rounding import key_for


@dataclass(frozen=True)
class Format:
    """Fixed point <wl, fl>: ``wl`` bits including the sign, ``fl`` of them fractional."""

    wl: int
    fl: int


def histograms(values: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    """Counts of each row of ``values`` in ``bins`` equal bins over [lo, hi] (values outside go to the end bins).

    As ``torch.histc``: a value at ``hi`` falls in the last bin. A constant reference (``lo == hi``)
    gets the bins over ``[lo - |lo|, lo + |lo|]`` (``[-1, 1]`` around zero), so a value that moved lands elsewhere.
    """
    width = hi - lo
    half = torch.where(lo.abs() > 0, lo.abs(), 1.0)
    lo, width = torch.where(width > 0, lo, lo - half), torch.where(width > 0, width, 2 * half)
    index = ((values - lo) / width * bins).floor().clamp(0, bins - 1).long()
    rows = values.shape[0]
    index = index + torch.arange(rows, device=values.device).reshape(-1, 1) * bins
    return torch.bincount(index.reshape(-1), minlength=rows * bins).reshape(rows, bins).to(values.dtype)


def kl_divergence(p_counts: torch.Tensor, q_counts: torch.Tensor) -> torch.Tensor:
    """``KL(P || Q) = Σ P log2(P / Q)`` per row of count histograms (eq. 2), in bits (Sec. 3.3: "the average
    number of bits lost").

    Bins where P is empty add nothing; a bin where P has mass and Q has none makes it +inf. Zero
    for identical histograms, positive otherwise.
    """
    p = p_counts / p_counts.sum(-1, keepdim=True)
    q = q_counts / q_counts.sum(-1, keepdim=True)
    terms = torch.where(p > 0, p * (p.log2() - q.log2()), 0.0)
    return terms.sum(-1)


def _bisect(count: int, passes: Callable[[int], bool]) -> int:
    """Index of the first of ``count`` entries that ``passes``, by bisection, the last entry (the search's
    ceiling) counting as passing without being asked.

    It ends with the entry before the answer failing (or none before it): the answer is a boundary.
    ``passes`` is asked about ceil(log2(count)) entries only, so a search costs that many candidates.
    """
    low, high = -1, count - 1
    while high - low > 1:
        mid = (low + high) // 2
        if passes(mid):
            high = mid
        else:
            low = mid
    return high


def information_loss(weights: torch.Tensor, candidates: list[Format], resolution: int,
                     rounding: Rounding = "stochastic", key: torch.Tensor | None = None) -> torch.Tensor:
    """KL(quantized || float) of ``weights`` at each candidate format, all candidates in one batch.

    Every candidate rounds a weight with the same stochastic draw (``key``, or one drawn here), so
    candidates that differ only in range lose the same information wherever neither clamps.
    """
    return loss_function(weights, resolution, rounding, key)(candidates)


def loss_function(weights: torch.Tensor, resolution: int, rounding: Rounding = "stochastic",
                  key: torch.Tensor | None = None) -> Callable[[list[Format]], torch.Tensor]:
    """:func:`information_loss` of ``weights`` as a function of the candidates, the float histogram made once.

    Every call rounds with the same draws (``key``, or one drawn here), so a candidate's loss does not
    depend on which others are asked with it, nor on which call asks it.
    """
    flat = weights.detach().reshape(-1).float()
    finite = flat[flat.abs() < math.inf]
    key = key_for(rounding == "stochastic", flat.device) if key is None else key
    lo, hi = (finite.min(), finite.max()) if finite.numel() else (None, None)
    reference = histograms(finite.reshape(1, -1), lo, hi, resolution) if finite.numel() else None

    def loss(candidates: list[Format]) -> torch.Tensor:
        if reference is None:
            return torch.zeros(len(candidates))
        wl = torch.tensor([c.wl for c in candidates], device=flat.device)
        fl = torch.tensor([c.fl for c in candidates], device=flat.device)
        quantized = fixed_point_candidates(finite, wl, fl, rounding, key)
        return kl_divergence(histograms(quantized, lo, hi, resolution), reference).cpu()

    return loss


WIDEST = Format(32, 31)
REFERENCE_FL_FLOOR = 4  # the reference's PushDown searches FL from 4 up


def reference_loss(weights: torch.Tensor, fmt: Format, resolution: int, rounding: Rounding = "stochastic") -> float:
    """The reference code's information loss of ``weights`` at ``fmt`` (lorenz0890/AdaPT, msgd_fp.py, ``__fpq_loss``).

    The weights and their quantized copy (a fresh draw per call) are counted by ``torch.histc`` in
    ``resolution`` bins, the weights over their own range, the copy over the weights' range (values
    beyond it are dropped), each normalized to sum 1; the loss is torch's ``KLDivLoss(reduction=
    'batchmean', log_target=True)`` with the weights' frequencies as input and the copy's as target:
    ``Σ exp(q) (q - p) / resolution``, frequencies read as log-probabilities. It is zero where both
    histograms agree and can take either sign otherwise; NaN where the copy has no value in range.
    """
    w = weights.detach().float()
    quantized = fixed_point(w, fmt.wl, fmt.fl, rounding)
    p = torch.histc(w, resolution)
    q = torch.histc(quantized, resolution, float(w.min()), float(w.max()))
    return float(F.kl_div(p / p.sum(), q / q.sum(), reduction="batchmean", log_target=True))


def _ceil_half(a: int, b: int) -> int:
    return (a + b + 1) // 2


def reference_search(current: Format, lossy: Callable[[Format], bool]) -> Format:
    """The reference code's PushDown walk from ``current`` (msgd_fp.py, ``__push_down_fl``, ``__push_down_wl``).

    FL: from ``low = 4``, ``high = FL``; each round takes ``mid = ceil((low + high) / 2)``, asks ``lossy``
    at <WL, low> (the lower bound, not ``mid``), then sets ``low = mid`` if lossy, else ``high = mid``,
    until ``high - low <= 1`` (at most ``high - low`` rounds); the answer is ``low``. WL: from ``low = FL``
    (the found one), ``high = WL``, the same rounds asking at <mid, FL>; the answer is ``low``. Both
    answers are thus bounds that were lossy (or the start): where every format loses, the walk ends
    one bit below the current FL and WL, and PushUp's at least one bit brings it back.
    """
    low, high = REFERENCE_FL_FLOOR, current.fl
    for _ in range(high - low):
        mid = _ceil_half(low, high)
        if lossy(Format(current.wl, low)):
            low = mid
        else:
            high = mid
        if high - low <= 1:
            break
    fl = low
    low, high = fl, current.wl
    for _ in range(high - low):
        mid = _ceil_half(low, high)
        if lossy(Format(mid, fl)):
            low = mid
        else:
            high = mid
        if high - low <= 1:
            break
    return Format(low, fl)


def pushdown(weights: torch.Tensor, current: Format, resolution: int, epsilon: float = 0.0,
             rounding: Rounding = "stochastic", search: str = "reference") -> Format:
    """The coarsest format whose quantized ``weights`` lose no information (Sec. 3.3, Algorithm 3).

    ``search: reference`` is lorenz0890/AdaPT's (:func:`reference_search`): it examines the first output
    filter ``weights[0]`` only, calls a format lossy where :func:`reference_loss` is > 0 (``epsilon`` is
    not used), and searches at or below the current format, FL from 4, so it rarely lowers a format
    by more than a bit. The other two read the paper: a format is lossless where the discrete KL
    divergence of the whole tensor's histograms (:func:`information_loss`, in bits) is <= ``epsilon``.
    ``range`` looks over every format up to <32, 31>, as Sec. 3.3 states it ("the smallest quantization
    <WL_min, FL_min> of W s.t. KL = 0") and eq. 6 prices it (a bisection over the word lengths), so a
    lossy format rises to the smallest lossless one; ``current`` only at or below the current format,
    as Algorithm 3 starts from it. These two search first the fractional length (at the ceiling's word
    length, FL from 0 up), then the word length (at that FL, WL from FL + 1 up), each by bisection that
    computes the KL of only the candidates it visits (about log2 of a stage's candidates: 5 of 32 FLs,
    where computing all of them took most of a switch), with the same answer. Bisection assumes
    the loss grows as the format coarsens; the ceiling is the answer where every coarser format loses.
    Both stages round each weight with the same draw, so the word-length stage sees the loss of the
    fractional length it starts from wherever a word length clamps nothing.
    """
    if search == "reference":
        first = weights[0]
        return reference_search(current, lambda fmt: reference_loss(first, fmt, resolution, rounding) > 0)
    ceiling = WIDEST if search == "range" else current
    loss = loss_function(weights, resolution, rounding)  # one draw per weight for both stages

    def lowest_lossless(candidates: list[Format]) -> Format:
        return candidates[_bisect(len(candidates), lambda i: float(loss([candidates[i]])[0]) <= epsilon)]

    fl = lowest_lossless([Format(ceiling.wl, fl) for fl in range(ceiling.fl + 1)]).fl
    return lowest_lossless([Format(wl, fl) for wl in range(fl + 1, ceiling.wl + 1)])


def gradient_diversity_for(norm_sum: float, total_norm_sq: float, count: int, formula: str) -> float:
    """The window's diversity as ``formula`` reads it: eq. 3's ``Σ||g_k|| / ||Σg_k||`` (``paper``, norms not
    squared: >= 1 by the triangle inequality), or the reference code's ``k / ||Σg_k||`` (``reference``: it
    divides the number of gradients in the window, zero ones included, by the norm of their sum).

    The window holds unit-norm gradients (or zero ones), so the two differ only by the zero gradients:
    the reference counts them in ``k``, eq. 3 adds nothing for them. +inf where the sum is zero.
    """
    if total_norm_sq <= 0:
        return math.inf
    return (count if formula == "reference" else norm_sum) / math.sqrt(total_norm_sq)


def increase(diversity: float, fl_min: int, strategy: str, formula: str = "reference") -> int:
    """Eq. 4: PushUp's increase ``s`` of the fractional length from the window's gradient diversity.

    ``reference`` (the default) is lorenz0890/AdaPT's reading, which produced the published tables:
    with ``L = ln Δs - 1``, where ``L > 0``: ``s1 = max(ceil(1 / L²), 1)``, ``s2 = max(min(ceil(32 L²), 32)
    - FL_min, 0)``, no bound on ``s1``: as ``ln Δs`` falls to 1, ``s1`` grows without bound, and under
    ``mean`` or ``max`` the format then jumps to the top of its range (the reference's logged runs show
    such jumps). ``paper`` reads the garbled eq. 4 as ``s1 = max(ceil(1 / (ln Δs - 1)), 1)`` and ``s2 =
    max(min(ceil(32 log2 Δs - 1), 32) - FL_min, 1)``, applied where ``ln Δs > 0``, with ``s1`` capped at 32:
    ``s`` counts bits of a fractional length of at most 32, so a larger suggestion says no more than 32
    does under ``min`` and ``max`` (FL stops at 32 either way), and ``1 / (ln Δs - 1)`` needs a value at its
    pole ``ln Δs = 1``; the cap changes ``mean`` only, where an unbounded ``s1`` would make the mean of the
    two suggestions the pole's alone. The strategy combines them: ``min``, ``ceil(mean)`` or ``max``.
    Otherwise, and where Δs is 0 or infinite, s = 1.
    """
    if not 0 < diversity < math.inf:
        return 1
    log = math.log(diversity)
    if formula == "paper":
        if log <= 0:
            return 1
        s1 = 32 if log == 1 else max(math.ceil(1 / (log - 1)), 1)
        s1 = min(s1, 32)
        s2 = max(min(math.ceil(32 * math.log2(diversity) - 1), 32) - fl_min, 1)
    else:
        excess = log - 1
        if excess <= 0:
            return 1
        s1 = max(math.ceil(1 / excess**2), 1)
        s2 = max(min(math.ceil(32 * excess**2), 32) - fl_min, 0)
    if strategy == "min":
        return min(s1, s2)
    if strategy == "max":
        return max(s1, s2)
    return math.ceil(0.5 * (s1 + s2))


def pushup(minimal: Format, s: int, buffer_bits: int, formula: str = "reference") -> Format:
    """The new format from PushDown's ``minimal`` one and the increase ``s``, framed by ``buffer_bits``.

    ``FL = min(FL_min + s, 32)``; then the buffer bits: ``FL = min(FL, 32 - buff)``, ``WL = max(min(FL + buff,
    32), WL')`` where ``WL'`` is ``WL_min`` in the paper's reading and the reference's intermediate
    ``min(max(WL_min, FL) + 1, 32)`` in its own (the paper's intermediate WL is overwritten by the
    buffer step).
    """
    fl = min(minimal.fl + s, 32)
    floor = minimal.wl if formula == "paper" else min(max(minimal.wl, fl) + 1, 32)
    fl = min(fl, 32 - buffer_bits)
    return Format(max(min(fl + buffer_bits, 32), floor), fl)


def adapt_strategy(strategy: str, average_loss: float, loss: float) -> str:
    """Eq. 5: toward more precision while the loss does not fall below its recent average, ``min`` when it does."""
    if abs(average_loss) > abs(loss):
        return "min"
    return {"mean": "max", "min": "mean"}.get(strategy, strategy)


def adapt_lookback(lookback: int, diversity: float, low: int, high: int, momentum: float) -> int:
    """``lb_new = min(max(ceil(high / Δs), low), high)`` (``high`` where Δs is not positive), then
    ``lb = ceil(γ lb_new + (1 - γ) lb)`` with momentum ``γ``."""
    if 0 < diversity < math.inf:
        new = min(max(math.ceil(high / diversity), low), high)
    elif diversity == math.inf:
        new = low
    else:
        new = high
    return math.ceil(momentum * new + (1 - momentum) * lookback - 1e-9)  # 0.33 * 25 + 0.67 * 25 is 25, not 26


def adapt_resolution(resolution: int, lookback: int, lb_low: int, lb_high: int, low: int, high: int) -> int:
    """One more histogram bin while the lookback sits at its upper bound, one fewer at its lower bound."""
    if lookback == lb_high:
        resolution += 1
    elif lookback == lb_low:
        resolution -= 1
    return min(max(resolution, low), high)
