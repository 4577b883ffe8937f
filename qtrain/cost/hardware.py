"""Hardware models that price the cost meter's record: :class:`HardwareMeter` adds up seconds and joules per model and
layer, beside the same samples at 8 bits, and :func:`to_target` reads the time and energy to a test accuracy
(DYNASTY Fig. 7). The models: :mod:`qtrain.cost.bit_serial`, :mod:`qtrain.cost.bitfusion`; see docs/cost.md."""

from __future__ import annotations

import functools
import math
from typing import Any, Protocol

from qtrain.cost.bit_serial import BitSerial
from qtrain.cost.bitfusion import BitFusion
from qtrain.cost.profile import OperandSizes
from qtrain.precision import FLOAT32_LAYER, Bits, LayerPrecision, PrecisionRecord

BASELINE = LayerPrecision.uniform(Bits(8, 8, 8, 8), "baseline")


class HardwareModel(Protocol):
    name: str

    def gemm(self, options: list[tuple[float, float, float, float, float]], macs: float,
             elements: tuple[int, int, int]) -> tuple[float, float]: ...

    def layer_overhead(self, fmt: str, macs: float) -> tuple[float, float]: ...


MODELS: tuple[HardwareModel, ...] = (BitSerial(), BitFusion())  # every run's, as qtrain.catalog.HARDWARE lists them


def price_layer(model: HardwareModel, layer: LayerPrecision, macs: int, sizes: OperandSizes,
                samples: int) -> tuple[float, float]:
    """(seconds, joules) of one step of ``samples`` samples through a layer's three GEMMs at ``layer``'s precision.

    Each GEMM's options go to the model as ``(share, a, b, a_mac, b_mac)``: the operands' bits as stored and
    moved, and the widths the MAC units multiply (the same, but for scaled formats: ``layer.datapath``). A layer whose
    MAC units would multiply float elements (a NaN width: the models are integer accelerators) is not priced: NaN.
    """
    if layer.datapath is not None and any(math.isnan(b) for g in layer.datapath.gemm_operands() for b in g):
        return math.nan, math.nan
    total = macs * samples
    x, y, w = samples * sizes.inputs, samples * sizes.outputs, sizes.weight * (samples if sizes.weight_per_sample else 1)
    elements = ((x, w, y), (y, w, x), (x, y, w))  # forward, error, weight gradient: (input side, weight side, output)
    seconds, joules = model.layer_overhead(layer.fmt, total)
    for g in range(3):
        options = [(share, *bits.gemm_operands()[g], *(layer.datapath or bits).gemm_operands()[g])
                   for share, bits in layer.options]
        s, j = model.gemm(options, total, elements[g])
        seconds, joules = seconds + s, joules + j
    return seconds, joules


class HardwareMeter:
    """Seconds and joules per hardware model and layer, for the run and for its 8-bit baseline."""

    FIGURES = ("seconds", "joules", "baseline_seconds", "baseline_joules")

    def __init__(self, macs: dict[str, int], sizes: dict[str, OperandSizes],
                 models: tuple[HardwareModel, ...] = MODELS) -> None:
        unsized = [name for name, n in macs.items() if n and not (sizes[name].inputs and sizes[name].outputs)]
        if unsized:  # profiled with the layer not running (a gate skipping it): it would move nothing for the run
            raise ValueError(f"layers {', '.join(unsized)} have MACs but no operand elements: profile their sizes with "
                             "every layer running (Method.operand_sizes)")
        self.macs, self.sizes, self.models = macs, sizes, models
        self.layers = {m.name: {name: [0.0] * len(self.FIGURES) for name in macs} for m in models}
        # a step's record mostly repeats the last one's; bounded, since DFQ's per-sample shares change every step
        self._price = functools.lru_cache(maxsize=4096)(self._priced)

    def _priced(self, model: HardwareModel, name: str, layer: LayerPrecision, samples: int) -> tuple[float, float]:
        return price_layer(model, layer, self.macs[name], self.sizes[name], samples)

    def add(self, record: PrecisionRecord, samples: int) -> None:
        for model in self.models:
            for name, acc in self.layers[model.name].items():
                figures = (*self._price(model, name, record.get(name, FLOAT32_LAYER), samples),
                           *self._price(model, name, BASELINE, samples))
                for i, value in enumerate(figures):
                    acc[i] += value

    def totals(self) -> dict[str, dict[str, float]]:
        """Per model: the run's and the baseline's seconds and joules, the speedup and the energy ratio."""
        out = {}
        for model, layers in self.layers.items():
            sums = dict(zip(self.FIGURES, (sum(v[i] for v in layers.values()) for i in range(len(self.FIGURES)))))
            sums["speedup_vs_8bit"] = sums["baseline_seconds"] / sums["seconds"] if sums["seconds"] else None
            sums["energy_vs_8bit"] = sums["joules"] / sums["baseline_joules"] if sums["baseline_joules"] else None
            out[model] = sums
        return out

    def columns(self) -> dict[str, float]:
        """The cumulative seconds and joules of each model, as metrics.csv columns."""
        return {f"{model}_{k}": v[k] for model, v in self.totals().items() for k in ("seconds", "joules")}

    def layer_columns(self, name: str) -> dict[str, float]:
        return {f"{model}_{k}": layers[name][i] for model, layers in self.layers.items()
                for i, k in enumerate(self.FIGURES[:2])}

    def state_dict(self) -> dict[str, Any]:
        return {model: {name: list(v) for name, v in layers.items()} for model, layers in self.layers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.layers = {model: {name: list(v) for name, v in layers.items()} for model, layers in state.items()}


def to_target(history: list[dict[str, Any]], target_acc: float, models: list[str]) -> dict[str, Any] | None:
    """The first epoch whose test accuracy reaches ``target_acc``, with each model's cumulative seconds and joules."""
    for row in history:
        if row["test_acc"] >= target_acc:
            return {"target_acc": target_acc, "epoch": row["epoch"],
                    **{f"{m}_{k}": row[f"{m}_{k}"] for m in models for k in ("seconds", "joules")}}
    return None
