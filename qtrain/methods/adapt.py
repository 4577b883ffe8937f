"""AdaPT: adaptive precision training (Kummer et al., AdaPT paper Sec. 3, Algorithms 1-4, Sec. 4.1).

Every Conv2d/Linear computes on fixed point <WL, FL> of its own (Sec. 3.2), weights and activations
(the layer's input) at the same format, stochastic rounding, from float32 master weights; the
backward pass stays float32 (Sec. 5: "executing backward passes in highly precise float32"), so the
precision record charges the forward GEMM at WL x WL and the two backward GEMMs at WL x 32. Every
layer starts at <8, 4> (Sec. 4.1.1), its weights drawn by truncated-normal fan-in variance scaling
(Sec. 3.1: ``σ = sqrt(s / n)``, cut at ``±sqrt(3 s / n)``, ``init_scale`` s).

Precision switching (Algorithm 2), once per optimizer step, before the update: the strategy adapts
to the loss (eq. 5); each layer's weight gradient, L2-normalized, joins its lookback window, and the
lookback and resolution adapt; a layer whose window holds ``lookback`` gradients switches:
:func:`~qtrain.methods.adapt_switching.pushdown` finds the coarsest format with no information loss
(KL <= ``kl_epsilon`` at the layer's resolution, Algorithm 3),
:func:`~qtrain.methods.adapt_switching.pushup` raises it by the window's gradient diversity (eq. 4)
and frames it with ``buffer_bits``; the window then starts over. The normalized gradients are also
what the optimizer applies (``normalize_grads``, Sec. 3.3). Loss (Sec. 3.4): ``L + α ||W||_1 + β/2
||W||²_2 + P`` over the quantized layers' float32 weights, with ``P`` the mean over layers of
``WL / 32 * density`` (a constant per step: it moves the loss the strategy reads, not the gradient).
Reduce-on-plateau and gradient accumulation come from the run (``sched=plateau``,
``train.accum_steps``); the ``adapt_*`` experiments set the paper's.

precision.csv adds each layer's ``wl``, ``fl``, lookback, resolution and density to its epoch rows
and a ``switch`` row at every switch (with the PushDown minimum, the diversity and the strategy).
summary.json (``adapt``) holds the final formats, the number of switches and the seconds they took,
and the performance model of Sec. 4.1.2 (:mod:`qtrain.cost.adapt_model`).

Where the default departs from the paper or the reference code (lorenz0890/AdaPT):
- ``kl_epsilon`` (Algorithm 3's ε, in bits): the paper asks for KL = 0, which a histogram of
  stochastically rounded weights almost never reaches (a weight close to a bin edge crosses it), so
  the default tolerates 1e-3 bits. The reference's KL is not a divergence (``KLDivLoss`` on
  probabilities, often negative, so almost any format passes).
- PushDown (``pushdown_search: range``) looks for the smallest lossless format over the whole range,
  as Sec. 3.3 states it and eq. 6 prices it, so a format that loses information rises to the smallest
  one that does not; ``current`` searches at or below the current format only, as Algorithm 3 starts
  from it and the reference does (from <8,4>, PushUp's one bit at a time is then the only way up). It
  examines the whole weight tensor, FL from 0 and WL from FL + 1, with a correct bisection; quantized
  values beyond the float range count in the end bins (clipping is a loss). The reference examines the
  first output filter, searches FL from 4 and WL from FL, returns the last lossy bound, and drops
  out-of-range values from its histogram.
- PushUp is eq. 4's closed form, as in the reference, not Algorithm 4's loop. ``pushup: paper`` reads
  eq. 4 as METHODS.md gives it; ``reference`` is the code's (diversity ``k / ||Σg||``, squared terms,
  WL from the new FL). With unit-norm gradients the paper's Δs lies in [1/k, inf) and exceeds 1 only
  where a window's gradients partly cancel, so most of its PushUps add one bit; the reference's
  diversity is at least 1 and passes e (its threshold) more often.
- The lookback's momentum rounds up, so a lookback that rose above its lower bound does not return to
  it (as in the paper's formula and the reference); the resolution then only grows.
- Activations are quantized where they enter a Conv2d/Linear; the reference also quantizes layer
  outputs, batch-norm and pooling tensors (batch norm stays float32 here, METHODS.md). Gradients are
  not quantized (the reference quantizes weight gradients at the layer's format); biases and
  batch-norm parameters stay float32 (the reference quantizes them at the preceding layer's format)
  and keep the model's initialization (the reference draws biases from U(-0.5, 0.5)); weights are
  quantized at every forward, the reference once per optimizer step.
- A Transformer's attention products QK^T and attention x V (two activations, no weight) stay
  float32 and are charged so: a layer's format follows from its weights (Sec. 3.2), and these have
  none (the paper trains CNNs only).
- Gradient normalization, L1 and the penalty cover the Conv2d/Linear weights (the reference: every
  parameter, batch-norm ones included). L2 is the loss's β/2 ||W||² (the reference adds it as weight
  decay to the normalized gradient): the experiment configs set ``optim.weight_decay=0``.
- Lookback momentum 0.33 and bounds 25..100 for every run, as Sec. 4.1.1 says (the reference configs
  use 0.33 for AlexNet on CIFAR-10, 0.9 for AlexNet and ResNet on CIFAR-100, 1.0 for ResNet on
  CIFAR-10, and an upper bound of 150 for AlexNet on CIFAR-100).
- The penalty ``P`` has no gradient (word length and density are counts): it shifts the loss the
  strategy compares, as the reference's, and does not by itself steer the weights.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from qtrain import distributed
from qtrain.cost.adapt_model import LayerState, check_baselines
from qtrain.errors import ConfigError
from qtrain.methods.adapt_switching import (
    PUSHDOWN_SEARCHES,
    PUSHUP_FORMULAS,
    STRATEGIES,
    Format,
    adapt_lookback,
    adapt_resolution,
    adapt_strategy,
    gradient_diversity_for,
    increase,
    pushdown,
    pushup,
)
from qtrain.methods.base import RunFacts, StepInfo, check_choice, check_int, check_number, check_positive
from qtrain.methods.diversity import DiversityWindow
from qtrain.methods.priced import PricedByPerformanceModel
from qtrain.precision import Bits, LayerPrecision, PrecisionRecord
from qtrain.quant.layers import OperandQuantizers, swap_layers
from qtrain.quant.quantizers import DensityTracked, FixedPoint

INITS = ("tnvs", "model")
log = logging.getLogger(__name__)


def tnvs_init_(weight: torch.Tensor, scale: float) -> None:
    """Sec. 3.1: truncated normal, ``σ = sqrt(scale / fan_in)``, cut at ``±sqrt(3 scale / fan_in)``."""
    fan_in = weight[0].numel()
    bound = math.sqrt(3 * scale / fan_in)
    nn.init.trunc_normal_(weight, 0.0, math.sqrt(scale / fan_in), -bound, bound)


class LayerSwitchState:
    """One layer's switching state: format, lookback, resolution and its lookback window."""

    def __init__(self, fmt: Format, lookback: int, resolution: int) -> None:
        self.format, self.lookback, self.resolution = fmt, lookback, resolution
        self.window = DiversityWindow()

    def state_dict(self) -> dict[str, Any]:
        return {"wl": self.format.wl, "fl": self.format.fl, "lookback": self.lookback,
                "resolution": self.resolution, "window": self.window.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.format = Format(state["wl"], state["fl"])
        self.lookback, self.resolution = state["lookback"], state["resolution"]
        self.window.load_state_dict(state["window"])


class AdaPT(PricedByPerformanceModel):
    name = "adapt"

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        check_int(cfg.initial, "wl", 2, 32, prefix="method.initial.")
        check_int(cfg.initial, "fl", 0, cfg.initial.wl - 1, prefix="method.initial.")
        check_choice(cfg, "init", INITS)
        check_positive(cfg, "init_scale")
        check_int(cfg, "buffer_bits", 1, 31)
        for group in ("lookback", "resolution"):
            check_int(cfg[group], "low", 1 if group == "lookback" else 2, prefix=f"method.{group}.")
            check_int(cfg[group], "high", cfg[group].low, prefix=f"method.{group}.")
        check_number(cfg.lookback, "momentum", 0, 1, prefix="method.lookback.")
        check_number(cfg, "kl_epsilon", 0, math.inf)
        check_choice(cfg, "pushup", PUSHUP_FORMULAS)
        check_choice(cfg, "pushdown_search", PUSHDOWN_SEARCHES)
        check_choice(cfg, "strategy", STRATEGIES)
        for key in ("l1", "l2"):
            check_number(cfg, key, 0, math.inf)
        for key in ("normalize_grads", "penalty"):
            if not isinstance(cfg[key], bool):
                raise ConfigError(f"method.{key}={cfg[key]!r} is not allowed: it must be true or false")
        check_baselines(cfg.performance_model)
        self.model: nn.Module | None = None
        self.layers: dict[str, nn.Module] = {}
        self.states: dict[str, LayerSwitchState] = {}
        self.strategy: str = cfg.strategy
        self.losses: deque[float] = deque(maxlen=cfg.lookback.high)
        self.step_losses: list[torch.Tensor] = []
        self.switches, self.switch_seconds = 0, 0.0
        self.switch_rows: list[dict[str, Any]] = []
        self._record: PrecisionRecord = {}

    def prepare(self, model: nn.Module) -> nn.Module:
        cfg = self.cfg
        if cfg.init == "tnvs":
            for layer in model.modules():
                if isinstance(layer, (nn.Conv2d, nn.Linear)):
                    tnvs_init_(layer.weight.data, cfg.init_scale)
        start = Format(cfg.initial.wl, cfg.initial.fl)
        names = swap_layers(model, lambda name, layer: OperandQuantizers(
            weight=DensityTracked(FixedPoint(start.wl, start.fl, "stochastic")),
            act=FixedPoint(start.wl, start.fl, "stochastic")))
        self.model = model
        self.layers = {name: model.get_submodule(name) for name in names}
        self.states = {name: LayerSwitchState(start, cfg.lookback.low, cfg.resolution.low) for name in names}
        for name in names:
            self._apply(name)
        return model

    def attach(self, optimizer: torch.optim.Optimizer, facts: RunFacts) -> None:
        super().attach(optimizer, facts)
        if self.cfg.l2 and any(group["weight_decay"] for group in optimizer.param_groups):
            log.warning("method.l2=%g is AdaPT's L2 term and the optimizer adds weight decay too: pass "
                        "optim.weight_decay=0 to count L2 once", self.cfg.l2)

    def _apply(self, name: str) -> None:
        """Set layer ``name``'s quantizers and precision record to its current format."""
        fmt, q = self.states[name].format, self.layers[name].quant
        q.weight.inner.bits, q.weight.inner.fl = fmt.wl, fmt.fl
        q.act.bits, q.act.fl = fmt.wl, fmt.fl
        self._record[name] = LayerPrecision.uniform(Bits(fmt.wl, fmt.wl, 32, 32), FixedPoint.fmt)

    def loss(self, loss: torch.Tensor, info: StepInfo) -> torch.Tensor:
        cfg = self.cfg
        weights = [layer.weight for layer in self.layers.values()]
        total = loss
        if cfg.l1:
            total = total + cfg.l1 * sum(w.abs().sum() for w in weights)
        if cfg.l2:
            total = total + cfg.l2 / 2 * sum(w.square().sum() for w in weights)
        if self.model.training:
            # one read of the densities serves the penalty (a constant: no gradient) and the price
            densities = torch.stack([layer.quant.weight.density for layer in self.layers.values()]).tolist()
            if cfg.penalty:
                wl = torch.tensor([s.format.wl for s in self.states.values()], dtype=torch.float32)
                total = total + (wl / 32 * torch.tensor(densities)).mean()
            self.price_step({name: LayerState(s.format.wl, d, s.lookback, s.resolution)
                             for (name, s), d in zip(self.states.items(), densities)})
            self.step_losses.append(total.detach())
        return total

    @torch.no_grad()
    def after_backward(self, info: StepInfo) -> None:
        """Algorithm 2 (PrecisionSwitch) on this step's gradients, before the optimizer applies them."""
        cfg = self.cfg
        step_loss = math.nan
        if self.step_losses:  # the mean over every process's micro-batches: each one adapts the same strategy
            step_loss = float(distributed.sum_(torch.stack(self.step_losses).mean())) / distributed.world_size()
        self.step_losses = []
        self._adapt_strategy(step_loss)
        for name, layer in self.layers.items():
            grad = layer.weight.grad
            if grad is None:
                continue
            norm = grad.norm()
            unit = grad / norm if norm > 0 else grad
            if cfg.normalize_grads:
                grad.copy_(unit)
            state = self.states[name]
            state.window.add(unit)
            diversity = gradient_diversity_for(state.window.sum_sq, state.window.total_norm_sq(), state.window.count,
                                               cfg.pushup)
            state.lookback = adapt_lookback(state.lookback, diversity, cfg.lookback.low, cfg.lookback.high,
                                            cfg.lookback.momentum)
            state.resolution = adapt_resolution(state.resolution, state.lookback, cfg.lookback.low, cfg.lookback.high,
                                                cfg.resolution.low, cfg.resolution.high)
            if state.window.count >= state.lookback:
                self._switch(name, diversity, info)

    def _adapt_strategy(self, loss: float) -> None:
        """Eq. 5 against the mean loss of the last ``lb_avg`` steps (the mean lookback over layers)."""
        average_lookback = int(sum(s.lookback for s in self.states.values()) / len(self.states))
        if len(self.losses) >= average_lookback and not math.isnan(loss):
            recent = list(self.losses)[-average_lookback:]
            self.strategy = adapt_strategy(self.strategy, sum(recent) / len(recent), loss)
        self.losses.append(loss)

    def _switch(self, name: str, diversity: float, info: StepInfo) -> None:
        """PushDown then PushUp for layer ``name`` (Algorithm 2, lines 6-10); its window starts over."""
        cfg, state = self.cfg, self.states[name]
        start = time.perf_counter()
        # rank 0's search: its stochastic rounding draws from each process's own stream
        minimal = distributed.broadcast(pushdown(self.layers[name].weight, state.format, state.resolution,
                                                 cfg.kl_epsilon, search=cfg.pushdown_search))
        s = increase(diversity, minimal.fl, self.strategy, cfg.pushup)
        state.format = pushup(minimal, s, cfg.buffer_bits, cfg.pushup)
        state.window.clear()
        self._apply(name)
        self.switch_seconds += time.perf_counter() - start
        self.switches += 1
        self.switch_rows.append({"epoch": info.epoch + 1, "step": info.step + 1, "layer": name, "event": "switch",
                                 "format": FixedPoint.fmt, "wl": state.format.wl, "fl": state.format.fl,
                                 "wl_min": minimal.wl, "fl_min": minimal.fl, "increase": s, "diversity": diversity,
                                 "strategy": self.strategy, "lookback": state.lookback,
                                 "resolution": state.resolution,
                                 "density": float(self.layers[name].quant.weight.density)})

    def precision(self) -> PrecisionRecord:
        return self._record

    def layer_columns(self) -> dict[str, dict[str, Any]]:
        return {name: {"wl": s.format.wl, "fl": s.format.fl, "lookback": s.lookback, "resolution": s.resolution}
                for name, s in self.states.items()}

    def drain_switch_rows(self) -> list[dict[str, Any]]:
        rows, self.switch_rows = self.switch_rows, []
        return rows

    def report(self, epochs: int) -> dict[str, Any]:
        report: dict[str, Any] = {
            "formats": {name: [s.format.wl, s.format.fl] for name, s in self.states.items()},
            "switches": self.switches, "switch_seconds": self.switch_seconds, "strategy": self.strategy,
        }
        performance = self.performance_report(epochs)
        return {**report, "performance_model": performance} if performance else report

    def state_dict(self) -> dict[str, Any]:
        return {"layers": {name: s.state_dict() for name, s in self.states.items()}, "strategy": self.strategy,
                "losses": list(self.losses), "switches": self.switches, "switch_seconds": self.switch_seconds,
                "perf": self.performance_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, layer_state in state["layers"].items():
            self.states[name].load_state_dict(layer_state)
            self._apply(name)
        self.strategy = state["strategy"]
        self.losses = deque(state["losses"], maxlen=self.cfg.lookback.high)
        self.switches, self.switch_seconds = state["switches"], state["switch_seconds"]
        self.load_performance_state(state["perf"])
