"""The torch-free catalog (qtrain.catalog) names what the method registry and the hardware meter hold."""

from __future__ import annotations

from qtrain import catalog
from qtrain.cost import hardware
from qtrain.methods import METHODS


def test_catalog_lists_the_registered_methods_in_their_order():
    assert tuple(METHODS) == catalog.METHOD_NAMES


def test_the_facts_the_report_reads():
    assert catalog.ALLOCATING == ("dynasty", "dfq", "fractrain")  # chooses precision as it trains
    assert catalog.GATED == ("dfq", "fractrain")  # reads model.dfq_options


def test_catalog_lists_the_hardware_models_every_run_prices():
    assert tuple(model.name for model in hardware.MODELS) == tuple(name for name, _ in catalog.HARDWARE)
