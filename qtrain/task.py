"""What a run learns to do: the loss it trains on and the metrics it reports, chosen by the dataset (classification,
or language modelling with perplexity and, on a character-level corpus, bits per character)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class Task:
    """A task: the cross-entropy of the model's scores against integer targets, averaged over positions (one per image
    in classification, one per token in language modelling: the output is ``(batch, positions, classes)`` and the
    target ``(batch, positions)``), and the metrics each split reports."""

    name: str
    score: str  # the headline metric of metrics.csv and summary.json's "final"
    higher_is_better: bool
    per_character: bool = False  # a character-level corpus: bits per character beside perplexity

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy of ``output`` (..., classes) against ``target`` (...), over every position."""
        return F.cross_entropy(output.flatten(0, -2), target.flatten(), reduction=reduction)

    @staticmethod
    def hits(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """How many positions the model's top score gets right (a 0-d tensor, left on the device)."""
        return (output.argmax(-1) == target).sum()

    @property
    def figures(self) -> tuple[str, ...]:
        """The metrics of each split: loss and accuracy (next-token accuracy for a language model), perplexity for a
        language model (``exp`` of the mean loss per token, its headline figure: lower is better), bits per character
        for one of characters (the mean loss per token in bits, ``loss / ln 2``: each token is one character of the
        text, ``<eos>`` a line's newline and ``<unk>`` a character rarer than ``data.min_count``)."""
        if self.name != "language_model":
            return ("loss", "acc")
        return ("loss", "acc", "ppl", "bpc") if self.per_character else ("loss", "acc", "ppl")

    def metrics(self, prefix: str, mean_loss: float, accuracy: float) -> dict[str, float]:
        """The metrics.csv columns of one split (``prefix``: train or test), named ``<prefix>_<figure>``."""
        values = {"loss": mean_loss, "acc": accuracy, "ppl": perplexity(mean_loss), "bpc": mean_loss / math.log(2)}
        return {f"{prefix}_{figure}": values[figure] for figure in self.figures}

    def best(self, values: list[float]) -> float | None:
        """The best of a metric's values over epochs (None for none)."""
        if not values:
            return None
        return max(values) if self.higher_is_better else min(values)


def perplexity(mean_loss: float) -> float:
    """``exp`` of a mean cross-entropy in nats; inf where it overflows (and NaN for NaN)."""
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return math.inf


CLASSIFICATION = Task("classification", "test_acc", higher_is_better=True)
LANGUAGE_MODEL = Task("language_model", "test_ppl", higher_is_better=False)
CHARACTER_MODEL = Task("language_model", "test_ppl", higher_is_better=False, per_character=True)
TASKS = {task.name: task for task in (CLASSIFICATION, LANGUAGE_MODEL)}
