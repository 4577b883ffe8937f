"""AdaPT's analytical performance model (AdaPT paper Sec. 4.1.2, eqs. (6)-(9); Tables 3-6).

Per training step ``i`` (a forward and backward pass of one micro-batch) and layer ``l`` with ``ops_l``
forward MACs per sample (qtrain's profile of the layers the method quantizes: Conv2d and Linear), word
length ``WL`` and weight density ``sp`` (share of non-zero quantized weights):

- training cost, eq. (8): ``ops_l * (sp * WL + 32 / accs)`` per sample: the forward pass at the layer's
  word length on a sparse tensor, the backward pass in float32 with dense gradients, amortized over the
  ``accs`` accumulation steps as the paper writes it;
- AdaPT's overhead, eq. (9): ``32 * (sp * ops_pd + ops_pu) / (accs * lb)`` per micro-batch with the
  PushDown and PushUp bounds of eqs. (6)-(7), ``ops_pd = 2 * log2(32 - 8) * r * 3 * numel`` and
  ``ops_pu = (lb + 1) * numel + 1`` (``r`` the layer's resolution, ``lb`` its lookback, ``numel`` its
  weight count): one switch's ``32 * (sp * ops_pd + ops_pu)`` spread over the ``lb`` optimizer steps
  (``accs * lb`` micro-batches) between two switches. A switch acts on the weights once per optimizer
  step, whatever the batch, so the overhead is *not* multiplied by the batch size: the printed
  ``bs_ours * costs_ours`` would charge it once per sample (in a 10-epoch AlexNet run at batch 128 that
  made it 5.6 times the training cost);
- memory: ``Σ_l (sp * WL + 32)`` per step (quantized copy plus float32 master), averaged over steps. A
  layer at 32 bits (MuPPET's float32 stage) is charged ``sp * 32 + 32`` too, as AdaPT's reference priced
  MuPPET (``utils/analytics.py`` prices its published schedule with the float32 epochs at WL = 32): MEM is
  then ``1 + mean(WL) / 32`` for a dense run, 1.665 for AlexNet's 8/12/14/16/32 bits over 16/10/14/14/45
  epochs and 1.62 for ResNet-20's 22/22/10/15/45 (Table 3: 1.66 and 1.61);
- model size: ``Σ_l sp * WL`` after the last step;
- sparsity (Table 5): the share of zeros after the last step (``final``) and averaged over the steps
  (``average``), each an unweighted mean over every parameter tensor of the model: the quantized layers'
  weights at their rounded copies, biases and batch-norm parameters as they are (float32 in qtrain), read
  at every step. The reference (lorenz0890/AdaPT) averages the per-tensor zero shares its optimizer logs
  (``utils/analytics.py``), over the entries its logger keeps: ``utils/logging.py`` drops an entry whose
  *name* contains "bias", and the names differ by model. AlexNet's entries are named by layer class
  (``QConv2d_FP``, ``QLinear_FP``), so its 6 biases are kept beside its 6 weights: every tensor, as here.
  ResNet's are parameter names, so its biases (batch norm's and the classifier's) are dropped and its 21
  batch-norm weights are averaged beside its 22 conv/linear weights: qtrain's mean adds the 22 biases
  (43 of 65 tensors are the reference's). Beside them ``final_weighted`` and ``average_weighted`` weight
  each quantized layer's weights by their count (the share of zeros among all the quantized weights).

Speedups, for a float32 baseline ``b`` (:class:`BaselineRun`: batch ``bs_b``, accumulation ``accs_b``,
``E_b`` epochs over the same training set) against this run (``bs``, ``accs``, ``E`` epochs):

- ``SU``, the figure Tables 3-4 print (reference code, ``utils/analytics.py``, ``su_own`` and
  ``su_other``): ``SU = (E_b / E) * 64 / (x + 32 * (bs_b * accs_b) / (bs * accs))`` with
  ``x = Σ_i Σ_l ops_l * sp * WL / Σ_i Σ_l ops_l``, the mean of ``sp * WL`` over the run's steps and
  layers weighted by each layer's forward MACs, plus AdaPT's overhead per sample in the same unit
  (``overhead_bits = costs_AdaPT / (bs * Σ_i Σ_l ops_l)``, also reported). With the run's own batch,
  accumulation and epochs it is SU1, ``64 / (x + 32)``; with MuPPET's baseline (batch 128, no
  accumulation, 150 epochs) it is SU3, ``(150 / E) * 64 / (x + 32 * 128 / (bs * accs))``, the
  reference's ``epochs * 2 Σ fl32 / (Σ q + Σ fl32 * bs_ratio / accs)``. These fit all four published
  AdaPT rows of Tables 3-4 within 2.5 % (tests/test_adapt_model.py). The reference weights ``x`` by its
  own MAdds estimates and adds its overhead estimate per logged step into them (negligible beside its
  MAdds); qtrain weights by profiled MACs and amortizes the overhead per sample as above.
- ``SU_printed``, Sec. 4.1.2's formula: ``SU = bs_b * costs_b / (bs * costs_train + costs_AdaPT)``,
  ``costs_b`` eq. (8) at 32 bits, dense, without overhead, over ``E_b * ceil(N / bs_b)`` steps.
- SU2 (Table 3's iso-accuracy speedup) needs the float32 run's accuracy: ``qtrain-report`` computes it
  from the AdaPT run and its float32 baseline run (:mod:`qtrain.report.paper`).

``MEM`` is this run's memory over float32 training's, which holds one 32-bit copy of each layer
(``32 |L|``): above 1 where the quantized copy and the master cost more than float32 alone, as the
paper's text (Sec. 4.2.1, "increased intra-training memory consumption") and Fig. 7 read it and as
Tables 3-4 list it (1.41 to 1.66); Sec. 4.1.2 writes the quotient the other way. Inference (Table 6):
``SU = Σ ops * 32 / Σ ops * sp * WL`` and ``SZ = sz_ours / (32 |L|)``, the model-size fraction the
table lists (0.36 to 0.60); ``SZ`` beside ``MEM`` is Sec. 4.1.2's training-side ratio, float32's size over
ours (``32 |L| / sz``). As the paper says, sizes and memory ignore tensor dimensions: they are
relative measures between identical architectures only.

Two more departures from the reference's figures: its memory code computes ``1 + 2 Σ_i sz_i / Σ_i 32 |L|``
(``mem_own``), while every published MEM (Tables 3-4) fits ``1 + Σ_i sz_i / Σ_i 32 |L|``, the reading qtrain
follows (memory above); and its MEM, SZ and inference SU run over every entry its logger keeps (batch-norm
weights, pooling and, in AlexNet, biases, at their logged word lengths), qtrain's over the quantized
Conv2d/Linear weights only (the sparsity above is the one figure taken over every tensor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from qtrain.errors import ConfigError

PUSHDOWN_STEPS = 2 * math.log2(32 - 8)  # eq. (6): the bisection's steps over word lengths 8..32, two per step


@dataclass(frozen=True)
class BaselineRun:
    """A float32 training run priced by the model: batch size, accumulation steps and epochs."""

    batch_size: int
    accum_steps: int
    epochs: float


def check_baselines(baselines: DictConfig, key: str = "method.performance_model") -> None:
    """Each baseline names ``batch_size``, ``accum_steps`` (integers >= 1) and ``epochs`` (> 0); null: the run's own."""
    if not isinstance(baselines, DictConfig):
        raise ConfigError(f"{key}={baselines!r} is not allowed: it maps baseline names to "
                          "{{batch_size, accum_steps, epochs}}")
    for name, baseline in baselines.items():
        if not isinstance(baseline, DictConfig) or set(baseline.keys()) != {"batch_size", "accum_steps", "epochs"}:
            raise ConfigError(f"{key}.{name}={baseline!r} is not allowed: a baseline has exactly batch_size, "
                              "accum_steps and epochs (null: this run's value)")
        for field in ("batch_size", "accum_steps", "epochs"):
            value = baseline[field]
            integer = field != "epochs"
            if value is not None and (isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
                                      or value < (1 if integer else 0) or (not integer and value == 0)):
                kind = "an integer >= 1" if integer else "a number > 0"
                raise ConfigError(f"{key}.{name}.{field}={value!r} is not allowed: it must be {kind} or null (this run's)")


