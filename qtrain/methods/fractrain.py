"""FracTrain: DFQ whose cp target rises at PFQ's turning points (FracTrain Sec. 3.3, Algorithm 2; appendix G).
The targets are ``cp_schedule`` or appendix G's rule (``cp_total``); defaults and departures:
docs/methods/fractrain_stages.md."""

from __future__ import annotations

from typing import Any

from qtrain.config import methods as schemas
from qtrain.config.methods import appendix_g_targets
from qtrain.methods.dfq import DFQ
from qtrain.methods.progressive import StageSchedule


class FracTrain(DFQ):
    cfg: schemas.FracTrain

    def __init__(self, cfg: schemas.FracTrain) -> None:
        super().__init__(cfg)
        self.targets = [float(t) for t in cfg.cp_schedule]
        if cfg.cp_total is not None:
            self.targets = appendix_g_targets(cfg.cp_total, len(self.targets), cfg.cp_step)
        self.schedule = StageSchedule(len(self.targets), cfg,
                                      "train_objective" if cfg.indicator_loss is schemas.IndicatorLoss.TOTAL else "train_loss")

    def target_cp(self) -> float:
        return self.targets[self.schedule.stage]

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        super().end_epoch(epoch, metrics)
        metrics["train_objective"] = metrics["train_loss"] + metrics["cost_term"]
        self.schedule.end_epoch(epoch, metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state["schedule"])
