"""DFQ: dynamic fractional quantization (FracTrain Sec. 3.2, Eq. (1)-(2); appendix F).

Every residual block of the model sits behind a gate (:mod:`qtrain.methods.gates`) that picks, per
input sample, one of the precision options FW-a/BW-g (the first may be FW-0/BW-0: skip the block).
As the paper says (Sec. 3.2: DFQ adapts "the precision of different layers' activations and
gradients") and the reference code does, an option sets the activation bits (FW) and the gradient
bits (BW, both backward GEMMs) of every convolution in the block; weights stay at one precision,
``weight_bits`` (the model config's ``dfq_weight_bits`` where it has one, else 4: the reference's
``--weight_bits`` in its CIFAR commands; 6 for ResNet-18/34, its ImageNet command). All samples that run
a layer share its quantized weight, one GEMM and one activation/gradient range, each sample rounded
at its own option's bits. Depthwise convolutions are held at ``depthwise_bits`` (activations FW-8,
gradients BW-16; weights at ``weight_bits``, as in the reference). Layers outside the blocks (the
stem convolution, MobileNetV2's last 1x1 convolution, the classifier) run in float32 as in the
reference (``outside: null``), or at ``outside: {fw, bw}`` (weights, as everywhere, at ``weight_bits``).
The gates run in float32. Activation
ranges: the tensor's global min/max (the reference's ``reduce_type='extreme'``) with the running
average the reference keeps for evaluation (``act_momentum``, its weight on the old value). The
reference runs a block once per run option, so its block layers update their running range K times
a step (K run options, nearly the same batch range each time); ``per_sample`` runs them once and
weighs the old value ``act_momentum ** K``, the same per-step decay (``mix_all`` runs K times at
``act_momentum``). Under ``per_sample`` a block runs once over the whole batch in training (a sample that
skips it at its most probable run option, its output discarded), so its batch-norm statistics and
activation ranges are the whole batch's, as in the reference, where every option runs on the whole batch.

Training objective ``CE + beta * cost`` (Eq. (2)). ``cost`` is the batch's summed cost, per sample and
gated block, in units of an average gated block's float32 forward MACs: the reference code's unit
(per sample and block, the block's GEMM cost fractions times its FLOPs over the mean block's), so the
default ``beta = 1e-3`` exerts the reference's pressure. The reference weighs blocks by their FLOPs for
MobileNetV2 only and counts every ResNet block as one (its ``conv_info`` defaults to ones); qtrain
weighs every block by its MACs, the paper's cost, so a ResNet downsampling block (about 0.78 of a
plain one) weighs a little less than in the reference. Its sign follows the measured cp: +beta at or above
the target, -beta below, so cp settles at the target (Algorithm 2, line 5). The controller's ``cp`` is
in percent of float32 over ``cp_scope``: ``blocks`` (the reference: the gated blocks' cost over their
float32 cost; the float32 stem, classifier and gates are not counted) or ``model`` (the whole model,
as the cost meter counts it). The cost meter always charges every layer, so ``percent_of_float32`` in
the results is the whole model's.

A sample that skips a shape-changing block runs its projection shortcut in float32 (SkipNet, and the
reference's ``ds(prev, 0, 0)``; ``skip_downsample: projection``). The reference's controller charges such a
skip nothing (``skip_charge: none``, default); ``skip_charge: projection`` makes the controller's cp and cost
term charge the float32 projection it runs (the cost meter and ``percent_of_float32`` always do).
``skip_downsample: never`` masks the skip option of those blocks out. Departures from the reference code: it
runs every option on every sample and mixes them (``execution: mix_all`` here, K times the work, the
reference's exact gate gradient); ``per_sample`` (default) runs a block once over the batch, each sample at
one option, and gives the gates an estimate of that gradient (:mod:`qtrain.methods.gates`). Option sets: the
model configs' ``dfq_options`` are appendix F's, which it gives for Fig. 5 (ResNet-38/74: skip, 2/6, 3/6, 4/6,
4/12, 6/8, 6/12; MobileNetV2: skip, 4/8, 6/8, 6/10, 8/8); FW-0/BW-0 means a skip. The reference's released
CIFAR scripts (train_dfq.py, train_frac.py) hard-code 3/6, 4/6, 4/8, 6/8, 6/12 without a skip, and its Table 3
logs (an earlier copy of the repository, Tubbz-alt/FracTrain,
learning_curve_dyn/learning_curve/train_logs_resnet*_cr3_w4.txt: the logged cp per GEMM fitted against the
logged option shares) show skip, 4/6, 6/8, 6/12, 8/16 for ResNet-38 and, without a skip, 3/6, 4/6, 6/8, ?,
8/16 for ResNet-74 (the fourth is never chosen in the logs; qtrain fills it with 6/12, which sits there in
ResNet-38's set). The paper-table experiments (fractrain_table3, Table 5's fractrain_adapt/fractrain_finetune)
take a model config's ``dfq_table3_options`` (ResNet-38, ResNet-74) and the released scripts' set for any
other model. (The reference's MobileNetV2 has no skip path: a 0-bit option would run the block in float32.)
For ResNet-18/34 the paper gives no options; the model configs take the reference's ImageNet ones
(``fractrain_imagenet/train_frac.py``: FW 3/4/6/8 paired with BW 6/8/12/16, no skip). That code runs the
projection shortcuts of its ImageNet ResNets in float32 (plain ``nn.Conv2d``); qtrain quantizes them, as every
convolution of a gated block, at the sample's option. The reference charges MobileNetV2's depthwise
convolutions as a constant at 8-bit weights and adds that quantized cost to cp's denominator; qtrain charges
them inside their block, at ``weight_bits`` weights, only when the block runs, against their float32 cost.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn

from qtrain import distributed
from qtrain.cost.profile import profile_macs
from qtrain.errors import ConfigError
from qtrain.methods.base import Method, StepInfo, check_bits, check_choice, check_positive
from qtrain.methods.gates import GateController, GatedBlock
from qtrain.methods.sbm import check_range_linear, is_depthwise, range_linear_quantizers, uniform_record
from qtrain.models.blocks import Block
from qtrain.precision import FLOAT32, Bits, LayerPrecision, PrecisionRecord
from qtrain.quant.layers import swap_layers
from qtrain.quant.quantizers import RangeLinear

EXECUTIONS = ("per_sample", "mix_all")
CP_SCOPES = ("blocks", "model")
SKIP_DOWNSAMPLE = ("projection", "never")
SKIP_CHARGES = ("none", "projection")


def parse_options(options: Any) -> list[tuple[int, int]]:
    """The [fw, bw] pairs of ``method.options``; a leading [0, 0] is the skip option."""
    error = ConfigError(f"method.options={options!r} is not allowed: a list of [fw, bw] pairs with bit-widths "
                        "from 1 to 32, optionally led by [0, 0] (skip the block), with at least one pair to run")
    lists = (list, ListConfig)  # a list, also where a resolver's default gives a plain one (the table experiments)
    if not isinstance(options, lists) or not all(isinstance(p, lists) and len(p) == 2 for p in options):
        raise error
    pairs = [(p[0], p[1]) for p in options]
    run = pairs[int(bool(pairs) and pairs[0] == (0, 0)):]
    if not run or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 32 for pair in run for b in pair):
        raise error
    return pairs


class DFQ(Method):
    name = "dfq"
    skips_layers = True

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        if cfg.options is None:
            raise ConfigError("method dfq needs a model with residual blocks to gate; this model config has no "
                              "dfq_options (choose a ResNet or mobilenetv2)")
        check_range_linear(cfg)
        check_bits(cfg, "weight_bits")
        if cfg.outside is not None:
            check_bits(cfg.outside, "fw", "bw", prefix="method.outside.")
        for key in ("width", "embed", "hidden"):
            value = cfg.gate[key]
            if key == "width" and value is None:
                continue  # one conv straight to the embedding (the reference's ImageNet gates)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                allowed = "an integer >= 1 or null (one conv to the embedding)" if key == "width" else "an integer >= 1"
                raise ConfigError(f"method.gate.{key}={value!r} is not allowed: it must be {allowed}")
        check_choice(cfg, "execution", EXECUTIONS)
        check_choice(cfg, "cp_scope", CP_SCOPES)
        check_choice(cfg, "skip_downsample", SKIP_DOWNSAMPLE)
        check_choice(cfg, "skip_charge", SKIP_CHARGES)
        check_positive(cfg, "beta")
        self.check_target()
        options = parse_options(cfg.options)
        self.has_skip = options[0] == (0, 0)
        self.run_options = options[int(self.has_skip):]  # (activation, gradient) bits of each option that runs
        self.num_options = len(options)
        self.model: nn.Module | None = None
        self.controller: GateController | None = None
        self.blocks: list[GatedBlock] = []
        # per block: (layer, bits at each run option) and the projection that a skip runs (or None)
        self.block_layers: list[list[tuple[str, list[Bits]]]] = []
        self.skip_layers: list[str | None] = []
        self.outside_record: PrecisionRecord = {}
        self.cost_cp: torch.Tensor | None = None  # (blocks, options): cp of each block at each option
        self.cost_units: torch.Tensor | None = None  # (blocks, options): the same cost in the loss's unit
        self.fixed_cp = 0.0
        self._record: PrecisionRecord = {}
        self._cp_sum, self._samples = 0.0, 0

    def check_target(self) -> None:
        check_positive(self.cfg, "target_cp", high=100)

    def target_cp(self) -> float:
        """The cp (percent of float32, over ``cp_scope``) the controller steers to now."""
        return float(self.cfg.target_cp)

    def _bits(self, fw: int, bw: int) -> Bits:
        """Activations at ``fw``, both gradient paths at ``bw``, weights at ``weight_bits``."""
        return Bits(self.cfg.weight_bits, fw, bw, bw)

    def prepare(self, model: nn.Module) -> nn.Module:
        cfg = self.cfg
        device = next(model.parameters()).device
        self.controller = GateController(self.num_options, cfg.gate.embed, cfg.gate.hidden).to(device)
        model.gate_controller = self.controller
        model.register_forward_pre_hook(self.controller.reset)
        names = []
        for name, block in [(n, m) for n, m in model.named_modules() if isinstance(m, Block)]:
            in_channels = next(m for m in block.modules() if isinstance(m, nn.Conv2d)).in_channels
            gated = GatedBlock(block, in_channels, self.controller, cfg.gate.width, cfg.gate.embed, self.has_skip,
                               cfg.skip_downsample == "projection", cfg.execution).to(device)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, gated)
            self.blocks.append(gated)
            names.append(name)
        if not self.blocks:
            raise ConfigError(f"method dfq needs a model with residual blocks to gate; {type(model).__name__} has none")

        def block_of(name: str) -> int | None:
            return next((i for i, b in enumerate(names) if name.startswith(f"{b}.block.")), None)

        def quantizers(name: str, layer: nn.Module) -> Any:
            if ".embed." in name or name.startswith("gate_controller."):
                return None  # the gates stay float32
            if is_depthwise(layer) and cfg.depthwise_bits is not None:
                return range_linear_quantizers(self._bits(cfg.depthwise_bits.fw, cfg.depthwise_bits.bw), cfg)
            if block_of(name) is not None:  # bits set per sample, at most the widest option's (which sizes the codes)
                return range_linear_quantizers(self._bits(*map(max, zip(*self.run_options))), cfg)
            return None if cfg.outside is None else range_linear_quantizers(self._bits(cfg.outside.fw, cfg.outside.bw), cfg)

        swapped = swap_layers(model, quantizers)
        per_option = [self._bits(fw, bw) for fw, bw in self.run_options]
        for i, gated in enumerate(self.blocks):
            layers = [n for n in swapped if block_of(n) == i]
            varying = [n for n in layers if not (is_depthwise(model.get_submodule(n)) and cfg.depthwise_bits is not None)]
            gated.set_options([model.get_submodule(n) for n in varying], self.run_options)
            self.block_layers.append([(n, per_option if n in varying else [model.get_submodule(n).quant.bits()] * len(per_option))
                                      for n in layers])
            projection = f"{names[i]}.block.{gated.block.projection_name}" if gated.skip_by_projection else None
            self.skip_layers.append(projection)
        in_blocks = {n for layers in self.block_layers for n, _ in layers}
        if cfg.execution == "per_sample":  # one running-range update a step for the reference's K (docstring)
            for name in in_blocks:
                model.get_submodule(name).quant.act.momentum = float(cfg.act_momentum) ** len(self.run_options)
        self.outside_record = uniform_record(model, [n for n in swapped if n not in in_blocks])
        self._record = dict(self.outside_record)
        self.model = model
        return model

    @contextmanager
    def _every_block_running(self):
        """Every sample at the widest run option, each block run once (also under ``mix_all``)."""
        self.controller.forced = self.num_options - 1
        executions = [b.execution for b in self.blocks]
        for b in self.blocks:
            b.execution = "per_sample"
        try:
            yield
        finally:
            self.controller.forced = None
            for b, execution in zip(self.blocks, executions):
                b.execution = execution

    def profile(self, model: nn.Module, sample: torch.Tensor) -> dict[str, int]:
        """Profile with every block running once, then tabulate each block's cost per option."""
        with self._every_block_running():
            macs = profile_macs(model, sample)
        rows, block_macs = [], []
        for layers, projection in zip(self.block_layers, self.skip_layers):
            row = [sum(macs[n] * sum(bits[k].gemm_fractions()) for n, bits in layers) for k in range(len(self.run_options))]
            charged = projection is not None and self.cfg.skip_charge == "projection"
            skip = [3.0 * macs[projection] if charged else 0.0] * self.has_skip
            rows.append(skip + row)
            block_macs.append(sum(macs[n] for n, _ in layers))
        costs = torch.tensor(rows, dtype=torch.float64)  # effective MACs per sample
        in_blocks = {n for layers in self.block_layers for n, _ in layers}
        if self.cfg.cp_scope == "blocks":
            float32, fixed = 3.0 * sum(block_macs), 0.0
        else:
            float32 = 3.0 * sum(macs.values())
            fixed = sum(m * sum(self.outside_record[n].gemm_fractions if n in self.outside_record else (1.0, 1.0, 1.0))
                        for n, m in macs.items() if n not in in_blocks)
        device = next(model.parameters()).device
        self.cost_cp = (costs * (100.0 / float32)).to(device, torch.float32)
        self.cost_units = (costs / (sum(block_macs) / len(block_macs))).to(device, torch.float32)
        self.fixed_cp = 100.0 * fixed / float32
        return macs

    def loss(self, loss: torch.Tensor, info: StepInfo) -> torch.Tensor:
        shares = torch.stack([block.gates.mean(0) for block in self.blocks])
        cp = self.fixed_cp + (shares * self.cost_cp).sum()
        cost = (shares * self.cost_units).sum() * info.samples
        # the controller's sign reads the cp of the whole micro-batch (over every process); the record is this
        # process's own samples, which the cost meter charges
        local = len(self.blocks[0].gates)
        measured_cp = distributed.mean_over_samples(cp.detach(), local, info.samples)
        measured, *flat = torch.cat([measured_cp.view(1), shares.detach().flatten()]).tolist()
        self._record = self._step_record(flat)
        self._cp_sum += measured * info.samples
        self._samples += info.samples
        beta = self.cfg.beta if measured >= self.target_cp() else -self.cfg.beta
        return loss + beta * cost

    def _step_record(self, flat_shares: list[float]) -> PrecisionRecord:
        record = dict(self.outside_record)
        k = self.num_options
        for b, (layers, projection) in enumerate(zip(self.block_layers, self.skip_layers)):
            shares = flat_shares[b * k:(b + 1) * k]
            run_shares = shares[self.has_skip:]
            for name, bits in layers:
                options = [(s, bb) for s, bb in zip(run_shares, bits) if s > 0]
                if name == projection and shares[0] > 0:
                    options.append((shares[0], FLOAT32))
                record[name] = LayerPrecision(tuple(options), RangeLinear.fmt)
        return record

    def precision(self) -> PrecisionRecord:
        return self._record

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        metrics["cp"] = self._cp_sum / self._samples if self._samples else float("nan")
        metrics["target_cp"] = self.target_cp()
        self._cp_sum, self._samples = 0.0, 0
