"""DYNASTY: block-wise dynamic-precision training (the DYNASTY paper, Sec. 3.1-3.3; no public code exists): 4 x 4-block
floating point under per-block bit-width maps, regenerated at each epoch's end from the blocks' sensitivities.
Which operand is mapped, the rounding modes and every gap or departure, with its reason: docs/methods/dynasty.md."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qtrain import distributed
from qtrain.config import methods as schemas
from qtrain.methods import dynasty_map
from qtrain.methods.base import Method, RunFacts
from qtrain.methods.sbm import float_ends
from qtrain.precision import Bits, LayerPrecision, PrecisionRecord
from qtrain.quant.block_maps import BLOCK, STATIC_BITS, ActivationMap, BlockMapped, Sensitivity, WeightMap, operand_dims
from qtrain.quant.formats import tile_sums
from qtrain.quant.layers import OperandQuantizers, swap_layers
from qtrain.quant.quantizers import BlockFloatingPoint

OPERANDS = ("weight", "act")


class Dynasty(Method):
    cfg: schemas.Dynasty

    def __init__(self, cfg: schemas.Dynasty) -> None:
        super().__init__(cfg)
        self.levels = tuple(cfg.levels)
        self.act_in_forward = cfg.act_map is schemas.ActMap.FORWARD
        self.layers: dict[str, OperandQuantizers] = {}
        self.macs: dict[str, int] = {}
        self.batch_size = 0
        self.lam: float | None = None
        self.smoothed: dict[str, torch.Tensor] = {}  # continuous map per "layer/operand"
        self.history: list[dict[str, float]] = []
        self._computation: dict[str, torch.Tensor] = {}
        self._records: dict[int, PrecisionRecord] = {}
        self._rows: list[dict[str, Any]] = []

    # -- setup ---------------------------------------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
        cfg = self.cfg
        names = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
        keep_float = float_ends(cfg, names)

        def quantizers(name: str, layer: nn.Module) -> OperandQuantizers | None:
            if name in keep_float:
                return None
            dims = operand_dims(layer)  # batch x channels of the activation and grad_output
            weight = WeightMap(cfg.weight_rounding.value, cfg.initial_bits)
            act = ActivationMap(cfg.act_rounding.value, cfg.initial_bits, dims, in_forward=self.act_in_forward)
            grad = BlockFloatingPoint(STATIC_BITS, cfg.grad_rounding.value, block=BLOCK, dims=dims)
            return OperandQuantizers(weight=weight, act=act, grad=grad, observer=Sensitivity(weight, act))

        swapped = swap_layers(model, quantizers)
        self.layers = {name: model.get_submodule(name).quant for name in swapped}
        self.model = model
        return model

    def attach(self, optimizer: torch.optim.Optimizer, facts: RunFacts) -> None:
        self.batch_size = facts.rank_batch_size  # an activation map covers one process's part of a batch
        for quant in self.layers.values():
            quant.act.batch_size = self.batch_size

    def profile(self, model: nn.Module, sample: torch.Tensor) -> dict[str, int]:
        self.macs = super().profile(model, sample)
        return self.macs

    # -- blocks --------------------------------------------------------------------------------------
    def _operands(self) -> list[tuple[str, str, BlockMapped]]:
        return [(name, operand, getattr(quant, operand)) for name, quant in self.layers.items() for operand in OPERANDS]

    def computation(self, name: str, operand: str) -> torch.Tensor:
        """T_i of each block of one operand for a full batch (float64): the MACs its elements take part in as the
        mapped operand, counted by differentiating the layer's GEMM on all-ones operands (padding and strides
        included: an input a strided 1x1 convolution never reads counts 0). A weight element is mapped in two
        GEMMs (forward, error), an activation element in one (weight gradient) or, with ``act_map: forward``, in
        two (forward, weight gradient: the same MACs per element)."""
        key = f"{name}/{operand}"
        if key not in self._computation:
            layer, quant = self.model.get_submodule(name), self.layers[name]
            with torch.enable_grad():
                x = torch.ones((self.batch_size, *quant.act.sample_shape), device=layer.weight.device, requires_grad=True)
                w = torch.ones_like(layer.weight, requires_grad=True)
                layer.gemm(x, w, None).sum().backward()
            self._computation[f"{name}/weight"] = tile_sums(2 * w.grad, BLOCK, quant.weight.dims).double()
            gemms = 2 if self.act_in_forward else 1
            self._computation[f"{name}/act"] = tile_sums(gemms * x.grad, BLOCK, quant.act.dims).double()
        return self._computation[key]

    @staticmethod
    def _shares(bits: torch.Tensor, weight: torch.Tensor) -> list[tuple[int, float]]:
        """(width, share of ``weight``) for every width present in ``bits``."""
        totals = torch.zeros(STATIC_BITS + 1, dtype=torch.float64, device=bits.device)
        totals.index_add_(0, bits.long(), weight.double())
        totals = (totals / weight.double().sum()).tolist()
        return [(b, share) for b, share in enumerate(totals) if share > 0]

    # -- the precision record --------------------------------------------------------------------------
    def precision(self) -> PrecisionRecord:
        if not self.layers:
            return {}
        first = next(iter(self.layers.values())).act
        rows = getattr(first, "last_rows", None)
        if rows is None or first.map is None:
            return {}
        if rows not in self._records:
            self._records[rows] = {name: self._layer_record(name) for name in self.layers}
        return self._records[rows]

    def _layer_record(self, name: str) -> LayerPrecision:
        quant = self.layers[name]
        rows = quant.act.last_rows
        weights = self._shares(quant.weight.map, self.computation(name, "weight"))
        acts = self._shares(quant.act.map[:rows], self.computation(name, "act")[:rows])
        options = tuple((sw * sa, Bits(weight=bw, act=ba if self.act_in_forward else STATIC_BITS, grad=STATIC_BITS,
                                       grad_weight=STATIC_BITS, act_weight=ba))
                        for bw, sw in weights for ba, sa in acts)
        return LayerPrecision(options, WeightMap.fmt)

    # -- the epoch's end: Sec. 3.3 -----------------------------------------------------------------------
    def average_bits(self) -> float:
        """The computation-weighted average width of the maps in use (over every mapped block)."""
        operands = self._operands()
        bits = torch.cat([q.map.double() for _, _, q in operands])
        weight = torch.cat([self.computation(n, o) for n, o, _ in operands])
        return dynasty_map.weighted_average(bits, weight)

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        if not self.layers:
            return
        cfg = self.cfg
        operands = self._operands()
        used = self.average_bits()
        self._rows.extend(self._bitmap_rows(epoch, metrics))
        computation = [self.computation(n, o) for n, o, _ in operands]
        sizes = [t.numel() for t in computation]
        weight = torch.cat(computation)
        # summed over processes (block by block of each process's part of the batch): every process gets one map
        sensitivities = distributed.sum_(torch.cat([q.sensitivity for _, _, q in operands]))
        r = dynasty_map.relative_sensitivity(sensitivities, weight)
        alpha, beta = float(cfg.target_bits), float(cfg.max_bits)
        held = dynasty_map.average_weights(weight, cfg.average.value)  # the average Algorithm 1 holds at alpha
        start = self.lam if self.lam is not None else dynasty_map.first_lambda(r, held, alpha)
        self.lam = dynasty_map.tune_lambda(start, r, held, alpha, beta, cfg.iterations)
        new = dynasty_map.bit_widths(r, self.lam, beta)
        if self.smoothed:
            last = torch.cat([self.smoothed[f"{n}/{o}"] for n, o, _ in operands])
            smoothed = dynasty_map.smooth(last, new, float(cfg.smoothing))
        else:  # the first map from sensitivities: the first epoch's 4 bits were a placeholder, not a map to keep
            smoothed = new
        rounded = dynasty_map.round_to_levels(smoothed, self.levels)
        for (name, operand, quant), part, bits in zip(operands, smoothed.split(sizes), rounded.split(sizes)):
            self.smoothed[f"{name}/{operand}"] = part
            quant.map = bits
            quant.sensitivity.zero_()
        self._records.clear()
        entry = {"epoch": epoch + 1, "average_bits": used, "lambda": self.lam,
                 "unrounded_next_bits": dynasty_map.weighted_average(smoothed, weight),
                 "next_average_bits": dynasty_map.weighted_average(rounded.double(), weight)}
        self.history.append(entry)
        metrics.update({"dynasty_average_bits": used, "dynasty_lambda": self.lam,
                        "dynasty_next_average_bits": entry["next_average_bits"]})

    def _bitmap_rows(self, epoch: int, metrics: dict[str, float]) -> list[dict[str, Any]]:
        """precision.csv rows of the maps used this epoch: per layer and operand, the share at each width."""
        rows = []
        for name, operand, quant in self._operands():
            weight = self.computation(name, operand)
            shares = dict(self._shares(quant.map, weight))
            rows.append({"epoch": epoch + 1, "step": metrics.get("step"), "layer": name, "event": "bitmap",
                         "operand": operand, "format": WeightMap.fmt,
                         "average_bits": dynasty_map.weighted_average(quant.map.double(), weight),
                         **{f"share_{b}bit": shares.get(b, 0.0) for b in self.levels}})
        return rows

    def drain_event_rows(self) -> list[dict[str, Any]]:
        rows, self._rows = self._rows, []
        return rows

    def report(self, epochs: int) -> dict[str, Any]:
        if not self.history:
            return {}
        per_epoch = [h["average_bits"] for h in self.history]
        return {"target_bits": float(self.cfg.target_bits), "average_bits": sum(per_epoch) / len(per_epoch),
                "average_bits_per_epoch": per_epoch, "lambda": self.lam, "levels": list(self.levels)}

    # -- resume ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"lambda": self.lam, "history": list(self.history),
                "smoothed": {k: v.cpu() for k, v in self.smoothed.items()},
                "maps": {f"{n}/{o}": q.map.cpu() for n, o, q in self._operands() if q.map is not None}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lam, self.history = state["lambda"], list(state["history"])
        device = next(iter(self.model.parameters())).device
        self.smoothed = {k: v.to(device) for k, v in state["smoothed"].items()}
        for name, operand, quant in self._operands():
            key = f"{name}/{operand}"
            if key in state["maps"]:
                quant.map = state["maps"][key].to(device)
                quant.sensitivity = torch.zeros(quant.map.shape, dtype=torch.float64, device=device)
        self._records.clear()
