"""Cost accounting: MAC profiles of models and the per-step bit-MAC meter."""

from qtrain.cost.meter import CostMeter
from qtrain.cost.profile import gemm_layers, profile_macs

__all__ = ["CostMeter", "gemm_layers", "profile_macs"]
