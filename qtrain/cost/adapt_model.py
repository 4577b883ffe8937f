"""AdaPT's analytical performance model (AdaPT paper Sec. 4.1.2, eqs. (6)-(9); Tables 3-6): training cost, overhead,
memory, model size, sparsity and speedups against the float32 baselines of :class:`BaselineRun`. The formulas,
their fit to the tables and every departure from the paper and the reference code (lorenz0890/AdaPT): docs/cost.md."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

PUSHDOWN_STEPS = 2 * math.log2(32 - 8)  # eq. (6): the bisection's steps over word lengths 8..32, two per step


@dataclass(frozen=True)
class BaselineRun:
    """A float32 training run priced by the model: batch size, accumulation steps and epochs."""

    batch_size: int
    accum_steps: int
    epochs: float


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
