"""AdaPT: adaptive precision training (Kummer et al., AdaPT paper Sec. 3, Algorithms 1-4, Sec. 4.1).

Every Conv2d/Linear computes on fixed point <WL, FL> of its own (Sec. 3.2), weights and activations
(the layer's input) at the same format, stochastic rounding, from float32 master weights. Every
layer starts at <8, 4> (Sec. 4.1.1), its weights drawn by truncated-normal fan-in variance scaling
(Sec. 3.1: ``σ = sqrt(s / n)``, cut at ``±sqrt(3 s / n)``, ``init_scale`` s).

Gradients (``grad: quantized``, Algorithm 1 and Sec. 3.4, the reference's ``QUANT_GRADS = True``): once
per optimizer step, after accumulation, each covered parameter's gradient is rounded stochastically
at its layer's <WL, FL> (clamped to its range), then scaled to unit L2 norm (``normalize_grads``,
Sec. 3.3); that is what the optimizer applies and what the lookback window collects. As in the
reference code (lorenz0890/AdaPT, optimizers/msgd_fp.py) only the parameter gradients are rounded,
the weight-gradient GEMM's output: the error path (the gradient w.r.t. each layer's input) stays
float32. The precision record therefore charges the forward GEMM at WL x WL and the error and
weight-gradient GEMMs at float32 error x WL: their operands are the float32 output gradient and the
WL-bit weight or activation, and rounding the weight-gradient GEMM's result afterwards changes none
of its operands (``grad: float32`` is charged the same).

Precision switching (Algorithm 2), once per optimizer step, before the update: the strategy adapts
to the loss (eq. 5); each layer's normalized weight gradient joins its lookback window, and the
lookback and resolution adapt; a layer whose window holds ``lookback`` gradients switches:
:func:`~qtrain.methods.adapt_switching.pushdown` finds the coarsest format with no information loss
(Algorithm 3), :func:`~qtrain.methods.adapt_switching.pushup` raises it by the window's gradient
diversity (eqs. 3-4) and frames it with ``buffer_bits``; the window then starts over. Loss (Sec. 3.4):
``L + α ||W||_1 + β/2 ||W||²_2 + P``, with the L1 term on the rounded copies the forward used (its
gradient ``α sign(Ŵ)``, zero where a weight rounded to 0) and ``P`` the mean over the covered
parameters of ``WL / 32 * density`` (a constant per step: it moves the loss the strategy reads, not
the gradient). Reduce-on-plateau and gradient accumulation come from the run (``sched=plateau``,
``train.accum_steps``); the ``adapt_*`` experiments set the reference configs'.

precision.csv adds each layer's ``wl``, ``fl``, lookback, resolution and density to its epoch rows
and a ``switch`` row at every switch (with the PushDown minimum, the diversity and the strategy).
summary.json (``adapt``) holds the final formats, the number of switches and the seconds they took,
and the performance model of Sec. 4.1.2 (:mod:`qtrain.cost.adapt_model`).

Where the default follows the reference code rather than the paper (the paper reading stays an option):
- PushDown (``pushdown_search: reference``) is the reference's walk: on the first output filter of
  the float32 weights only, FL searched from 4 up to the current FL (asking at the walk's lower bound),
  WL from that FL up to the current WL, a format lossy where torch's ``KLDivLoss`` of the two
  histograms (frequencies read as log-probabilities, not a divergence) is > 0, and the last lossy
  bound returned, so a switch lowers FL and WL by at most a bit before PushUp and practically never
  lowers precision. ``range`` (Sec. 3.3 and eq. 6: the smallest format of all whose discrete KL
  divergence over the whole tensor is <= ``kl_epsilon`` bits, so a lossy format can rise at once) and
  ``current`` (the same at or below the current format, as Algorithm 3) are options; ``kl_epsilon``
  tolerates 1e-3 bits by default because a histogram of stochastically rounded weights almost never
  reaches the paper's KL = 0, and quantized values beyond the float range count in the end bins there
  (clipping is a loss), where the reference drops them.
- PushUp (``pushup: reference``) is the reference's closed form of eq. 4 with ``L = ln Δs - 1``; its
  ``s1 = ceil(1 / L²)`` has no bound, so near ``ln Δs = 1`` a ``mean`` or ``max`` strategy sends a
  layer to <32, 32 - buff>, as the reference's logged runs show. ``paper`` reads eq. 4 as printed
  (:func:`~qtrain.methods.adapt_switching.increase`, ``s1`` capped at 32). The diversity is eq. 3
  unsquared, ``Σ||g_k|| / ||Σ g_k||`` in the paper's reading and ``k / ||Σ g_k||`` in the reference's;
  on the window's unit gradients they differ only where a gradient is zero (the reference counts it).
- ``params: all``: rounding, normalization, L1, L2 and the penalty cover every parameter (biases and
  batch norm included) as in the reference; ``weights`` limits them to the Conv2d/Linear weights. A
  parameter outside the quantized layers (batch norm) takes the format of the last quantized layer
  before it in parameter order, as the reference's parameter list does; one before the first
  quantized layer keeps a float32 gradient and is left out of the penalty.
- L2 is the optimizer's weight decay (``optim.weight_decay``), added to the normalized gradient on the
  float32 master weights, as the reference's optimizer does; ``l2`` (default 0) is the paper's
  ``β/2 ||W||²`` in the loss, which normalization would rescale with the gradient.
- The ``adapt_*`` experiments take the lookback of each reference config (momentum 0.33 for AlexNet on
  CIFAR-10, 0.9 for AlexNet and ResNet on CIFAR-100, 1.0 for ResNet on CIFAR-10; an upper bound of 150
  for AlexNet on CIFAR-100); Sec. 4.1.1 gives 0.33 and 25..100 for every run (the method's default).

Where qtrain departs from both, and why:
- Activations are quantized where they enter a Conv2d/Linear; the reference also quantizes layer
  outputs, batch-norm and pooling tensors. Biases and batch-norm parameters compute in float32 here
  (the reference rounds them at their layer's format after every update), so their L1 term acts on
  their float32 values; their gradients are rounded as the reference's. Biases keep the model's
  initialization (the reference draws them from U(-1/sqrt(in_channels), ...) in AlexNet and
  U(-0.5, 0.5), batch norm's too, in ResNet): a model-specific rule of its code, not of the method.
- Weights are rounded at every forward (a fresh stochastic draw per micro-batch and at evaluation);
  the reference rounds them once per optimizer step, after the update, and every micro-batch of the
  step and the evaluation use that copy.
- The strategy (eq. 5) compares the mean loss of the step's micro-batches with the mean of the last
  ``lb_avg`` steps' losses. The reference compares the last micro-batch's loss (divided by the
  accumulation steps) with the sum of up to ``lb_avg + 1`` earlier losses divided by ``lb_avg`` (its
  history is trimmed after the comparison), an off-by-one that favours ``min`` a little.
- A Transformer's attention products QK^T and attention x V (two activations, no weight) stay
  float32 and are charged so: a layer's format follows from its weights (Sec. 3.2), and these have
  none (the paper trains CNNs only).
- The penalty ``P`` has no gradient (word length and density are counts): it shifts the loss the
  strategy compares, as the reference's, and does not by itself steer the weights.
- Each layer's activations take the layer's own format. The reference's AlexNet (models/alexnet_fp.py,
  ``QAlexNet_FP.forward``) looks the format up by the layer's number in its per-parameter list (a bias
  and a weight per layer), so layer k >= 1 runs its activations at layer ⌊k/2⌋'s format: a bug of its
  code, not the method.
- Reduce-on-plateau (``sched=plateau``) reads the test loss at each epoch's end; the reference's reads
  its validation loss, that of the held-out cross-validation fold.
- SU2 (Table 3's iso-accuracy speedup, :mod:`qtrain.report.paper`) divides SU1 by the share of the run's
  epochs until its test accuracy, read per epoch, first reaches the final test accuracy of qtrain's own
  float32 run of the same setup. The reference (utils/analytics.py) tests a fixed ``TARGET_ACCURACY``
  from its config against the held-out fold's accuracy logged per validation batch.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Iterable
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
from qtrain.quant.formats import fixed_point
from qtrain.quant.layers import OperandQuantizers, swap_layers
from qtrain.quant.quantizers import DensityTracked, FixedPoint

INITS = ("tnvs", "model")
GRADS = ("quantized", "float32")
PARAMS = ("all", "weights")
log = logging.getLogger(__name__)


def tnvs_init_(weight: torch.Tensor, scale: float) -> None:
    """Sec. 3.1: truncated normal, ``σ = sqrt(scale / fan_in)``, cut at ``±sqrt(3 scale / fan_in)``.

    Drawn from the CPU generator and copied onto ``weight``'s device, so a run starts from the same weights (and
    leaves the generator in the same state for what follows) on every device.
    """
    fan_in = weight[0].numel()
    bound = math.sqrt(3 * scale / fan_in)
    drawn = nn.init.trunc_normal_(torch.empty(weight.shape, dtype=weight.dtype), 0.0, math.sqrt(scale / fan_in), -bound, bound)
    weight.copy_(drawn)


def initialize(model: nn.Module, init: str, scale: float) -> None:
    """``tnvs``: every Conv2d/Linear weight by :func:`tnvs_init_` (biases and batch norm keep the model's);
    ``model``: the model's own initialization."""
    if init == "tnvs":
        for layer in model.modules():
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                tnvs_init_(layer.weight.data, scale)


def l1_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``Σ |t|`` over every element of ``tensors``: the sparsifying term ``||W||_1`` (Sec. 3.4); its
    gradient is ``sign(t)``."""
    return sum(t.abs().sum() for t in tensors)


def check_init_and_l1(cfg: DictConfig) -> None:
    """The options AdaPT shares with its float32 baselines: ``init``, ``init_scale``, ``l1``."""
    check_choice(cfg, "init", INITS)
    check_positive(cfg, "init_scale")
    check_number(cfg, "l1", 0, math.inf)


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
    name = "adapt"

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        check_int(cfg.initial, "wl", 2, 32, prefix="method.initial.")
        check_int(cfg.initial, "fl", 0, cfg.initial.wl - 1, prefix="method.initial.")
        check_init_and_l1(cfg)
        check_int(cfg, "buffer_bits", 1, 31)
        for group in ("lookback", "resolution"):
            check_int(cfg[group], "low", 1 if group == "lookback" else 2, prefix=f"method.{group}.")
            check_int(cfg[group], "high", cfg[group].low, prefix=f"method.{group}.")
        check_number(cfg.lookback, "momentum", 0, 1, prefix="method.lookback.")
        check_number(cfg, "kl_epsilon", 0, math.inf)
        check_choice(cfg, "pushup", PUSHUP_FORMULAS)
        check_choice(cfg, "pushdown_search", PUSHDOWN_SEARCHES)
        check_choice(cfg, "strategy", STRATEGIES)
        check_choice(cfg, "grad", GRADS)
        check_choice(cfg, "params", PARAMS)
        check_number(cfg, "l2", 0, math.inf)
        for key in ("normalize_grads", "penalty"):
            if not isinstance(cfg[key], bool):
                raise ConfigError(f"method.{key}={cfg[key]!r} is not allowed: it must be true or false")
        check_baselines(cfg.performance_model)
        self.model: nn.Module | None = None
        self.layers: dict[str, nn.Module] = {}
        self.params: list[tuple[nn.Parameter, str | None]] = []
        self.states: dict[str, LayerSwitchState] = {}
        self.strategy: str = cfg.strategy
        self.losses: deque[float] = deque(maxlen=cfg.lookback.high)
        self.step_losses: list[torch.Tensor] = []
        self.switches, self.switch_seconds = 0, 0.0
        self.switch_rows: list[dict[str, Any]] = []
        self._record: PrecisionRecord = {}

    def prepare(self, model: nn.Module) -> nn.Module:
        cfg = self.cfg
        initialize(model, cfg.init, cfg.init_scale)
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
        if self.cfg.params == "weights":
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
        if cfg.grad == "quantized":  # rank 0's draws: every process rounds its (all-reduced, equal) gradients alike
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
