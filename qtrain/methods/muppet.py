"""MuPPET: multi-precision policy enforced training (Rajagopal et al., ICML 2020).

As summarised in the AdaPT paper (Sec. 2.2), and as its reference code runs it. Every Conv2d/Linear computes
on dynamic fixed point (:func:`qtrain.quant.formats.dynamic_fixed_point`): a word length ``WL``
global to the network, and one power-of-two scale per tensor, recomputed from the tensor each time it
is quantized (as the reference code does, every batch), separately for the weight, the activation
(the layer's input) and, with ``grad: quantized``, the gradient w.r.t. the layer's output on both
backward paths (the backward pass is fixed point too; below, where the reference quantizes it).
Stochastic rounding; float32 master weights; batch norm in float32.

The word length follows ``schedule`` (8 -> 12 -> 14 -> 16 -> float32; 32 means float32, no
quantization). Switching, by inter-epoch gradient diversity: one gradient per parameter is kept at
every epoch's end, that of the epoch's last optimizer step; after every ``resolution`` (r >= 2)
epochs, counted from the start of training as in the reference, ``Δs = mean over parameters of
Σ_k ||g_k||² / ||Σ_k g_k||²`` over those r gradients (over one gradient it is always 1, so r = 1 is
refused). With ``diversity_input: reference`` (ICIdsl/muppet, policy.py and quant_sgd.py: what
``p.grad`` holds after its optimizer step) the kept gradient is every parameter's (biases and batch
norm included), rounded to dynamic fixed point at the current word length (stochastic rounding, one
scale per tensor), plus the parameter group's weight decay times the weight before the step;
``weight_grads`` keeps the Conv2d/Linear weight gradients as backward computed them (the paper's
per-layer formula). The largest Δs since the last switch is tracked; where Δs is below it, ``p = max /
Δs`` is compared with ``T(e) = 1 + 1.5 exp(-0.1 e)`` (e the 0-based epoch) and ``p > T(e)`` counts a
violation; the ``patience``-th violation (not necessarily consecutive) switches to the next word
length and resets the maximum and the count. A stage thus lasts at least ``(patience + 1) r`` epochs.
A parameter whose r kept gradients are all zero has no diversity (0 / 0: NaN, as the reference's tensor
division gives), nor then has the mean: that check counts nothing and leaves the maximum (the reference's
comparisons with NaN are false); a window whose gradients cancel to a zero sum has +inf, as there.
On several processes each rounds its own copy of the (averaged) gradients; all take rank 0's diversity.

In the float32 stage the learning rate is multiplied by ``float32_lr.gamma`` at every
``float32_lr.every``-th epoch, counting the epoch that switched as the first (the reference: 0.1
every 15); before it, the run's schedule applies (the reference holds the rate constant: use
``sched=constant``). The reference stops at such a point once the rate is at its minimum (policy.py
``check_stopping_condition``: ``Min_LR`` is the start rate x0.01 in its configs), after training that
epoch: ``float32_lr.decays: 2`` does this by count, so the run ends after ``(decays + 1) every`` float32
epochs (45 with the switching epoch: the MuPPET paper's 45 float32 epochs for AlexNet and ResNet-20
on CIFAR-10), ``stopped_early`` in
summary.json; ``train.epochs`` stays the cap. ``decays: null`` is the fixed-epoch reading: decays
until ``train.epochs``. The count departs from the reference's ``lr > Min_LR`` test in one case: its
ResNet configs (rate 0.1, minimum 0.001) compare 0.1·0.1·0.1 = 0.0010000000000000002 > 0.001 in
float64 and decay a third time, stopping only after 60 float32 epochs, not the 45 its paper reports.

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
- Biases and batch-norm parameters train in float32 (the reference quantizes every parameter in its
  optimizer); their gradients are rounded for the diversity only. The weight-decay term of the
  diversity input uses the float32 weight (the reference's optimizer decays its quantized copy).
- The diversity sums the r kept gradients. In the reference the first one of each window is stored
  as a view of the gradient buffer (policy.py ``update_calculation``), which the next epoch's
  ``model.zero_grad()`` clears in place and its first backward refills, until the optimizer step
  assigns a new buffer: with the PyTorch of its time its ``Σ g`` held that first batch's raw gradient
  in place of the window's first kept one (its ``Σ ||g||²`` is computed on time). That reads as a
  bug, not as the method.
- The performance model prices the measured weight density at every step; the AdaPT reference priced
  MuPPET dense, over the MuPPET paper's epochs per word length. As there, the float32 stage is charged
  at WL = 32 on top of the float32 master in the memory (MEM ``1 + mean(WL) / 32`` for a dense run).
- The reference framework (ICIdsl/muppet with adityarajagopal/pytorch_training) trains on 80 % of the
  training set (its ``Train_Val_Split`` of 0.8; read from a framework version that may postdate the
  MuPPET paper); qtrain trains on all of it. ``data.fold=0 data.folds=5`` trains on 80 %.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from qtrain import distributed
from qtrain.config.schema import is_integer
from qtrain.cost.adapt_model import LayerState, check_baselines
from qtrain.errors import ConfigError
from qtrain.methods.base import RunFacts, StepInfo, check_bits, check_choice, check_int, check_number
from qtrain.methods.diversity import DiversityWindow
from qtrain.methods.priced import PricedByPerformanceModel
from qtrain.precision import LayerPrecision, PrecisionRecord, weight_density
from qtrain.quant.formats import dynamic_fixed_point
from qtrain.quant.layers import MatMul, OperandQuantizers, swap_layers
from qtrain.quant.quantizers import DensityTracked, DynamicFixedPoint

GRADS = ("quantized", "float32")
DIVERSITY_INPUTS = ("reference", "weight_grads")


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
    name = "muppet"

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        check_bits(cfg, "schedule", low=2)
        schedule = list(cfg.schedule)
        if not schedule or any(a >= b for a, b in zip(schedule, schedule[1:])):
            raise ConfigError(f"method.schedule={schedule!r} is not allowed: strictly increasing word lengths "
                              "from 2 to 32, at least one (32, float32, can only be the last)")
        resolution = cfg.resolution
        if not is_integer(resolution) or resolution < 2:
            raise ConfigError(f"method.resolution={resolution!r} is not allowed: it must be an integer >= 2 (a window "
                              "keeps one gradient per epoch, and the diversity of one gradient is always 1)")
        check_int(cfg, "patience", 1)
        for key in ("base", "scale", "decay"):
            check_number(cfg.threshold, key, 0, math.inf, prefix="method.threshold.")
        check_choice(cfg, "grad", GRADS)
        check_number(cfg.float32_lr, "gamma", 0, 1, prefix="method.float32_lr.")
        check_int(cfg.float32_lr, "every", 1, prefix="method.float32_lr.")
        if cfg.float32_lr.decays is not None:
            check_int(cfg.float32_lr, "decays", 0, prefix="method.float32_lr.")
        check_choice(cfg, "diversity_input", DIVERSITY_INPUTS)
        check_baselines(cfg.performance_model)
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
        grad = DynamicFixedPoint(wl) if self.cfg.grad == "quantized" else None
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
        if self.cfg.diversity_input == "reference":
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
        reference = self.cfg.diversity_input == "reference"
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
        if self.cfg.diversity_input == "weight_grads":
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
