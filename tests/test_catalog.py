"""The torch-free catalog (qtrain.catalog) names what the hardware meter holds and what the report reads of the methods."""

from __future__ import annotations

from qtrain import catalog
from qtrain.cost import hardware


def test_the_facts_the_report_reads():
    assert catalog.ALLOCATING == ("dynasty", "dfq", "fractrain")  # chooses precision as it trains
    assert catalog.GATED == ("dfq", "fractrain")  # reads model.dfq_options


def test_catalog_lists_the_hardware_models_every_run_prices():
    assert tuple(model.name for model in hardware.MODELS) == tuple(name for name, _ in catalog.HARDWARE)
