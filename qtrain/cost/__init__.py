"""Cost accounting: MAC profiles of models, the per-step bit-MAC meter and the hardware models that price it."""

from qtrain.cost.hardware import HardwareMeter, to_target
from qtrain.cost.meter import CostMeter, float32_layers_of, float32_share
from qtrain.cost.profile import OperandSizes, gemm_layers, operand_sizes, profile_macs

__all__ = ["CostMeter", "HardwareMeter", "OperandSizes", "float32_layers_of", "float32_share", "gemm_layers",
           "operand_sizes", "profile_macs", "to_target"]
