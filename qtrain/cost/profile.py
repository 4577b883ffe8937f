"""Per-layer multiply-accumulate counts of a model, from one forward pass (FracTrain's computational cost), and each
layer's operand sizes (:func:`operand_sizes`, what the hardware models move through memory). The counting rules:
docs/cost.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from qtrain.quant.layers import MatMul

GEMM_LAYERS = (nn.Conv2d, nn.Linear, nn.LSTMCell, MatMul)


def gemm_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The Conv2d, Linear, LSTMCell and MatMul layers of ``model`` (quantized or not), by name, in model order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, GEMM_LAYERS)}


def _macs_per_output(layer: nn.Module, inputs: tuple) -> int:
    if isinstance(layer, MatMul):
        return inputs[0].shape[-1]
    if isinstance(layer, nn.Conv2d):
        kh, kw = layer.kernel_size
        return layer.in_channels // layer.groups * kh * kw
    if isinstance(layer, nn.LSTMCell):
        return 4 * (layer.input_size + layer.hidden_size)
    return layer.in_features


@dataclass(frozen=True)
class OperandSizes:
    """Elements of a layer's GEMM operands: the weight (per call), the input and the output (per sample).

    A MatMul's second operand, in the weight's place, is an activation: ``weight`` then counts it per
    sample (``weight_per_sample``), and ``inputs`` counts the first operand."""

    weight: int
    inputs: int
    outputs: int
    weight_per_sample: bool = False


Observe = Callable[[nn.Module, tuple, torch.Tensor], dict[str, int]]


@torch.no_grad()
def _per_call(model: nn.Module, sample: torch.Tensor, observe: Observe) -> dict[str, dict[str, int]]:
    """Sum ``observe(layer, inputs, output)`` over every call of every :func:`gemm_layers` layer in one eval forward."""
    sums: dict[str, dict[str, int]] = {name: {} for name in gemm_layers(model)}

    def hook(name: str):
        def record(layer: nn.Module, inputs: tuple, out: torch.Tensor | tuple) -> None:
            out = out[0] if isinstance(out, tuple) else out  # an LSTM cell returns (h, c)
            for key, value in observe(layer, inputs, out).items():
                sums[name][key] = sums[name].get(key, 0) + value
        return record

    handles = [layer.register_forward_hook(hook(name)) for name, layer in gemm_layers(model).items()]
    was_training = model.training
    try:
        model.eval()
        model(sample)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return sums


def profile_macs(model: nn.Module, sample: torch.Tensor) -> dict[str, int]:
    """MACs per sample of each layer of :func:`gemm_layers` in one forward of ``sample`` (a batch) in eval mode."""
    sums = _per_call(model, sample, lambda layer, inputs, out: {"macs": out.numel() * _macs_per_output(layer, inputs)})
    return {name: found.get("macs", 0) // sample.shape[0] for name, found in sums.items()}


def operand_sizes(model: nn.Module, sample: torch.Tensor) -> dict[str, OperandSizes]:
    """:class:`OperandSizes` of each layer of :func:`gemm_layers`, summed over its calls in one forward."""
    def observe(layer: nn.Module, inputs: tuple, out: torch.Tensor) -> dict[str, int]:
        if isinstance(layer, MatMul):
            return {"weight": inputs[1].numel(), "inputs": inputs[0].numel(), "outputs": out.numel()}
        weight = sum(p.numel() for n, p in layer.named_parameters(recurse=False) if n.startswith("weight"))
        return {"weight": weight, "inputs": sum(t.numel() for t in inputs if torch.is_tensor(t)), "outputs": out.numel()}

    n = sample.shape[0]
    sums = _per_call(model, sample, observe)
    layers = gemm_layers(model)
    sizes = {}
    for name, found in sums.items():
        per_sample = isinstance(layers[name], MatMul)
        weight = found.get("weight", 0) // n if per_sample else found.get("weight", 0)
        sizes[name] = OperandSizes(weight, found.get("inputs", 0) // n, found.get("outputs", 0) // n, per_sample)
    return sizes
