"""The bit-MAC meter: the exact computational cost of a training run (FracTrain's CC), charged every step from the
method's precision record in effective MACs (float32-equivalent; bit-MACs are 1024 times that) and priced on the
hardware models. See docs/cost.md."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pandas as pd

from qtrain.cost.hardware import HardwareMeter
from qtrain.cost.profile import OperandSizes
from qtrain.precision import PrecisionRecord

GEMMS = ("forward", "backward_input", "backward_weight")


def float32_layers_of(macs: dict[str, int], record: PrecisionRecord) -> list[str]:
    """The layers that ``record`` leaves in float32: absent from it, or at 32 bits in all three GEMMs."""
    return [name for name in macs if name not in record or record[name].gemm_fractions == (1.0, 1.0, 1.0)]


def float32_share(macs: dict[str, int], names: list[str]) -> float:
    """The share of a float32 step's cost (its MACs) that the layers ``names`` take."""
    total = sum(macs.values())
    return sum(macs[name] for name in names) / total if total else 0.0


class CostMeter:
    def __init__(self, macs: dict[str, int], sizes: dict[str, OperandSizes] | None = None) -> None:
        self.macs = dict(macs)
        self.samples = 0
        self.effective = {name: [0.0, 0.0, 0.0] for name in self.macs}
        self.hardware = HardwareMeter(self.macs, sizes) if sizes is not None else None
        self._merged = self._figures()  # the figures at the last merge over ranks, every rank's alike

    def _accumulators(self) -> list[list[float]]:
        accs = list(self.effective.values())
        if self.hardware is not None:
            accs += [acc for layers in self.hardware.layers.values() for acc in layers.values()]
        return accs

    def _figures(self) -> list[float]:
        return [float(self.samples), *(v for acc in self._accumulators() for v in acc)]

    def merge_ranks(self, sum_over_ranks: Callable[[list[float]], list[float]]) -> None:
        """Add the other ranks' charges since the last merge (``sum_over_ranks`` sums a list elementwise over ranks)."""
        figures = self._figures()
        added = sum_over_ranks([now - then for now, then in zip(figures, self._merged)])
        merged = [then + more for then, more in zip(self._merged, added)]
        self.samples = round(merged[0])
        values = iter(merged[1:])
        for acc in self._accumulators():
            acc[:] = [next(values) for _ in acc]
        self._merged = merged

    def add(self, record: PrecisionRecord, samples: int) -> None:
        """Charge one step of ``samples`` samples at the precision in ``record`` (absent layers: float32)."""
        self.samples += samples
        for name, macs in self.macs.items():
            layer = record.get(name)
            fractions = layer.gemm_fractions if layer is not None else (1.0, 1.0, 1.0)
            acc = self.effective[name]
            for i, fraction in enumerate(fractions):
                acc[i] += samples * macs * fraction
        if self.hardware is not None:
            self.hardware.add(record, samples)

    def total(self) -> float:
        """Effective MACs so far."""
        return sum(sum(v) for v in self.effective.values())

    def float32_total(self) -> float:
        """What the same samples would have cost in float32."""
        return 3.0 * self.samples * sum(self.macs.values())

    def percent_of_float32(self) -> float:
        f32 = self.float32_total()
        return 100.0 * self.total() / f32 if f32 else 0.0

    def layer_fractions(self) -> dict[str, float]:
        """Each layer's cost so far relative to float32's for the same samples (1.0: float32 throughout)."""
        return {name: sum(self.effective[name]) / (3.0 * self.samples * macs) if self.samples * macs else 1.0
                for name, macs in self.macs.items()}

    def float32_layers(self) -> dict[str, Any]:
        """The layers that ran in float32 throughout, their share of float32's cost (of a step's MACs) and of the
        run's cost so far."""
        names = [name for name, fraction in self.layer_fractions().items() if math.isclose(fraction, 1.0)]
        total = self.total()
        return {"names": names, "share_of_float32_cost": float32_share(self.macs, names),
                "share_of_cost": sum(sum(self.effective[name]) for name in names) / total if total else None}

    def table(self) -> pd.DataFrame:
        """Per-layer cost: MACs per sample, effective MACs of each GEMM, and % of float32."""
        rows = []
        for name, macs in self.macs.items():
            eff = self.effective[name]
            f32 = 3.0 * self.samples * macs
            rows.append({"layer": name, "macs_per_sample": macs, **dict(zip(GEMMS, eff)),
                         "effective_macs": sum(eff), "float32_macs": f32,
                         "percent_of_float32": 100.0 * sum(eff) / f32 if f32 else 0.0,
                         **(self.hardware.layer_columns(name) if self.hardware is not None else {})})
        return pd.DataFrame(rows)

    def state_dict(self) -> dict:
        return {"samples": self.samples, "effective": {k: list(v) for k, v in self.effective.items()},
                **({"hardware": self.hardware.state_dict()} if self.hardware is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.samples = state["samples"]
        self.effective = {k: list(v) for k, v in state["effective"].items()}
        if self.hardware is not None:
            self.hardware.load_state_dict(state["hardware"])
        self._merged = self._figures()
