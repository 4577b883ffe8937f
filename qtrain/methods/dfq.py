"""DFQ: dynamic fractional quantization (FracTrain Sec. 3.2, Eq. (1)-(2); appendix F).

Every residual block of the model sits behind a gate (:mod:`qtrain.methods.gates`) that picks, per
input sample, one of the precision options FW-a/BW-g (the first may be FW-0/BW-0: skip the block).
Inside a block every convolution runs at the chosen option with SBM's range-linear quantizers, except
depthwise convolutions, held at ``depthwise_bits``. Layers outside the blocks (the stem convolution,
MobileNetV2's last 1x1 convolution, the classifier) run at ``outside``, FW-8/BW-8 by default: the paper
does not say, and that is SBM's precision. The gates run and are charged in float32.

Training objective ``CE + beta * cp`` (Eq. (2)) with ``cp`` this step's cost in percent of float32,
a differentiable function of the gates: ``cp = fixed + sum_blocks mean_samples(g) . cost_per_option``.
The sign of beta follows the measured cp: +|beta| above the target, -|beta| below, so cp settles at
the target. The precision record of a step carries each block layer's option shares, and the share
of samples that skipped the block is charged nothing, so the cost meter matches ``cp`` exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn

from qtrain.cost.profile import profile_macs
from qtrain.errors import ConfigError
from qtrain.methods.base import Method, StepInfo, check_bits
from qtrain.methods.gates import GateController, GatedBlock
from qtrain.methods.sbm import check_range_linear, fw_bw, held_depthwise_bits, range_linear_quantizers, uniform_record
from qtrain.models.blocks import Block
from qtrain.precision import Bits, LayerPrecision, PrecisionRecord
from qtrain.quant.layers import swap_layers
from qtrain.quant.quantizers import RangeLinear

EXECUTIONS = ("per_sample", "mix_all")


def check_positive(cfg: DictConfig, key: str, high: float | None = None) -> None:
    """A number > 0 (and <= ``high``), or a non-empty list of them."""
    values = cfg[key] if isinstance(cfg[key], ListConfig) else [cfg[key]]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= (high or float("inf"))
                         for v in values):
        shown = list(cfg[key]) if isinstance(cfg[key], ListConfig) else cfg[key]
        bound = f"in (0, {high:g}]" if high else "> 0"
        raise ConfigError(f"method.{key}={shown!r} is not allowed: it must be a number {bound} (or a non-empty list of them)")


def parse_options(options: Any) -> list[tuple[int, int]]:
    """The [fw, bw] pairs of ``method.options``; a leading [0, 0] is the skip option."""
    error = ConfigError(f"method.options={options!r} is not allowed: a list of [fw, bw] pairs with bit-widths "
                        "from 1 to 32, optionally led by [0, 0] (skip the block), with at least one pair to run")
    if not isinstance(options, ListConfig) or not all(isinstance(p, ListConfig) and len(p) == 2 for p in options):
        raise error
    pairs = [(p[0], p[1]) for p in options]
    run = pairs[int(bool(pairs) and pairs[0] == (0, 0)):]
    if not run or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 32 for pair in run for b in pair):
        raise error
    return pairs


class DFQ(Method):
    name = "dfq"

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        if cfg.options is None:
            raise ConfigError("method dfq needs a model with residual blocks to gate; this model config has no "
                              "dfq_options (choose a ResNet or MobileNetV2)")
        check_range_linear(cfg)
        check_bits(cfg.outside, "fw", "bw", prefix="method.outside.")
        if cfg.execution not in EXECUTIONS:
            raise ConfigError(f"method.execution={cfg.execution!r} is not allowed (choose from: {', '.join(EXECUTIONS)})")
        check_positive(cfg, "beta")
        self.check_target()
        options = parse_options(cfg.options)
        self.has_skip = options[0] == (0, 0)
        self.run_bits = [fw_bw(fw, bw) for fw, bw in options[int(self.has_skip):]]
        self.num_options = len(options)
        self.model: nn.Module | None = None
        self.controller: GateController | None = None
        self.blocks: list[GatedBlock] = []
        self.block_names: list[str] = []
        self.in_blocks: set[str] = set()  # the quantized layers inside gated blocks
        self.block_layers: list[list[tuple[str, list[Bits]]]] = []  # per block: (layer, bits per run option)
        self.outside_record: PrecisionRecord = {}
        self.cost_matrix: torch.Tensor | None = None  # (blocks, options): cp of each block at each option
        self.fixed_cp = 0.0
        self._record: PrecisionRecord = {}
        self._cp_sum, self._samples = 0.0, 0

    def check_target(self) -> None:
        check_positive(self.cfg, "target_cp", high=100)

    def target_cp(self) -> float:
        """The cp (percent of float32) the controller steers to now."""
        return float(self.cfg.target_cp)

    def prepare(self, model: nn.Module) -> nn.Module:
        device = next(model.parameters()).device
        self.controller = GateController(self.num_options).to(device)
        model.gate_controller = self.controller
        model.register_forward_pre_hook(self.controller.reset)
        for name, block in [(n, m) for n, m in model.named_modules() if isinstance(m, Block)]:
            in_channels = next(m for m in block.modules() if isinstance(m, nn.Conv2d)).in_channels
            gated = GatedBlock(block, in_channels, self.controller, self.has_skip, self.cfg.execution).to(device)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, gated)
            self.blocks.append(gated)
            self.block_names.append(name)
        if not self.blocks:
            raise ConfigError(f"method dfq needs a model with residual blocks to gate; {type(model).__name__} has none")

        def quantizers(name: str, layer: nn.Module) -> Any:
            if ".embed." in name or name.startswith("gate_controller."):
                return None  # the gates stay float32
            held = held_depthwise_bits(layer, self.cfg)
            if held is not None:
                return range_linear_quantizers(held, self.cfg)
            if any(name.startswith(f"{b}.block.") for b in self.block_names):
                return [range_linear_quantizers(bits, self.cfg) for bits in self.run_bits]
            return range_linear_quantizers(fw_bw(self.cfg.outside.fw, self.cfg.outside.bw), self.cfg)

        swapped = swap_layers(model, quantizers)
        for b in self.block_names:
            layers = [n for n in swapped if n.startswith(f"{b}.block.")]
            self.block_layers.append([(n, self._option_bits(model.get_submodule(n))) for n in layers])
        self.in_blocks = {n for layers in self.block_layers for n, _ in layers}
        self.outside_record = uniform_record(model, [n for n in swapped if n not in self.in_blocks])
        self._record = dict(self.outside_record)
        self.model = model
        return model

    def _option_bits(self, layer: nn.Module) -> list[Bits]:
        """The bits of ``layer`` at each run option (a layer held at one precision repeats it)."""
        bits = [q.bits() for q in layer.quants]
        return bits if len(bits) > 1 else bits * len(self.run_bits)

    def profile(self, model: nn.Module, sample: torch.Tensor) -> dict[str, int]:
        """Profile with every block running, then tabulate each block's cost per option."""
        self.controller.forced = self.num_options - 1
        try:
            macs = profile_macs(model, sample)
        finally:
            self.controller.forced = None
        float32 = 3.0 * sum(macs.values())
        # everything but the block layers: the outside layers at their bits, the gates in float32
        fixed = sum(m * sum(self.outside_record[n].gemm_fractions if n in self.outside_record else (1.0, 1.0, 1.0))
                    for n, m in macs.items() if n not in self.in_blocks)
        rows = []
        for layers in self.block_layers:
            row = [sum(macs[n] * sum(bits[k].gemm_fractions()) for n, bits in layers) for k in range(len(self.run_bits))]
            rows.append([0.0] * self.has_skip + row)
        device = next(model.parameters()).device
        self.cost_matrix = torch.tensor(rows, dtype=torch.float32, device=device) * (100.0 / float32)
        self.fixed_cp = 100.0 * fixed / float32
        return macs

    def loss(self, loss: torch.Tensor, info: StepInfo) -> torch.Tensor:
        shares = torch.stack([block.gates.mean(0) for block in self.blocks])
        cp = self.fixed_cp + (shares * self.cost_matrix).sum()
        measured, *flat = torch.cat([cp.detach().view(1), shares.detach().flatten()]).tolist()
        self._record = self._step_record(flat)
        self._cp_sum += measured * info.samples
        self._samples += info.samples
        beta = self.cfg.beta if measured > self.target_cp() else -self.cfg.beta
        return loss + beta * cp

    def _step_record(self, flat_shares: list[float]) -> PrecisionRecord:
        record = dict(self.outside_record)
        k = self.num_options
        for b, layers in enumerate(self.block_layers):
            run_shares = flat_shares[b * k + self.has_skip:(b + 1) * k]
            for name, bits in layers:
                options = tuple((s, bb) for s, bb in zip(run_shares, bits) if s > 0)
                record[name] = LayerPrecision(options, RangeLinear.fmt)
        return record

    def precision(self) -> PrecisionRecord:
        return self._record

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        metrics["cp"] = self._cp_sum / self._samples if self._samples else float("nan")
        metrics["target_cp"] = self.target_cp()
        self._cp_sum, self._samples = 0.0, 0
