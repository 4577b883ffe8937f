"""AdaPT: adaptive precision training (Kummer et al., AdaPT paper Sec. 3, Algorithms 1-4, Sec. 4.1): each Conv2d/Linear
on fixed point <WL, FL> of its own, switched by PushDown and PushUp (:mod:`qtrain.methods.adapt_switching`). Defaults
follow the reference code (lorenz0890/AdaPT) where it and the paper differ; each departure: docs/methods/adapt.md."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any

import torch
from torch import nn

from qtrain import distributed
from qtrain.config import methods as schemas
from qtrain.cost.adapt_model import LayerState
from qtrain.methods.adapt_recipe import initialize, l1_norm
from qtrain.methods.adapt_switching import (
    Format,
    adapt_lookback,
    adapt_resolution,
    adapt_strategy,
    gradient_diversity_for,
    increase,
    pushdown,
    pushup,
)
from qtrain.methods.base import RunFacts, StepInfo
from qtrain.methods.diversity import DiversityWindow
from qtrain.methods.priced import PricedByPerformanceModel
from qtrain.precision import Bits, LayerPrecision, PrecisionRecord
from qtrain.quant.formats import fixed_point
from qtrain.quant.layers import OperandQuantizers, swap_layers
from qtrain.quant.quantizers import DensityTracked, FixedPoint

log = logging.getLogger(__name__)


class RoundedCopy(DensityTracked):
    """A weight quantizer that also keeps its last output, the rounded copy the forward used (L1 acts on it)."""

    last: torch.Tensor | None = None

    def _track(self, out: torch.Tensor) -> torch.Tensor:
        self.last = out.detach()
        return super()._track(out)


class LayerSwitchState:
    """One layer's switching state: format, lookback, resolution and its lookback window.

    ``norm_sum`` is eq. 3's numerator ``Σ||g_k||`` of the window's gradients.
    """

    def __init__(self, fmt: Format, lookback: int, resolution: int) -> None:
        self.format, self.lookback, self.resolution = fmt, lookback, resolution
        self.window = DiversityWindow()
        self.norm_sum = 0.0

    def add(self, grad: torch.Tensor, norm: float) -> None:
        self.window.add(grad)
        self.norm_sum += norm

    def clear(self) -> None:
        self.window.clear()
        self.norm_sum = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"wl": self.format.wl, "fl": self.format.fl, "lookback": self.lookback,
                "resolution": self.resolution, "window": self.window.state_dict(), "norm_sum": self.norm_sum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.format = Format(state["wl"], state["fl"])
        self.lookback, self.resolution = state["lookback"], state["resolution"]
        self.window.load_state_dict(state["window"])
        self.norm_sum = state["norm_sum"]


class AdaPT(PricedByPerformanceModel):
    cfg: schemas.AdaPT

    def __init__(self, cfg: schemas.AdaPT) -> None:
        super().__init__(cfg)
        self.model: nn.Module | None = None
        self.layers: dict[str, nn.Module] = {}
        self.params: list[tuple[nn.Parameter, str | None]] = []
        self.states: dict[str, LayerSwitchState] = {}
        self.strategy: str = cfg.strategy.value  # adapted as it trains (adapt_strategy)
        self.losses: deque[float] = deque(maxlen=cfg.lookback.high)
        self.step_losses: list[torch.Tensor] = []
        self.switches, self.switch_seconds = 0, 0.0
        self.switch_rows: list[dict[str, Any]] = []
        self._record: PrecisionRecord = {}

    def prepare(self, model: nn.Module) -> nn.Module:
        cfg = self.cfg
        initialize(model, cfg.init.value, cfg.init_scale)
        start = Format(cfg.initial.wl, cfg.initial.fl)
        names = swap_layers(model, lambda name, layer: OperandQuantizers(
            weight=RoundedCopy(FixedPoint(start.wl, start.fl, "stochastic")),
            act=FixedPoint(start.wl, start.fl, "stochastic")))
        self.model = model
        self.layers = {name: model.get_submodule(name) for name in names}
        self.params = self._covered_params(model)
        self.states = {name: LayerSwitchState(start, cfg.lookback.low, cfg.resolution.low) for name in names}
        for name in names:
            self._apply(name)
        return model

    def _covered_params(self, model: nn.Module) -> list[tuple[nn.Parameter, str | None]]:
        """The parameters that gradient rounding, normalization, L1, L2 and the penalty cover, each with the
        quantized layer whose format it takes (None: none, it stays float32).

        ``weights``: the quantized layers' weights. ``all`` (the reference code's): every parameter, a
        quantized layer's at that layer's format and any other (batch norm) at the format of the
        quantized layer met last before it in parameter order (the reference copies each 1-D
        parameter's format from the parameter before it).
        """
        if self.cfg.params is schemas.Params.WEIGHTS:
            return [(layer.weight, name) for name, layer in self.layers.items()]
        # by identity, not by name: a weight tied to another module's (a Transformer's vocabulary projection and
        # its embedding) is listed once, under the name that comes first
        layer_of = {id(p): name for name, layer in self.layers.items() for p in layer.parameters(recurse=False)}
        covered, owner = [], None
        for param in model.parameters():
            owner = layer_of.get(id(param), owner)
            covered.append((param, owner))
        return covered

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

    def _seen(self, param: nn.Parameter, owner: str | None) -> torch.Tensor:
        """``param`` as this forward used it: a quantized layer's weight as its rounded copy (the gradient
        passes straight through to the float32 weight), any other parameter as it is (float32)."""
        layer = self.layers.get(owner) if owner is not None else None
        if layer is not None and param is layer.weight and layer.quant.weight.last is not None:
            return layer.quant.weight.last + (param - param.detach())
        return param

    def loss(self, loss: torch.Tensor, info: StepInfo) -> torch.Tensor:
        cfg = self.cfg
        total = loss
        if cfg.l1:
            total = total + cfg.l1 * l1_norm(self._seen(p, owner) for p, owner in self.params)
        if cfg.l2:
            total = total + cfg.l2 / 2 * sum(p.square().sum() for p, _ in self.params)
        if self.model.training:
            # one read of the densities serves the penalty (a constant: no gradient) and the price
            densities = torch.stack([layer.quant.weight.density for layer in self.layers.values()]).tolist()
            if cfg.penalty:
                total = total + self._penalty(dict(zip(self.layers, densities)))
            self.price_step({name: LayerState(s.format.wl, d, s.lookback, s.resolution)
                             for (name, s), d in zip(self.states.items(), densities)})
            self.step_losses.append(total.detach())
        return total

    @torch.no_grad()
    def _penalty(self, densities: dict[str, float]) -> float:
        """Sec. 3.4's ``P``: the mean over the covered parameters that have a format of ``WL / 32 * density``,
        a weight's density that of its rounded copy."""
        terms = []
        for param, owner in self.params:
            if owner is None:
                continue
            layer = self.layers[owner]
            density = densities[owner] if param is layer.weight else float(param.count_nonzero()) / param.numel()
            terms.append(self.states[owner].format.wl / 32 * density)
        return sum(terms) / len(terms)

    @torch.no_grad()
    def after_backward(self, info: StepInfo) -> None:
        """Gradient rounding and normalization, then Algorithm 2 (PrecisionSwitch) on this step's gradients,
        before the optimizer applies them."""
        cfg = self.cfg
        step_loss = math.nan
        if self.step_losses:  # the mean over every process's micro-batches: each one adapts the same strategy
            step_loss = float(distributed.sum_(torch.stack(self.step_losses).mean())) / distributed.world_size()
        self.step_losses = []
        self._adapt_strategy(step_loss)
        keys: list[torch.Tensor | None] = [None] * len(self.params)
        if cfg.grad is schemas.Precision.QUANTIZED:  # rank 0's draws: every process rounds its (all-reduced) gradients alike
            keys = list(distributed.broadcast(torch.randint(-(1 << 31), 1 << 31, (len(keys),), dtype=torch.int32)))
        norms: dict[str, float] = {}
        for (param, owner), key in zip(self.params, keys):
            grad = param.grad
            if grad is None:
                continue
            if key is not None and owner is not None:  # at the formats the step started with
                fmt = self.states[owner].format
                grad.copy_(fixed_point(grad, fmt.wl, fmt.fl, "stochastic", key=key))
            norm = grad.norm()
            if owner is not None and param is self.layers[owner].weight:
                norms[owner] = float(norm)
            if cfg.normalize_grads and norm > 0:
                grad.div_(norm)
        for name, layer in self.layers.items():
            grad = layer.weight.grad
            if grad is None:
                continue
            norm = norms[name]
            state = self.states[name]
            state.add(grad / norm if norm > 0 and not cfg.normalize_grads else grad, float(norm > 0))
            diversity = gradient_diversity_for(state.norm_sum, state.window.total_norm_sq(), state.window.count,
                                               cfg.pushup.value)
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
                                                 cfg.kl_epsilon, search=cfg.pushdown_search.value))
        s = increase(diversity, minimal.fl, self.strategy, cfg.pushup.value)
        state.format = pushup(minimal, s, cfg.buffer_bits, cfg.pushup.value)
        state.clear()
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

    def drain_event_rows(self) -> list[dict[str, Any]]:
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
