"""What qtrain offers, as plain facts that need no torch: its methods and its hardware models.

The method registry (:mod:`qtrain.methods`) and the hardware meter (:mod:`qtrain.cost.hardware`) hold the classes,
in this order and under these names (a test ties them); the report reads the facts to colour, label and choose
its figures without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MethodFacts:
    name: str  # ``method.name`` in the config
    allocating: bool = False  # chooses precision per layer or per sample as it trains (a bit-allocation plot)
    gated: bool = False  # gates blocks per sample over the model's FW/BW options: reads ``model.dfq_options``


METHODS = (MethodFacts("float32"), MethodFacts("sbm"), MethodFacts("muppet"), MethodFacts("adapt"),
           MethodFacts("dynasty", allocating=True), MethodFacts("pfq"),
           MethodFacts("dfq", allocating=True, gated=True), MethodFacts("fractrain", allocating=True, gated=True))
METHOD_NAMES = tuple(method.name for method in METHODS)
ALLOCATING = tuple(method.name for method in METHODS if method.allocating)
GATED = tuple(method.name for method in METHODS if method.gated)
GATE_OPTIONS = "model.dfq_options"  # the FW/BW options of the gated methods: no other method reads the key

# (name, label): the name keys each model's figures in summary.json and metrics.csv (``bit_serial_seconds``)
HARDWARE = (("bit_serial", "bit-serial"), ("bitfusion", "BitFusion"))
