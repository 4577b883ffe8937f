"""CPT: cyclic precision training (Fu et al., ICLR 2021): SBM's range-linear quantizers whose forward bits follow
the reference code's cosine cycle per optimizer step from ``bits_min`` to ``bits_max``, gradients at ``grad_bits``.
Defaults, their sources, the cost and every departure from the paper and the reference code: docs/methods/cpt.md."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from qtrain.config import methods as schemas
from qtrain.methods.base import RunFacts, StepInfo
from qtrain.methods.sbm import SBM, fw_bw, held_depthwise_bits, uniform_record
from qtrain.precision import Bits


def cycle_period(total_steps: int, cycles: int) -> int:
    """Optimizer steps per cycle: the reference's ``int(iters / num_cyclic_period)`` (the rest of the run, fewer
    than ``cycles`` steps, starts one more cycle)."""
    return int(total_steps / cycles)


def cyclic_bits(step: int, period: int, low: int, high: int) -> int:
    """The forward bits of optimizer step ``step`` (from 0): half a cosine from ``low`` up towards ``high`` over each
    ``period`` steps, back to ``low`` at the next cycle, rounded half to even (the reference's ``np.rint``)."""
    phase = (step % period) / period
    return int(np.rint(low + 0.5 * (high - low) * (1 + np.cos(np.pi * phase + np.pi))))


def steps_per_epoch(facts: RunFacts) -> int:
    """Optimizer steps in an epoch: its batches, one step every ``accum_steps`` of them and at the epoch's end."""
    return -(-facts.batches_per_epoch // facts.accum_steps)


class CPT(SBM):
    cfg: schemas.CPT

    def __init__(self, cfg: schemas.CPT) -> None:
        super().__init__(cfg)
        self.steps_taken = 0
        self.total_steps = 0
        self.period = 0
        self._fw = int(cfg.bits_min)  # every cycle's first step: the bits the quantizers start at

    def current_bits(self) -> Bits:
        return fw_bw(self._fw, self.cfg.grad_bits)

    def prepare(self, model: nn.Module) -> nn.Module:
        model = super().prepare(model)
        model.register_forward_pre_hook(self._follow_schedule)
        return model

    def attach(self, optimizer: torch.optim.Optimizer, facts: RunFacts) -> None:
        per_epoch = steps_per_epoch(facts)
        self.cfg.check_steps_per_epoch(per_epoch, exact=True)
        self.total_steps = self.cfg.epochs * per_epoch
        self.period = cycle_period(self.total_steps, self.cfg.cycles)

    def bits_at(self, step: int) -> int:
        """The forward bits of optimizer step ``step`` (from 0)."""
        return cyclic_bits(step, self.period, self.cfg.bits_min, self.cfg.bits_max)

    def _follow_schedule(self, model: nn.Module, args: tuple) -> None:
        """Before a training forward: the bits of the step it belongs to (evaluation keeps the last step's)."""
        if model.training:
            self._set_forward_bits(self.bits_at(self.steps_taken))

    def _set_forward_bits(self, fw: int) -> None:
        """Weights and activations of every cycled layer at ``fw`` bits (in place: running ranges carry over)."""
        if fw == self._fw:
            return
        self._fw = fw
        for name in self.swapped:
            layer = self.model.get_submodule(name)
            if held_depthwise_bits(layer, self.cfg) is None:
                layer.quant.weight.bits = layer.quant.act.bits = fw
        self._record = uniform_record(self.model, self.swapped)

    def after_step(self, info: StepInfo) -> None:
        self.steps_taken += 1

    def training_flops_ratio(self) -> float:
        """The reference's "Training FLOPS ratio" over the steps taken: the mean over steps of
        ``(b*b + 2*b*g) / 3 / 32**2`` (forward, error and weight-gradient GEMMs; ``b`` the step's forward bits)."""
        g = self.cfg.grad_bits
        ratios = [(b * b + 2 * b * g) / 3 / 32**2 for b in map(self.bits_at, range(self.steps_taken))]
        return sum(ratios) / len(ratios) if ratios else 0.0

    def report(self, epochs: int) -> dict[str, Any]:
        return {"total_steps": self.total_steps, "period_steps": self.period, "steps_taken": self.steps_taken,
                "training_flops_ratio": self.training_flops_ratio()}

    def state_dict(self) -> dict[str, Any]:
        return {"steps_taken": self.steps_taken, "total_steps": self.total_steps, "period": self.period}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the step it reached, the quantizers at the bits of the last step trained (as an unbroken run's;
        the schedule comes with the state, so a checkpoint evaluates at its bits without the run's facts)."""
        self.steps_taken, self.total_steps, self.period = state["steps_taken"], state["total_steps"], state["period"]
        self._set_forward_bits(self.bits_at(max(self.steps_taken - 1, 0)))