def resolve_baselines(baselines: DictConfig, batch_size: int, accum_steps: int, epochs: int) -> dict[str, BaselineRun]:
    """The baselines of the config, with null fields filled by the run's own batch size, accumulation and epochs."""
    own = {"batch_size": batch_size, "accum_steps": accum_steps, "epochs": epochs}
    return {name: BaselineRun(**{k: own[k] if b[k] is None else b[k] for k in own}) for name, b in baselines.items()}


@dataclass(frozen=True)
class LayerState:
    """One layer at one step: word length, weight density and (AdaPT) its lookback and resolution."""

    wl: float
    density: float
    lookback: int | None = None
    resolution: int | None = None


def pushdown_ops(resolution: int, numel: int) -> float:
    """Eq. (6): the bound on one PushDown's operations."""
    return PUSHDOWN_STEPS * resolution * 3 * numel


def pushup_ops(lookback: int, numel: int) -> float:
    """Eq. (7): the bound on one PushUp's operations."""
    return (lookback + 1) * numel + 1


class PerformanceModel:
    """Accumulates eqs. (8)-(9), memory, size and sparsity over a run's steps; :meth:`report` gives SU, MEM, SZ."""

    def __init__(self, ops: dict[str, int], numel: dict[str, int], accum_steps: int) -> None:
        if accum_steps < 1:
            raise ValueError(f"accum_steps={accum_steps} must be >= 1")
        self.ops, self.numel, self.accs = dict(ops), dict(numel), accum_steps
        self.train_cost = 0.0  # Σ_i eq. (8), per sample
        self.reference_cost = 0.0  # Σ_i Σ_l ops (sp * WL + 32): the reference code's cost, per sample
        self.pushdown_cost = 0.0  # Σ_i eq. (9), its PushDown part
        self.pushup_cost = 0.0  # Σ_i eq. (9), its PushUp part
        self.memory_sum = 0.0  # Σ_i Σ_l (sp * WL + 32)
        self.density_sum = 0.0  # Σ_i (share of non-zero weights over all layers, each weighted by its weight count)
        self.tensor_density_sum = 0.0  # Σ_i (mean over the parameter tensors of each one's share of non-zeros)
        self.steps = 0
        self.last: dict[str, LayerState] = {}
        self.last_others: list[float] = []

    def add_step(self, layers: dict[str, LayerState], others: Sequence[float] = ()) -> None:
        """Charge one step (a micro-batch) with every layer in the state ``layers`` gives; ``others`` are the
        shares of non-zeros of the model's other parameter tensors (biases, batch norm), for Table 5's mean."""
        train = reference = pushdown = pushup = memory = 0.0
        for name, ops in self.ops.items():
            state = layers[name]
            train += ops * (state.density * state.wl + 32 / self.accs)
            reference += ops * (state.density * state.wl + 32)
            memory += state.density * state.wl + 32
            if state.lookback is not None:
                numel, per_switch = self.numel[name], 32 / (self.accs * state.lookback)
                pushdown += per_switch * state.density * pushdown_ops(state.resolution, numel)
                pushup += per_switch * pushup_ops(state.lookback, numel)
        self.train_cost += train
        self.reference_cost += reference
        self.pushdown_cost += pushdown
        self.pushup_cost += pushup
        self.memory_sum += memory
        self.density_sum += self.density(layers)
        self.tensor_density_sum += self.tensor_density(layers, others)
        self.steps += 1
        self.last, self.last_others = dict(layers), list(others)

    def density(self, layers: dict[str, LayerState]) -> float:
        """Share of non-zero weights over all the model's layers (each weighted by its weight count)."""
        return sum(layers[name].density * n for name, n in self.numel.items()) / sum(self.numel.values())

    def tensor_density(self, layers: dict[str, LayerState], others: Sequence[float]) -> float:
        """Mean over the parameter tensors (the layers' weights and ``others``) of each one's share of
        non-zeros (Table 5's)."""
        return (sum(layers[name].density for name in self.numel) + sum(others)) / (len(self.numel) + len(others))

    def model_size(self) -> float:
        """``sz = Σ_l sp * WL`` after the last step."""
        return sum(self.last[name].density * self.last[name].wl for name in self.ops)

    def baseline_cost(self, baseline: BaselineRun, samples_per_epoch: int) -> float:
        """``bs * costs`` of float32 training under ``baseline``: every step at 32 bits, dense, no overhead."""
        per_step = sum(ops * (32 + 32 / baseline.accum_steps) for ops in self.ops.values())
        steps = baseline.epochs * math.ceil(samples_per_epoch / baseline.batch_size)
        return baseline.batch_size * steps * per_step

    def report(self, batch_size: int, samples_per_epoch: int, epochs: float,
               baselines: dict[str, BaselineRun]) -> dict[str, Any]:
        """The model's figures for a run of ``epochs`` epochs at micro-batch ``batch_size``: costs, SU per
        baseline (the reference's and Sec. 4.1.2's), MEM, sparsity, inference SU/SZ."""
        if not self.steps:
            return {}
        overhead = self.pushdown_cost + self.pushup_cost  # per optimizer step: not times the batch
        ours = batch_size * self.train_cost + overhead
        op_steps = sum(self.ops.values()) * self.steps
        x = self.reference_cost / op_steps - 32
        overhead_bits = overhead / (batch_size * op_steps)
        memory = self.memory_sum / self.steps
        size = self.model_size()
        float32_size = 32.0 * len(self.ops)
        final_ops = sum(ops * self.last[name].density * self.last[name].wl for name, ops in self.ops.items())

        def reference_su(b: BaselineRun) -> float:
            backward = 32 * b.batch_size * b.accum_steps / (batch_size * self.accs)
            return b.epochs / epochs * 64 / (x + overhead_bits + backward)

        return {
            "train_cost": batch_size * self.train_cost, "overhead_cost": overhead,
            "pushdown_cost": self.pushdown_cost, "pushup_cost": self.pushup_cost,
            "steps": self.steps, "x": x, "overhead_bits": overhead_bits,
            "memory": memory, "model_size": size,
            "MEM": memory / float32_size, "SZ": float32_size / size if size else math.inf,
            "sparsity": {"final": 1 - self.tensor_density(self.last, self.last_others),
                         "average": 1 - self.tensor_density_sum / self.steps,
                         "final_weighted": 1 - self.density(self.last),
                         "average_weighted": 1 - self.density_sum / self.steps},
            "baselines": {
                name: {"batch_size": b.batch_size, "accum_steps": b.accum_steps, "epochs": b.epochs,
                       "SU": reference_su(b), "SU_printed": self.baseline_cost(b, samples_per_epoch) / ours}
                for name, b in baselines.items()
            },
            "inference": {"SU": 32 * sum(self.ops.values()) / final_ops if final_ops else math.inf,
                          "SZ": size / float32_size},
        }

    def state_dict(self) -> dict[str, Any]:
        return {"train_cost": self.train_cost, "reference_cost": self.reference_cost,
                "pushdown_cost": self.pushdown_cost, "pushup_cost": self.pushup_cost, "memory_sum": self.memory_sum,
                "density_sum": self.density_sum, "tensor_density_sum": self.tensor_density_sum, "steps": self.steps,
                "last": {name: [s.wl, s.density, s.lookback, s.resolution] for name, s in self.last.items()},
                "last_others": list(self.last_others)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_cost, self.reference_cost = state["train_cost"], state["reference_cost"]
        self.pushdown_cost, self.pushup_cost = state["pushdown_cost"], state["pushup_cost"]
        self.memory_sum, self.density_sum, self.steps = state["memory_sum"], state["density_sum"], state["steps"]
        self.tensor_density_sum, self.last_others = state["tensor_density_sum"], list(state["last_others"])
        self.last = {name: LayerState(*values) for name, values in state["last"].items()}
