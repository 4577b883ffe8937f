"""MuPPET: multi-precision policy enforced training (Rajagopal et al., ICML 2020; AdaPT paper Sec. 2.2): dynamic fixed
point at a word length global to the network, switched by the inter-epoch gradient diversity, priced by AdaPT's
performance model. The switching rule, its records and the departures from the reference: docs/methods/muppet.md."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from qtrain import distributed
from qtrain.config import methods as schemas
from qtrain.cost.adapt_model import LayerState
from qtrain.methods.base import RunFacts, StepInfo
from qtrain.methods.diversity import DiversityWindow
from qtrain.methods.priced import PricedByPerformanceModel
from qtrain.precision import LayerPrecision, PrecisionRecord, weight_density
from qtrain.quant.formats import dynamic_fixed_point
from qtrain.quant.layers import MatMul, OperandQuantizers, swap_layers
from qtrain.quant.quantizers import DensityTracked, DynamicFixedPoint


def muppet_threshold(epoch: int, base: float = 1.0, scale: float = 1.5, decay: float = 0.1) -> float:
    """``T(e) = base + scale * exp(-decay * e)``, the ratio a diversity drop must exceed to count."""
    return base + scale * math.exp(-decay * epoch)


def window_diversity(window: DiversityWindow) -> float:
    """The window's ``Σ ||g||² / ||Σ g||²``; NaN where all its gradients are zero (0 / 0, as the reference's
    tensor division gives), where :class:`~qtrain.methods.diversity.DiversityWindow` reads a zero sum as +inf."""
    return math.nan if window.sum_sq == 0 else window.diversity()


class DiversityPolicy:
    """MuPPET's switching rule on one diversity value per window: running maximum, violations, patience."""

    def __init__(self, patience: int, base: float, scale: float, decay: float) -> None:
        self.patience, self.base, self.scale, self.decay = patience, base, scale, decay
        self.maximum = 0.0
        self.violations = 0

    def update(self, diversity: float, epoch: int) -> tuple[float, float, bool]:
        """Record the window's ``diversity`` at ``epoch``; returns (ratio p, threshold T(e), switch now)."""
        threshold = muppet_threshold(epoch, self.base, self.scale, self.decay)
        if math.isnan(diversity):  # no diversity (a window of zero gradients): the check counts nothing
            return math.nan, threshold, False
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
    cfg: schemas.MuPPET

    def __init__(self, cfg: schemas.MuPPET) -> None:
        super().__init__(cfg)
        self.policy = DiversityPolicy(cfg.patience, cfg.threshold.base, cfg.threshold.scale, cfg.threshold.decay)
        self.stage = 0
        self.float32_epochs = 0
        self.model: nn.Module | None = None
        self.layers: dict[str, nn.Module] = {}  # the Conv2d/Linear layers
        self.matmuls: dict[str, nn.Module] = {}
        self.windows: dict[str, DiversityWindow] = {}  # one per parameter whose gradient the diversity takes
        self.last_grads: dict[str, torch.Tensor] = {}  # of the latest optimizer step
        self.last_weights: dict[str, torch.Tensor] = {}  # before it, where the reference input adds weight decay
        self.weight_decay: dict[str, float] = {}
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
        grad = DynamicFixedPoint(wl) if self.cfg.grad is schemas.Precision.QUANTIZED else None
        weight = DensityTracked(DynamicFixedPoint(wl)) if weighted else DynamicFixedPoint(wl)
        return OperandQuantizers(weight=weight, act=DynamicFixedPoint(wl), grad=grad)

    def prepare(self, model: nn.Module) -> nn.Module:
        names = swap_layers(model, lambda name, layer: OperandQuantizers(), matmuls=True)
        self.model = model
        self.matmuls = {name: model.get_submodule(name) for name in names if isinstance(model.get_submodule(name), MatMul)}
        self.layers = {name: model.get_submodule(name) for name in names if name not in self.matmuls}
        self.windows = {name: DiversityWindow() for name in self._diversity_params()}
        self._apply_stage()
        return model

    def _diversity_params(self) -> dict[str, nn.Parameter]:
        """The parameters whose gradients the diversity takes, by name."""
        if self.cfg.diversity_input is schemas.DiversityInput.REFERENCE:
            return dict(self.model.named_parameters())
        return {name: layer.weight for name, layer in self.layers.items()}

    def attach(self, optimizer: torch.optim.Optimizer, facts: RunFacts) -> None:
        super().attach(optimizer, facts)
        self.optimizer = optimizer
        decay = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
        self.weight_decay = {name: decay.get(id(p), 0.0) for name, p in self._diversity_params().items()}

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
            self.price_step({name: LayerState(wl, d) for name, d in zip(self.layers, densities)})
        return loss

    @torch.no_grad()
    def after_backward(self, info: StepInfo) -> None:
        if self.word_length == 32:
            return
        reference = self.cfg.diversity_input is schemas.DiversityInput.REFERENCE
        for name, param in self._diversity_params().items():
            if param.grad is None:
                continue
            _keep(self.last_grads, name, param.grad)
            if reference and self.weight_decay[name]:
                _keep(self.last_weights, name, param)

    @torch.no_grad()
    def _diversity_input(self, name: str) -> torch.Tensor:
        """The gradient of ``name`` that the diversity takes from the epoch's last step."""
        grad = self.last_grads[name]
        if self.cfg.diversity_input is schemas.DiversityInput.WEIGHT_GRADS:
            return grad
        rounded = dynamic_fixed_point(grad, self.word_length, "stochastic")[0]
        return rounded + self.weight_decay[name] * self.last_weights[name] if name in self.last_weights else rounded

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        trained = self.word_length
        diversity = ratio = threshold = math.nan
        switched, maximum = False, self.policy.maximum
        if trained != 32 and self.stage < len(self.cfg.schedule) - 1:
            for name in self.last_grads:
                self.windows[name].add(self._diversity_input(name))
            if (epoch + 1) % self.cfg.resolution == 0:
                filled = [w for w in self.windows.values() if w.count]
                # the reference input is rounded stochastically on each process: every process takes rank 0's
                diversity = distributed.broadcast(sum(map(window_diversity, filled)) / len(filled))
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
            if self.float32_epochs % self.cfg.float32_lr.every == 0 and self.stopped() is None:
                for group in self.optimizer.param_groups:
                    group["lr"] *= self.cfg.float32_lr.gamma

    def stopped(self) -> str | None:
        decays, every = self.cfg.float32_lr.decays, self.cfg.float32_lr.every
        if decays is None or self.float32_epochs < (decays + 1) * every:
            return None
        return (f"muppet: the float32 stage's learning rate at its minimum after {decays} decays "
                f"(x{self.cfg.float32_lr.gamma:g} every {every} epochs)")

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


def _keep(kept: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> None:
    """Copy ``tensor`` into ``kept[name]``, allocated on first use."""
    if name in kept:
        kept[name].copy_(tensor)
    else:
        kept[name] = tensor.detach().clone()
