"""The per-layer precision record: the single source for precision logging and the cost model. For each quantized
layer, the bits of each operand of its three training GEMMs, with each option's share where it mixes precisions."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn


@dataclass(frozen=True)
class Bits:
    """Bit-widths of the operands of a layer's three training GEMMs.

    ``weight`` and ``act`` meet in the forward GEMM, ``grad`` (the error-path gradient) and ``weight``
    in the error GEMM, ``act_weight`` and ``grad_weight`` (the activation and gradient on the
    weight-gradient path) in the weight-gradient GEMM. ``act_weight`` None means ``act`` (only
    DYNASTY quantizes the activation differently there).
    """

    weight: float = 32
    act: float = 32
    grad: float = 32
    grad_weight: float = 32
    act_weight: float | None = None

    def __post_init__(self) -> None:
        if self.act_weight is None:
            object.__setattr__(self, "act_weight", self.act)

    def gemm_operands(self) -> tuple[tuple[float, float], tuple[float, float], tuple[float, float]]:
        """The (input-side, weight-side) operand bits of the forward, error and weight-gradient GEMMs."""
        return (self.act, self.weight), (self.grad, self.weight), (self.act_weight, self.grad_weight)

    def gemm_fractions(self) -> tuple[float, float, float]:
        """Cost of the forward, error and weight-gradient GEMMs relative to float32 (FracTrain's CC)."""
        (a, w), (g, w), (aw, gw) = self.gemm_operands()
        return a * w / 1024, g * w / 1024, aw * gw / 1024


FLOAT32 = Bits()


@dataclass(frozen=True)
class LayerPrecision:
    """The precision options in use by one layer, each with the share of the work it does.

    ``datapath``, where set, is what the MAC units multiply when that differs from the bits charged per element:
    a scaled format's integer elements without the amortized scale bits, NaN for float elements (which the hardware
    models do not price); the same for every option.
    """

    options: tuple[tuple[float, Bits], ...]
    fmt: str = "float32"
    datapath: Bits | None = None

    @classmethod
    def uniform(cls, bits: Bits, fmt: str) -> LayerPrecision:
        return cls(((1.0, bits),), fmt)

    @cached_property
    def gemm_fractions(self) -> tuple[float, float, float]:
        """Share-weighted cost of the three GEMMs relative to float32 (computed once: the record is frozen)."""
        total = [0.0, 0.0, 0.0]
        for share, bits in self.options:
            for i, f in enumerate(bits.gemm_fractions()):
                total[i] += share * f
        return total[0], total[1], total[2]


PrecisionRecord = dict[str, LayerPrecision]

FLOAT32_LAYER = LayerPrecision.uniform(FLOAT32, "float32")


class EpochPrecision:
    """The sample-weighted mean of the precision records of an epoch's steps: what precision.csv logs."""

    def __init__(self) -> None:
        self.samples = 0
        self.weights: dict[str, dict[Bits, float]] = {}
        self.formats: dict[str, str] = {}
        self.datapaths: dict[str, Bits | None] = {}

    def add(self, record: PrecisionRecord, samples: int) -> None:
        self.samples += samples
        for name, layer in record.items():
            self.formats[name], self.datapaths[name] = layer.fmt, layer.datapath
            acc = self.weights.setdefault(name, {})
            for share, bits in layer.options:
                acc[bits] = acc.get(bits, 0.0) + share * samples

    @classmethod
    def merged(cls, parts: list[EpochPrecision]) -> EpochPrecision:
        """The epoch over every rank's samples, from each rank's own (in rank order, so every rank gets the same)."""
        if len(parts) == 1:
            return parts[0]
        out = cls()
        for part in parts:
            out.samples += part.samples
            out.formats.update(part.formats)
            out.datapaths.update(part.datapaths)
            for name, acc in part.weights.items():
                into = out.weights.setdefault(name, {})
                for bits, weight in acc.items():
                    into[bits] = into.get(bits, 0.0) + weight
        return out

    def record(self) -> PrecisionRecord:
        return {name: LayerPrecision(tuple((w / self.samples, bits) for bits, w in acc.items()), self.formats[name],
                                     self.datapaths[name]) for name, acc in self.weights.items()}


@torch.no_grad()
def weight_density(layer: nn.Module) -> float:
    """Share of non-zero weights in what the forward pass sees (the quantized copy, where there is one).

    A weight quantizer that tracks the density of its last output is read rather than run again. A layer
    without weights (a Transformer's attention products) has none: NaN.
    """
    tracked = getattr(getattr(getattr(layer, "quant", None), "weight", None), "density", None)
    if tracked is not None:
        return float(tracked)
    if hasattr(layer, "quantized_weight"):
        weights = [layer.quantized_weight()]
    else:
        weights = [p for n, p in layer.named_parameters(recurse=False) if n.startswith("weight")]
    if not weights:
        return math.nan
    return sum(w.count_nonzero().item() for w in weights) / sum(w.numel() for w in weights)


def _mac_bits(datapath: Bits | None) -> dict[str, float]:
    if datapath is None:
        return {}
    return {f"{operand}_mac_bits": getattr(datapath, operand) for operand in ("weight", "act", "grad", "grad_weight")}


def precision_rows(epoch: int, step: int, record: PrecisionRecord, layers: dict[str, nn.Module],
                   extra: dict[str, dict] | None = None) -> list[dict]:
    """precision.csv epoch rows: one per layer and precision option, with its share and the weight density.

    ``extra`` adds a method's columns to each layer's rows (AdaPT's format, lookback and resolution); a layer
    whose record has a ``datapath`` (scaled formats) adds the widths the MAC units multiply (``*_mac_bits``).
    """
    rows = []
    for name, layer in layers.items():
        entry = record.get(name, FLOAT32_LAYER)
        density = weight_density(layer)
        for share, bits in entry.options:
            rows.append({"epoch": epoch, "step": step, "layer": name, "event": "epoch", "format": entry.fmt,
                         "share": share, "weight_bits": bits.weight, "act_bits": bits.act, "grad_bits": bits.grad,
                         "grad_weight_bits": bits.grad_weight, "act_weight_bits": bits.act_weight, "density": density,
                         **_mac_bits(entry.datapath), **(extra or {}).get(name, {})})
    return rows
