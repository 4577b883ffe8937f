"""PFQ: progressive fractional quantization (FracTrain Sec. 3.1, Algorithm 1; appendix A): SBM's range-linear
quantizers stepped through a precision schedule FW(a0..an)/BW(g0..gn) (:mod:`qtrain.methods.progressive`).
Defaults, their sources and every departure from the paper and the reference code: docs/methods/pfq.md."""

from __future__ import annotations

from typing import Any

from qtrain.config import methods as schemas
from qtrain.methods.progressive import StageSchedule
from qtrain.methods.sbm import SBM, fw_bw, uniform_record
from qtrain.precision import Bits


class PFQ(SBM):
    cfg: schemas.PFQ

    def __init__(self, cfg: schemas.PFQ) -> None:
        super().__init__(cfg)
        self.schedule = StageSchedule(len(cfg.fw), cfg)

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
