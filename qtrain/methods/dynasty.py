"""DYNASTY: block-wise dynamic-precision training (the DYNASTY paper). No public code exists.

Sec. 3.1 (framework): every Conv2d/Linear trains on block floating point, 4 x 4 blocks with one
shared exponent (:mod:`qtrain.quant.block_maps`): C_out x C_in for weights, batch x C_in for
activations and batch x C_out for ``grad_output``, at each spatial position of a Conv2d and at each
token of a Linear's (batch, tokens, C) input, tokens taking the place of spatial positions (the tiled
dimensions are chosen per layer in :meth:`Dynasty.prepare`). In each of the three GEMMs one operand has
static 8-bit mantissas and the other 0-8 bits per block from its bit-width map; a 0-bit block is skipped.
Which operand is mapped (``act_map: weight_gradient``, the default): the weight in the forward and error
GEMMs, the activation in the weight-gradient GEMM; ``grad_output`` is always the static one. The paper
names the mapped operand of no stage; this follows from it: sensitivity (eq. 1 and the sentence after
it) exists for weights and activations, whose gradients the training computes, and not for
``grad_output``; and the weight is the bit-serial operand of UNPU, the accelerator DYNASTY extends
(1-16-bit weights), so every GEMM keeps one serial operand. Eq. 1 measures the loss noise of a
forward-pass quantization, which the weight map causes; under this default the activation map acts in
the weight-gradient GEMM only, where eq. 1 (with the gradient w.r.t. the activation, as the paper says)
ranks its blocks as the paper does, but is not that GEMM's own noise. ``act_map: forward`` is the
reading in which eq. 1's activation term is the noise it measures: the activation is quantized by its
map once and that one tensor enters the forward GEMM (against the mapped weight) and the weight-gradient
GEMM (against the 8-bit ``grad_output``); an activation block's T_i then counts both GEMMs. A forward
without gradients (evaluation) takes activations at 8 bits under either reading: the map covers the rows
of a training batch. A b-bit mantissa includes its sign (2 bits: -1, 0, 1 times the block's step), as
QPyTorch's block floating point counts it.

Sec. 3.2 (Relative Quantization Sensitivity Analytics): every backward adds eq. 1,
``S_i = (2^e_i)^2/16 * sum_j g_ij^2``, of each weight block (g: its weight gradient) and each
activation block (g: the gradient w.r.t. the layer's input) to accumulators that sum over the epoch.

Sec. 3.3 (Adaptive Bit-Width Map Generator; :mod:`qtrain.methods.dynasty_map`), at each epoch's end:
``r_i = 1/2 log2(S_i/T_i)`` (eq. 3b), one global lambda for every block of every layer and operand by
Algorithm 1 (from ``lambda^ = mean(r) - alpha`` after the first epoch, from the last lambda after
that), ``b_i = clip(r_i - lambda, 0, beta)`` (eq. 3a), temporal smoothing with gamma = 0.5 (eq. 4),
rounding to {0, 2, 4, 6, 8}. The first epoch runs every block at 4 bits. T_i, a block's computation,
is the MACs its elements take part in as the mapped operand per step (:meth:`Dynasty.computation`);
the average bit-width that Algorithm 1 holds at ``target_bits`` (alpha, eq. 2b) is weighted by it
(``average: macs``; ``blocks``: Algorithm 1's printed plain mean, see :mod:`qtrain.methods.dynasty_map`),
and so are the shares the cost meter charges and the ``average_bits`` the run reports, under either.

Where this departs from the paper or fills a gap it leaves:

- A Transformer's attention products QK^T and attention x V (two activations, no weight) stay
  float32 and are charged so: the paper maps the weight in the forward and error GEMMs, and these
  have none (it trains CNNs only). Their Linear layers are mapped like any other, tokens taking the
  place of spatial positions: blocks of 4 sequences x 4 channels at each token.

- Rounding modes are not in the paper: weights and activations round to nearest (half to even),
  gradients stochastically (``*_rounding``).
- Smoothing starts with the first map computed from sensitivities: the first epoch's 4 bits are a
  placeholder (Sec. 3.3.2: "when we have not got the value of lambda^"), and averaging with them
  would hold the second epoch's map halfway between 4 bits and the first computed one (at alpha = 2,
  an average of 3 bits). From then on Algorithm 1 holds the new map at alpha and eq. 4
  keeps the smoothed one there.
- Eq. 4's ``b_last`` is the previous smoothed map before rounding (the rounding is for the hardware);
  smoothing the rounded map would add each epoch's rounding error to the next.
- Sensitivities are summed per micro-batch (the gradients of the loss that the micro-batch's backward
  divides by the accumulation steps), so weights and activations are measured alike.
- An activation map covers one full batch (blocks of 4 samples x 4 channels at each spatial
  position or token); a smaller last batch uses its first rows. The exponent is float32's (8 bits over the
  normal range; blocks below 2^-126 keep the subnormal grid).
- One lambda for every block of weights and activations together (Sec. 3.2.2: "a single hyperparameter");
  the paper's Fig. 5 discussion follows the weights' and the activations' average widths apart, which
  could also be read as a target per operand type: not offered.
- Batch norm and the weight update stay float32, and weight gradients are not quantized: the paper's
  footnote 1 divides "weight and weight gradients" into blocks, but no GEMM takes the weight gradient
  as an input, so its blocks would only store it; ``grad_output`` is the backward's static 8-bit operand.
- ``act_map: forward`` puts two mapped operands into the forward GEMM (weight and activation), against
  Sec. 3.1's one static 8-bit operand per GEMM; the bit-serial model (:mod:`qtrain.cost.bit_serial`)
  prices such a GEMM with the narrower of the two as the serial operand, a bound a hardware with one
  dynamic operand would not reach.
- See :mod:`qtrain.methods.dynasty_map` for Algorithm 1's computation weighting and edge cases.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from qtrain import distributed
from qtrain.config.schema import is_integer
from qtrain.errors import ConfigError
from qtrain.methods import dynasty_map
from qtrain.methods.base import Method, RunFacts, check_choice, check_int, check_number
from qtrain.methods.sbm import LAYER_PRECISIONS, float_ends
from qtrain.precision import Bits, LayerPrecision, PrecisionRecord
from qtrain.quant.block_maps import BLOCK, STATIC_BITS, ActivationMap, BlockMapped, Sensitivity, WeightMap, operand_dims
from qtrain.quant.formats import ROUNDINGS, tile_sums
from qtrain.quant.layers import OperandQuantizers, swap_layers
from qtrain.quant.quantizers import BlockFloatingPoint

OPERANDS = ("weight", "act")
ACT_MAPS = ("weight_gradient", "forward")


def _check_levels(cfg: DictConfig) -> tuple[int, ...]:
    levels = list(cfg.levels) if cfg.levels is not None else []
    if (not levels or any(not is_integer(v) for v in levels)
            or levels != sorted(set(levels)) or levels[0] < 0 or levels[-1] > cfg.max_bits):
        raise ConfigError(f"method.levels={levels!r} is not allowed: a non-empty ascending list of distinct integers "
                          f"from 0 to method.max_bits ({cfg.max_bits})")
    return tuple(levels)


class Dynasty(Method):
    name = "dynasty"

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        check_int(cfg, "max_bits", 1, STATIC_BITS)
        check_number(cfg, "target_bits", 0, cfg.max_bits)
        if cfg.target_bits <= 0:
            raise ConfigError(f"method.target_bits={cfg.target_bits!r} is not allowed: it must be a number in "
                              f"(0, {cfg.max_bits}] (the average bit-width, at most method.max_bits)")
        self.levels = _check_levels(cfg)
        check_int(cfg, "initial_bits", 0, cfg.max_bits)
        if cfg.initial_bits not in self.levels:
            raise ConfigError(f"method.initial_bits={cfg.initial_bits!r} is not allowed: it must be one of method.levels "
                              f"({', '.join(map(str, self.levels))})")
        check_number(cfg, "smoothing", 0, 1)
        check_int(cfg, "iterations", 1)
        for key in ("weight_rounding", "act_rounding", "grad_rounding"):
            check_choice(cfg, key, ROUNDINGS)
        for key in ("first_layer", "last_layer"):
            check_choice(cfg, key, LAYER_PRECISIONS)
        check_choice(cfg, "average", dynasty_map.AVERAGES)
        check_choice(cfg, "act_map", ACT_MAPS)
        self.act_in_forward = cfg.act_map == "forward"
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
            weight = WeightMap(cfg.weight_rounding, cfg.initial_bits)
            act = ActivationMap(cfg.act_rounding, cfg.initial_bits, dims, in_forward=self.act_in_forward)
            grad = BlockFloatingPoint(STATIC_BITS, cfg.grad_rounding, block=BLOCK, dims=dims)
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
        held = dynasty_map.average_weights(weight, cfg.average)  # the average Algorithm 1 holds at alpha
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

    def drain_switch_rows(self) -> list[dict[str, Any]]:
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
