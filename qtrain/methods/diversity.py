"""Gradient diversity (Yin et al. 2018): the switching signal of MuPPET and of AdaPT's PushUp,
``Δs = Σ_k ||g_k||² / ||Σ_k g_k||²`` over one layer's gradients (AdaPT paper eq. 3; MuPPET, AdaPT paper Sec. 2.2),
and a window that keeps its running sums (:class:`DiversityWindow`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def gradient_diversity(grads: Sequence[torch.Tensor]) -> float:
    """``Σ ||g||² / ||Σ g||²`` of ``grads`` (+inf where the sum is zero, NaN for no gradients).

    It is ``1/k`` when all ``k`` gradients are equal, 1 when they are orthogonal, and grows without bound as they
    cancel.
    """
    window = DiversityWindow()
    for g in grads:
        window.add(g)
    return window.diversity()


class DiversityWindow:
    """The running sums ``Σ ||g||²`` and ``Σ g`` of the gradients added since the last :meth:`clear`.

    It keeps the two sums instead of the gradients, so a window of a hundred batches costs two tensors per layer,
    not a hundred.
    """

    def __init__(self) -> None:
        self.count = 0
        self.sum_sq = 0.0
        self.total: torch.Tensor | None = None

    @torch.no_grad()
    def add(self, grad: torch.Tensor) -> None:
        g = grad.detach().double()
        self.sum_sq += float(g.square().sum())
        if self.total is not None and self.total.device != g.device:  # restored from a checkpoint on the CPU
            self.total = self.total.to(g.device)
        self.total = g.clone() if self.total is None else self.total.add_(g)
        self.count += 1

    def total_norm_sq(self) -> float:
        """``||Σ g||²`` (NaN for an empty window)."""
        return math.nan if self.total is None else float(self.total.square().sum())

    def diversity(self) -> float:
        denominator = self.total_norm_sq()
        if math.isnan(denominator):
            return math.nan
        return self.sum_sq / denominator if denominator > 0 else math.inf

    def clear(self) -> None:
        self.count, self.sum_sq, self.total = 0, 0.0, None

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "sum_sq": self.sum_sq, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.sum_sq, self.total = state["count"], state["sum_sq"], state["total"]
