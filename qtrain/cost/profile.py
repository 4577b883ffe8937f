"""Per-layer multiply-accumulate counts of a model, from one forward pass (METHODS.md, "Cost metric").

MACs are counted analytically from the shapes a forward hook sees: a convolution does
``C_in/groups * k_h * k_w`` MACs per output element, a linear layer ``in_features``, an LSTM cell
(DFQ's gates) ``4 * (input_size + hidden_size)`` per hidden unit. A layer called several times in one
forward (a gate cell shared across blocks) is counted at every call. This counts the forward GEMM;
the two backward GEMMs have the same count.
"""

from __future__ import annotations

import torch
from torch import nn

GEMM_LAYERS = (nn.Conv2d, nn.Linear, nn.LSTMCell)


def gemm_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The Conv2d, Linear and LSTMCell layers of ``model`` (quantized or not), by name, in model order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, GEMM_LAYERS)}


def _macs_per_output(layer: nn.Module) -> int:
    if isinstance(layer, nn.Conv2d):
        kh, kw = layer.kernel_size
        return layer.in_channels // layer.groups * kh * kw
    if isinstance(layer, nn.LSTMCell):
        return 4 * (layer.input_size + layer.hidden_size)
    return layer.in_features


@torch.no_grad()
def profile_macs(model: nn.Module, sample: torch.Tensor) -> dict[str, int]:
    """MACs per sample of each layer of :func:`gemm_layers` in one forward of ``sample`` (a batch) in eval mode."""
    counts: dict[str, int] = {}
    layers = gemm_layers(model)

    def hook(name: str):
        def record(layer: nn.Module, _inputs: tuple, out: torch.Tensor | tuple) -> None:
            out = out[0] if isinstance(out, tuple) else out  # an LSTM cell returns (h, c)
            counts[name] = counts.get(name, 0) + out.numel() * _macs_per_output(layer)
        return record

    handles = [layer.register_forward_hook(hook(name)) for name, layer in layers.items()]
    was_training = model.training
    try:
        model.eval()
        model(sample)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return {name: counts.get(name, 0) // sample.shape[0] for name in layers}
