"""SBM: 8-bit training with range-based linear quantization (Banner et al., NeurIPS 2018, Sec. 3), and its quantizers
(:func:`range_linear_quantizers`), which also serve PFQ, DFQ and FracTrain. Defaults, their sources, the two readings
of "FW-8/BW-16" and every departure from the paper and the reference code: docs/methods/sbm.md."""

from __future__ import annotations

from torch import nn

from qtrain.config import methods as schemas
from qtrain.methods.base import Method
from qtrain.precision import Bits, LayerPrecision, PrecisionRecord
from qtrain.quant.layers import MatMul, OperandQuantizers, swap_layers
from qtrain.quant.quantizers import RangeLinear


def float_ends(cfg: schemas.FloatEnds, names: list[str]) -> set[str]:
    """Which of the first and last of ``names`` (the Conv2d/Linear layers) ``first_layer``/``last_layer`` keep in float32."""
    ends = ((names[0], cfg.first_layer), (names[-1], cfg.last_layer))
    return {name for name, precision in ends if precision is schemas.Precision.FLOAT32}


def is_depthwise(layer: nn.Module) -> bool:
    return isinstance(layer, nn.Conv2d) and layer.groups > 1 and layer.groups == layer.in_channels


def held_depthwise_bits(layer: nn.Module, cfg: schemas.RangeLinear) -> Bits | None:
    """The bits ``cfg.depthwise_bits`` holds ``layer`` at, or None where it is not a held depthwise conv."""
    held = cfg.depthwise_bits
    return fw_bw(held.fw, held.bw) if held is not None and is_depthwise(layer) else None


def fw_bw(fw: int, bw: int) -> Bits:
    """FracTrain's FW-a/BW-g: weights and activations at ``fw`` bits, gradients (both paths) at ``bw``."""
    return Bits(fw, fw, bw, bw)


def range_linear_quantizers(bits: Bits, cfg: schemas.RangeLinear, layer: nn.Module | None = None) -> OperandQuantizers:
    """SBM's quantizers at ``bits``; a separate weight-gradient quantizer only where its bits differ.

    A :class:`~qtrain.quant.layers.MatMul`'s second operand, in the weight's place, is an activation:
    it is quantized like one (the batch's range, a running range for evaluation) at the weight bits.
    """
    second_is_activation = isinstance(layer, MatMul)
    bifurcated = bits.grad_weight != bits.grad and not second_is_activation
    return OperandQuantizers(
        weight=(RangeLinear(int(bits.weight), cfg.act_range.value, "nearest", momentum=float(cfg.act_momentum))
                if second_is_activation else RangeLinear(int(bits.weight), "channel", "nearest")),
        act=RangeLinear(int(bits.act), cfg.act_range.value, "nearest", momentum=float(cfg.act_momentum)),
        grad=RangeLinear(int(bits.grad), "tensor", "stochastic"),
        grad_weight=RangeLinear(int(bits.grad_weight), "tensor", "stochastic") if bifurcated else None,
    )


def uniform_record(model: nn.Module, names: list[str]) -> PrecisionRecord:
    """The precision record of single-option quantized layers, read from their quantizers."""
    return {name: LayerPrecision.uniform(model.get_submodule(name).quant.bits(), RangeLinear.fmt) for name in names}


class SBM(Method):
    cfg: schemas.SBM

    def __init__(self, cfg: schemas.SBM) -> None:
        super().__init__(cfg)
        self.model: nn.Module | None = None
        self.swapped: list[str] = []
        self._record: PrecisionRecord = {}

    def current_bits(self) -> Bits:
        """The bits of every layer that is not depthwise, at this point of training."""
        cfg = self.cfg
        return Bits(cfg.weight_bits, cfg.act_bits, cfg.grad_bits, cfg.grad_weight_bits)

    def layer_bits(self, layer: nn.Module) -> Bits:
        return held_depthwise_bits(layer, self.cfg) or self.current_bits()

    def prepare(self, model: nn.Module) -> nn.Module:
        keep_float = float_ends(self.cfg, [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))])
        self.swapped = swap_layers(model, lambda n, m: None if n in keep_float
                                   else range_linear_quantizers(self.layer_bits(m), self.cfg, m), matmuls=True)
        self.model = model
        self._record = uniform_record(model, self.swapped)
        return model

    def precision(self) -> PrecisionRecord:
        return self._record
