"""MuPPET: multi-precision policy enforced training (Rajagopal et al., ICML 2020).

As summarised in the AdaPT paper (Sec. 2.2) and METHODS.md, "MuPPET". Every Conv2d/Linear computes
on dynamic fixed point (:func:`qtrain.quant.formats.dynamic_fixed_point`): a word length ``WL``
global to the network, and one power-of-two scale per tensor, recomputed from the tensor each time it
is quantized (as the reference code does, every batch), separately for the weight, the activation
(the layer's input) and, with ``grad: quantized``, the gradient w.r.t. the layer's output on both
backward paths (the backward pass is fixed point too; below, where the reference quantizes it).
Stochastic rounding; float32 master weights; batch norm in float32.

The word length follows ``schedule`` (8 -> 12 -> 14 -> 16 -> float32; 32 means float32, no
quantization). Switching, by inter-epoch gradient diversity: the last mini-batch gradient of each
layer's weight is kept at every epoch's end; after every ``resolution`` (r) epochs, counted from the
start of training as in the reference, ``Δs = mean over layers of Σ_k ||g_k||² / ||Σ_k g_k||²`` over
those r gradients. The largest Δs since the last switch is tracked; where Δs is below it, ``p = max /
Δs`` is compared with ``T(e) = 1 + 1.5 exp(-0.1 e)`` (e the 0-based epoch) and ``p > T(e)`` counts a
violation; the ``patience``-th violation (not necessarily consecutive) switches to the next word
length and resets the maximum and the count. In the float32 stage the learning rate is multiplied by
``float32_lr.gamma`` every ``float32_lr.every`` epochs, counting the epoch that switched (the
reference: 0.1 every 15); before it, the run's schedule applies (the reference holds the rate
constant: use ``sched=constant``).

A Transformer's attention products QK^T and attention x V (:class:`~qtrain.quant.layers.MatMul`, two
activations) run at the same word length: both operands and the gradient on dynamic fixed point, each
with its own scale (the MuPPET paper trains CNNs only). They have no weights, so they take no part in
the gradient diversity or the weight densities of the performance model.

metrics.csv gets each epoch's word length, the window's diversity (NaN between checks), the running
maximum, the ratio p, the threshold T(e), the violation count and whether the epoch switched.
summary.json gets AdaPT's performance model (Sec. 4.1.2) for the run (``performance_model``), as the
AdaPT paper priced MuPPET (Tables 3-4; no PushDown/PushUp overhead).

Departures from the reference code (ICIdsl/muppet):
- Activations are quantized where they enter a Conv2d/Linear (so the input images too, one scale per
  batch); the reference quantizes the outputs of its conv, linear and pooling layers, and each input
  image with its own scale.
- Gradients (``grad: quantized``): the gradient w.r.t. each layer's output is quantized before both
  backward GEMMs; the reference quantizes what comes out of them (gradients w.r.t. input, weight and
  bias, in backward hooks) and the weight gradients again in its optimizer.
- Codes are clamped to the WL-bit range (its stochastic rounding of a value at ``UB + 0.5`` can reach
  ``2^(WL-1)``, one past it); a scale bound whose extreme has the wrong sign (no positive or no negative
  values) is left out, where the reference takes the absolute value of both quotients.
- Diversity runs over the layers' raw float32 weight gradients, as the paper's per-layer formula (the
  reference takes every parameter, biases and batch-norm ones included, after quantization and with
  weight decay added); biases and batch-norm parameters are not quantized, and training does not stop
  when the rate falls below a minimum.
- The performance model prices the measured weight density at every step; the AdaPT reference priced
  MuPPET dense, over the MuPPET paper's epochs per word length.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from qtrain.cost.adapt_model import LayerState, check_baselines
from qtrain.errors import ConfigError
from qtrain.methods.base import RunFacts, StepInfo, check_bits, check_choice, check_int, check_number
from qtrain.methods.diversity import DiversityWindow
from qtrain.methods.priced import PricedByPerformanceModel
from qtrain.precision import LayerPrecision, PrecisionRecord, weight_density
from qtrain.quant.layers import MatMul, OperandQuantizers, swap_layers
from qtrain.quant.quantizers import DensityTracked, DynamicFixedPoint

GRADS = ("quantized", "float32")


def muppet_threshold(epoch: int, base: float = 1.0, scale: float = 1.5, decay: float = 0.1) -> float:
    """``T(e) = base + scale * exp(-decay * e)``, the ratio a diversity drop must exceed to count."""
    return base + scale * math.exp(-decay * epoch)


class DiversityPolicy:
    """MuPPET's switching rule on one diversity value per window: running maximum, violations, patience."""

    def __init__(self, patience: int, base: float, scale: float, decay: float) -> None:
        self.patience, self.base, self.scale, self.decay = patience, base, scale, decay
        self.maximum = 0.0
        self.violations = 0

    def update(self, diversity: float, epoch: int) -> tuple[float, float, bool]:
        """Record the window's ``diversity`` at ``epoch``; returns (ratio p, threshold T(e), switch now)."""
        threshold = muppet_threshold(epoch, self.base, self.scale, self.decay)
        if diversity >= self.maximum:
            self.maximum = diversity
            return 1.0, threshold, False
        ratio = self.maximum / diversity if diversity > 0 else math.inf
        self.violations += ratio > threshold
        if self.violations < self.patience:
            return ratio, threshold, False
        self.maximum, self.violations = 0.0, 0
        return ratio, threshold, True

    def state_dict(self) -> dict[str, Any]:
        return {"maximum": self.maximum, "violations": self.violations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.maximum, self.violations = state["maximum"], state["violations"]


class MuPPET(PricedByPerformanceModel):
    name = "muppet"

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        check_bits(cfg, "schedule", low=2)
        schedule = list(cfg.schedule)
        if not schedule or any(a >= b for a, b in zip(schedule, schedule[1:])):
            raise ConfigError(f"method.schedule={schedule!r} is not allowed: strictly increasing word lengths "
                              "from 2 to 32, at least one (32, float32, can only be the last)")
        check_int(cfg, "resolution", 1)
        check_int(cfg, "patience", 1)
        for key in ("base", "scale", "decay"):
            check_number(cfg.threshold, key, 0, math.inf, prefix="method.threshold.")
        check_choice(cfg, "grad", GRADS)
        check_number(cfg.float32_lr, "gamma", 0, 1, prefix="method.float32_lr.")
        check_int(cfg.float32_lr, "every", 1, prefix="method.float32_lr.")
        check_baselines(cfg.performance_model)
        self.policy = DiversityPolicy(cfg.patience, cfg.threshold.base, cfg.threshold.scale, cfg.threshold.decay)
        self.stage = 0
        self.float32_epochs = 0
        self.model: nn.Module | None = None
        self.layers: dict[str, nn.Module] = {}  # the Conv2d/Linear layers
        self.matmuls: dict[str, nn.Module] = {}
        self.windows: dict[str, DiversityWindow] = {}
        self.last_grads: dict[str, torch.Tensor] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self._record: PrecisionRecord = {}

    @property
    def word_length(self) -> int:
        return self.cfg.schedule[self.stage]

    def _quantizers(self, weighted: bool) -> OperandQuantizers:
        """The current word length's quantizers; a MatMul's second operand (``weighted`` False) is an activation."""
        wl = self.word_length
        if wl == 32:
            return OperandQuantizers()
        grad = DynamicFixedPoint(wl) if self.cfg.grad == "quantized" else None
        weight = DensityTracked(DynamicFixedPoint(wl)) if weighted else DynamicFixedPoint(wl)
        return OperandQuantizers(weight=weight, act=DynamicFixedPoint(wl), grad=grad)

    def prepare(self, model: nn.Module) -> nn.Module:
        names = swap_layers(model, lambda name, layer: OperandQuantizers(), matmuls=True)
        self.model = model
        self.matmuls = {name: model.get_submodule(name) for name in names if isinstance(model.get_submodule(name), MatMul)}
        self.layers = {name: model.get_submodule(name) for name in names if name not in self.matmuls}
        self.windows = {name: DiversityWindow() for name in self.layers}
        self._apply_stage()
        return model

    def attach(self, optimizer: torch.optim.Optimizer, facts: RunFacts) -> None:
        super().attach(optimizer, facts)
        self.optimizer = optimizer

    def _apply_stage(self) -> None:
        device = next(self.model.parameters()).device
        for name, layer in (*self.layers.items(), *self.matmuls.items()):
            layer.quant = self._quantizers(weighted=name in self.layers).to(device)
        self._record = {name: LayerPrecision.uniform(layer.quant.bits(), DynamicFixedPoint.fmt)
                        for name, layer in (*self.layers.items(), *self.matmuls.items()) if self.word_length != 32}

    def loss(self, loss: torch.Tensor, info: StepInfo) -> torch.Tensor:
        if self.model.training:
            wl = self.word_length
            if wl == 32:
                densities = [weight_density(layer) for layer in self.layers.values()]
            else:
                densities = torch.stack([layer.quant.weight.density for layer in self.layers.values()]).tolist()
            self.price_step({name: LayerState(wl, d, quantized=wl != 32) for name, d in zip(self.layers, densities)})
        return loss

    @torch.no_grad()
    def after_backward(self, info: StepInfo) -> None:
        if self.word_length == 32:
            return
        for name, layer in self.layers.items():
            if layer.weight.grad is not None:
                kept = self.last_grads.get(name)
                if kept is None:
                    self.last_grads[name] = layer.weight.grad.detach().clone()
                else:
                    kept.copy_(layer.weight.grad)

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        trained = self.word_length
        diversity = ratio = threshold = math.nan
        switched, maximum = False, self.policy.maximum
        if trained != 32 and self.stage < len(self.cfg.schedule) - 1:
            for name, grad in self.last_grads.items():
                self.windows[name].add(grad)
            if (epoch + 1) % self.cfg.resolution == 0:
                diversity = sum(w.diversity() for w in self.windows.values()) / len(self.windows)
                for window in self.windows.values():
                    window.clear()
                maximum = max(self.policy.maximum, diversity)  # as compared, before a switch resets it
                ratio, threshold, switched = self.policy.update(diversity, epoch)
        metrics.update(word_length=trained, diversity=diversity, diversity_max=maximum,
                       diversity_ratio=ratio, threshold=threshold, violations=self.policy.violations,
                       switched=int(switched))
        if switched:
            self.stage += 1
            self._apply_stage()
        if switched and self.word_length == 32 or self.float32_epochs:  # the float32 stage, from the epoch that switched
            self.float32_epochs += 1
            if self.float32_epochs % self.cfg.float32_lr.every == 0:
                for group in self.optimizer.param_groups:
                    group["lr"] *= self.cfg.float32_lr.gamma

    def precision(self) -> PrecisionRecord:
        return self._record

    def report(self, epochs: int) -> dict[str, Any]:
        performance = self.performance_report(epochs)
        report = {"word_length": self.word_length, "stage": self.stage}
        return {**report, "performance_model": performance} if performance else report

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "float32_epochs": self.float32_epochs, "policy": self.policy.state_dict(),
                "windows": {n: w.state_dict() for n, w in self.windows.items()},
                "perf": self.performance_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage, self.float32_epochs = state["stage"], state["float32_epochs"]
        self.policy.load_state_dict(state["policy"])
        for name, window in state["windows"].items():
            self.windows[name].load_state_dict(window)
        self.load_performance_state(state["perf"])
        self._apply_stage()
