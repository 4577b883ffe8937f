"""SBM: 8-bit training with range-based linear quantization (Banner et al., NeurIPS 2018).

METHODS.md, "SBM". Weights: per-output-channel min/max, nearest rounding. Activations (the input of
every Conv2d/Linear): per-tensor range from the batch, by default the mean over the batch of the
per-sample min/max as in the reference code (``act_range: tensor`` takes the global min/max), with a
running average of the range for evaluation; nearest rounding. Gradients (``grad_output``): per-tensor
min/max, stochastic rounding. ``grad_weight_bits`` above ``grad_bits`` is the "gradient bifurcation"
FW-8/BW-16: the error path stays at ``grad_bits``, the weight-gradient path gets the wider grid.
Batch norm stays float32. Range BatchNorm is not implemented (off in FracTrain's baselines too).
"""

from __future__ import annotations

from omegaconf import DictConfig
from torch import nn

from qtrain.errors import ConfigError
from qtrain.methods.base import Method, check_bits
from qtrain.precision import LayerPrecision, PrecisionRecord
from qtrain.quant.layers import OperandQuantizers, swap_layers
from qtrain.quant.quantizers import RangeLinear


class SBM(Method):
    name = "sbm"

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        check_bits(cfg, "weight_bits", "act_bits", "grad_bits", "grad_weight_bits")
        if cfg.act_range not in ("tensor", "sample_mean"):
            raise ConfigError(f"method.act_range={cfg.act_range!r} is not allowed (choose from: tensor, sample_mean)")
        if not 0 < cfg.act_momentum <= 1:
            raise ConfigError(f"method.act_momentum={cfg.act_momentum!r} is not allowed: it must be in (0, 1]")
        self._record: PrecisionRecord = {}

    def _quantizers(self, name: str, layer: nn.Module, first: str, last: str) -> OperandQuantizers | None:
        cfg = self.cfg
        if not cfg.quantize_first_last and name in (first, last):
            return None
        bifurcated = cfg.grad_weight_bits != cfg.grad_bits
        return OperandQuantizers(
            weight=RangeLinear(cfg.weight_bits, "channel", "nearest"),
            act=RangeLinear(cfg.act_bits, cfg.act_range, "nearest", momentum=cfg.act_momentum),
            grad=RangeLinear(cfg.grad_bits, "tensor", "stochastic"),
            grad_weight=RangeLinear(cfg.grad_weight_bits, "tensor", "stochastic") if bifurcated else None,
        )

    def prepare(self, model: nn.Module) -> nn.Module:
        names = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
        swapped = swap_layers(model, lambda n, m: self._quantizers(n, m, names[0], names[-1]))
        self._record = {name: LayerPrecision.uniform(model.get_submodule(name).quant.bits(), RangeLinear.fmt)
                        for name in swapped}
        return model

    def precision(self) -> PrecisionRecord:
        return self._record
