"""Pricing a run with AdaPT's performance model (AdaPT paper Sec. 4.1.2): the part AdaPT and MuPPET share, the mixin
:class:`PricedByPerformanceModel` over the model of :mod:`qtrain.cost.adapt_model`. See docs/cost.md."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from qtrain.cost.adapt_model import LayerState, PerformanceModel, resolve_baselines
from qtrain.methods.base import Method, RunFacts


class NonzeroShares:
    """Each of ``tensors``' share of non-zero elements, in a few kernels and one transfer whatever their number."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.numel = [t.numel() for t in tensors]
        self.ends = list(itertools.accumulate(self.numel))

    @torch.no_grad()
    def __call__(self) -> list[float]:
        if not self.tensors:
            return []
        flat = torch.cat([t.detach().reshape(-1) for t in self.tensors])
        counts = flat.ne(0).cumsum(0)[torch.tensor(self.ends, device=flat.device) - 1]  # non-zeros up to each end
        counts = torch.diff(counts, prepend=counts.new_zeros(1))
        return [int(c) / n for c, n in zip(counts.tolist(), self.numel)]


class PricedByPerformanceModel(Method):
    """A method that mixes this in names its quantized layers in ``layers``, calls :meth:`price_step` once per
    micro-batch with each layer's word length and weight density (and, for AdaPT, lookback and resolution), and gets
    the model's figures into summary.json through :meth:`performance_report`; baselines come from
    ``method.performance_model``."""

    layers: dict[str, nn.Module]
    facts: RunFacts | None = None
    perf: PerformanceModel | None = None
    _macs: dict[str, int] | None = None
    _others: NonzeroShares | None = None

    def profile(self, model: nn.Module, sample: torch.Tensor) -> dict[str, int]:
        macs = super().profile(model, sample)
        self._macs = {name: macs[name] for name in self.layers}
        weights = {id(layer.weight) for layer in self.layers.values()}
        self._others = NonzeroShares([p for p in model.parameters() if id(p) not in weights])
        return macs

    def attach(self, optimizer: torch.optim.Optimizer, facts: RunFacts) -> None:
        super().attach(optimizer, facts)
        self.facts = facts
        if self._macs is not None:
            numel = {name: layer.weight.numel() for name, layer in self.layers.items()}
            self.perf = PerformanceModel(self._macs, numel, facts.accum_steps)

    def price_step(self, layers: dict[str, LayerState]) -> None:
        """Price one micro-batch. Also reads, at every step, the share of non-zeros of each of the model's other
        parameter tensors (biases, batch norm) for Table 5's sparsity, in one pass over them
        (:class:`NonzeroShares`)."""
        if self.perf is not None:
            self.perf.add_step(layers, self._others())

    def performance_report(self, epochs: int) -> dict[str, Any]:
        """The model's figures after ``epochs`` epochs (empty before the run is attached and profiled)."""
        if self.perf is None or self.facts is None:
            return {}
        baselines = resolve_baselines(self.cfg.performance_model, self.facts.batch_size, self.facts.accum_steps, epochs)
        return self.perf.report(self.facts.batch_size, self.facts.samples_per_epoch, epochs, baselines)

    def performance_state(self) -> dict[str, Any] | None:
        return self.perf.state_dict() if self.perf is not None else None

    def load_performance_state(self, state: dict[str, Any] | None) -> None:
        if state is not None and self.perf is not None:
            self.perf.load_state_dict(state)
