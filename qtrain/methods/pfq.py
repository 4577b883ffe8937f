"""PFQ: progressive fractional quantization (FracTrain Sec. 3.1, Algorithm 1; appendix A).

SBM's range-linear quantizers (weights per output channel, activations per tensor, gradients per
tensor with stochastic rounding) stepped through a precision schedule FW(a0..an)/BW(g0..gn): weights
and activations take the FW bits of the current stage, gradients on both backward paths the BW bits.
The stage advances at the loss indicator's turning points (``switch: auto``, the paper's default
epsilon 0.05, alpha 0.3; the reference code's defaults are 0.15 and 0.4) or after given epochs
(``switch: manual``, the appendix's Manual-PFQ; the reference's README commands pass 0.05 and 0.3, so its
published runs used the paper's values). metrics.csv records each epoch's stage, the
indicator's loss difference and the epsilon it was compared with; precision.csv the bits each epoch
trained at, so every turning point shows as a change of bits.

Defaults that follow the reference code (GATECH-EIC/FracTrain, ``train_pfq.py``): the activation
range is the tensor's global min/max (``act_range: tensor``, its ``reduce_type='extreme'``) with a
running average of weight 0.9 on the old value for evaluation (``act_momentum``); the stem is
quantized and the classifier stays float32 (``first_layer: quantized``, ``last_layer: float32``).
Departures: the reference's indicator counts an "epoch" as 400 iterations and the loss as their mean,
qtrain uses data epochs; its MobileNetV2 keeps every convolution's weights in float32 unless a weight
precision is passed, while qtrain quantizes weights at the stage's FW bits (depthwise ones held at
``depthwise_bits``), as the paper describes. On ImageNet (Table 2's ResNet-18) the reference's
``fractrain_imagenet`` has no plain ResNet (its definitions are commented out), so its PFQ there cannot be
read; the CIFAR code's choices (stem quantized, classifier float32) are carried over.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from qtrain.errors import ConfigError
from qtrain.methods.base import check_bits
from qtrain.methods.progressive import StageSchedule
from qtrain.methods.sbm import SBM, fw_bw, uniform_record
from qtrain.precision import Bits


class PFQ(SBM):
    name = "pfq"

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        self.schedule = StageSchedule(len(cfg.fw), cfg)

    def check_schedule(self) -> None:
        cfg = self.cfg
        check_bits(cfg, "fw", "bw")
        if len(cfg.fw) != len(cfg.bw) or not cfg.fw:
            raise ConfigError(f"method.fw={list(cfg.fw)} and method.bw={list(cfg.bw)} are not allowed: "
                              "the schedule needs one FW and one BW bit-width per stage, at least one stage")

    def current_bits(self) -> Bits:
        stage = self.schedule.stage
        return fw_bw(self.cfg.fw[stage], self.cfg.bw[stage])

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        if self.schedule.end_epoch(epoch, metrics):
            self._apply_stage()

    def _apply_stage(self) -> None:
        """Set every quantizer to the current stage's bits (in place: running ranges carry over)."""
        for name in self.swapped:
            layer = self.model.get_submodule(name)
            bits, q = self.layer_bits(layer), layer.quant
            q.weight.bits, q.act.bits, q.grad.bits = int(bits.weight), int(bits.act), int(bits.grad)
        self._record = uniform_record(self.model, self.swapped)

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state["schedule"])
        self._apply_stage()
