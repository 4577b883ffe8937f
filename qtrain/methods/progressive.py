"""When to move to the next stage of a progressive schedule (FracTrain Sec. 3.1, Algorithm 1; appendix A): PFQ's
precision stages and FracTrain's cp targets, at the loss indicator's turning points or at given epochs.
The indicator and its departures from the reference code: docs/methods/pfq.md."""

from __future__ import annotations

import math
from typing import Any

from qtrain.config import methods as schemas


class LossIndicator:
    """Algorithm 1's turning-point test on one loss per epoch."""

    def __init__(self, epsilon: float, alpha: float, window: int = 5, scale_epochs: int = 10) -> None:
        self.epsilon, self.alpha, self.window, self.scale_epochs = epsilon, alpha, window, scale_epochs
        self.first: list[float] = []  # the first scale_epochs losses of training: L_scale
        self.recent: list[float] = []  # the current stage's last `window` losses
        self.last_difference = math.nan
        self.compared_epsilon = epsilon

    def update(self, loss: float, may_turn: bool = True) -> bool:
        """Record an epoch's loss; True when it is a turning point (never where ``may_turn`` is False).

        Sets ``last_difference`` and ``compared_epsilon``, the values this epoch's test compared (NaN
        while the window fills); a turning point then decays ``epsilon`` and clears the window.
        With ``may_turn`` False (the last stage) the window keeps sliding and nothing decays.
        """
        if len(self.first) < self.scale_epochs:
            self.first.append(loss)
        self.recent = [*self.recent, loss][-self.window:]
        self.compared_epsilon = self.epsilon
        if len(self.recent) < self.window:
            self.last_difference = math.nan
            return False
        scale = sum(self.first) / len(self.first)
        self.last_difference = max(abs(earlier - loss) for earlier in self.recent[:-1]) / scale
        if not may_turn or self.last_difference > self.epsilon:
            return False
        self.epsilon *= self.alpha
        self.recent = []
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon, "first": list(self.first), "recent": list(self.recent),
                "last_difference": self.last_difference, "compared_epsilon": self.compared_epsilon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epsilon, self.first, self.recent = state["epsilon"], list(state["first"]), list(state["recent"])
        self.last_difference, self.compared_epsilon = state["last_difference"], state["compared_epsilon"]


class StageSchedule:
    """The current stage of ``stages``; ``cfg`` holds switch, epsilon, alpha, window, scale_epochs, manual_epochs
    (its schema, :class:`qtrain.config.methods.Progressive`)."""

    def __init__(self, stages: int, cfg: schemas.Progressive, loss: str = "train_loss") -> None:
        self.stages, self.manual = stages, cfg.switch is schemas.Switch.MANUAL
        self.manual_epochs = list(cfg.manual_epochs or [])
        self.indicator = LossIndicator(cfg.epsilon, cfg.alpha, cfg.window, cfg.scale_epochs)
        self.loss = loss  # the metrics.csv column the indicator reads
        self.stage = 0

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> bool:
        """After epoch ``epoch`` (0-based): True when the next stage starts.

        Reads the epoch's loss (``metrics[self.loss]``) and adds the metrics.csv columns: the stage the epoch trained
        at, the indicator's loss difference and the epsilon it was compared with (also in the last
        stage and under manual switching, where the indicator only watches).
        """
        trained, last = self.stage, self.stage == self.stages - 1
        fired = self.indicator.update(metrics[self.loss], may_turn=not (self.manual or last))
        turning = not last and (epoch + 1 == self.manual_epochs[self.stage] if self.manual else fired)
        self.stage += turning
        metrics.update(stage=trained, loss_difference=self.indicator.last_difference,
                       epsilon=self.indicator.compared_epsilon)
        return turning

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "indicator": self.indicator.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage = state["stage"]
        self.indicator.load_state_dict(state["indicator"])
