"""What qtrain offers, as plain facts that need no torch: its methods and its hardware models.

The methods are the registry of their config schemas (:data:`qtrain.config.methods.METHODS`), in the order the report
lists them; the hardware meter (:mod:`qtrain.cost.hardware`) holds the hardware models in this order and under these
names (a test ties them). The report reads these facts to colour, label and choose its figures without importing torch.
"""

from __future__ import annotations

from qtrain.config import methods as schemas

METHOD_NAMES = tuple(schemas.METHODS)
# chooses precision per layer or per sample as it trains (a bit-allocation plot)
ALLOCATING = tuple(name for name, schema in schemas.METHODS.items() if schema.allocating)
# gates blocks per sample over the model's FW/BW options: reads ``model.dfq_options``
GATED = tuple(name for name, schema in schemas.METHODS.items() if issubclass(schema, schemas.Gated))
GATE_OPTIONS = "model.dfq_options"  # the FW/BW options of the gated methods: no other method reads the key

# (name, label): the name keys each model's figures in summary.json and metrics.csv (``bit_serial_seconds``)
HARDWARE = (("bit_serial", "bit-serial"), ("bitfusion", "BitFusion"))
