"""qtrain: quantized DNN training under one trainer and one cost model."""

__version__ = "0.1.0"
