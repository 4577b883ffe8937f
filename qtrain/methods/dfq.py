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
reference runs a block once per run option, so its block layers update their running range and their
batch norms' running statistics K times a step (K run options, nearly the same batch each time);
``per_sample`` runs them once and weighs the old value ``act_momentum ** K`` (batch norm: ``(1 - momentum) ** K``),
the same per-step decay (``mix_all`` runs K times at the configured momenta; the one extra batch-norm update
the reference's skip path gives a downsampling block's projection is not reproduced). Under ``per_sample`` a
block runs once over the whole batch in training (a sample that skips it at its most probable run option, its
output discarded), so its batch-norm statistics and activation ranges are the whole batch's, as in the
reference, where every option runs on the whole batch. Its gradient range is one for the whole batch, each
sample rounded at its own option's bits; the reference (and ``mix_all``) quantizes each option's gradient
over the whole batch, masked to the samples that chose it, with that option's own range.

Training objective ``CE + beta * cost`` (Eq. (2)). ``cost`` is the batch's summed cost, per sample and
gated block, in the reference code's unit: per sample and block, the block's GEMM cost fractions times its
weight over the mean block's weight, so the default ``beta = 1e-3`` exerts the reference's pressure. A block's
weight (``cp_weights``) is one for every block (``blocks``, default: the reference's ResNets, whose
``conv_info`` defaults to ones in train_dfq.py and train_frac.py) or its MACs (``macs``: the paper's cost,
Sec. 3.2; the default for MobileNetV2 through its model config, whose blocks the reference's train_dfq.py
weighs by FLOPs; train_frac.py does so only when given ``--conv_info``). Its sign follows the measured cp:
+beta at or above the target, -beta below, so cp settles at the target (Algorithm 2, line 5); metrics.csv's
``cost_term`` is the epoch's mean of the signed term. The controller's ``cp`` is in percent of float32 over
``cp_scope``: ``blocks`` (the reference: the gated blocks' cost over their float32 cost, each block weighed as
above; the float32 stem, classifier and gates are not counted) or ``model`` (the whole model, weighed by MACs,
as the cost meter counts it). The cost meter always charges every layer, so ``percent_of_float32`` in the
results is the whole model's: at ``cp_scope: blocks`` it is above cp by the float32 layers outside the blocks
(summary.json ``float32_layers.share_of_cost``; ResNet-38's float32 stem is 0.5 % of its MACs but, at 16x an
8-bit MAC's price, about a fifth of DFQ's whole-model cost at cp 3 %), which the reference's tables leave out.

A sample that skips a shape-changing block runs its projection shortcut in float32 (SkipNet, and the
reference's ``ds(prev, 0, 0)``; ``skip_downsample: projection``). The reference's controller charges such a
skip nothing (``skip_charge: none``, default); ``skip_charge: projection`` makes the controller's cp and cost
term charge the float32 projection it runs (the cost meter and ``percent_of_float32`` always do).
``skip_downsample: never`` masks the skip option of those blocks out. Departures from the reference code: its
CIFAR code runs every option on every sample and mixes the block outputs (``execution: mix_all`` here, K times
the work, that code's exact gate gradient); ``per_sample`` (default) runs a block once over the batch, each
sample at one option, and gives the gates an estimate of that gradient (:mod:`qtrain.methods.gates`) in which
every run option's output is the one that ran, so among run options the gates learn from the cost term alone
(the reference's outputs differ by their quantization, a small task gradient): with an option set without a
skip (ResNet-74's Table 3 set, Table 6's, the ImageNet one) only ``mix_all`` lets the task steer the choice.
The reference's ImageNet code (``fractrain_imagenet/modules/quantize.py``) works differently from both: each
convolution mixes its input quantized at every option's bits in one GEMM, so the gates get a gradient at every
convolution; neither execution here reproduces that. Option sets: the
model configs' ``dfq_options`` are appendix F's, which it gives for Fig. 5 (ResNet-38/74: skip, 2/6, 3/6, 4/6,
4/12, 6/8, 6/12; MobileNetV2: skip, 4/8, 6/8, 6/10, 8/8); FW-0/BW-0 means a skip. The reference's released
CIFAR scripts (train_dfq.py, train_frac.py) hard-code 3/6, 4/6, 4/8, 6/8, 6/12 without a skip, and its Table 3
logs (an earlier copy of the repository, Tubbz-alt/FracTrain, fractrain_cifar/visualization/
learning_curve_dyn/learning_curve/train_logs_resnet*_cr3_w4.txt: the logged cp per GEMM fitted against the
logged option shares) show skip, 4/6, 6/8, 6/12, 8/16 for ResNet-38 and, without a skip, 3/6, 4/6, 6/8, ?,
8/16 for ResNet-74 (the fourth is never chosen in the logs; qtrain fills it with 6/12, which sits there in
ResNet-38's set). The paper-table experiments (fractrain_table3, Table 5's fractrain_adapt/fractrain_finetune)
take a model config's ``dfq_table3_options`` (ResNet-38, ResNet-74) and the released scripts' set for any
other model. (The reference's MobileNetV2 has no skip path: a 0-bit option would run the block in float32.)
For ResNet-18/34 the paper gives no options; the model configs take the reference's ImageNet ones
(``fractrain_imagenet/train_frac.py``: FW 3/4/6/8 paired with BW 6/8/12/16, no skip). That code runs the
projection shortcuts of its ImageNet ResNets in float32 (plain ``nn.Conv2d``), outside cp: so does qtrain where
``projection: float32`` (the ResNet-18/34 model configs' ``dfq_projection``), the cost meter charging them at
float32 for every sample; ``projection: quantized`` (every other model's) quantizes them at the sample's
option, as every convolution of a gated block and as the reference's CIFAR code. The reference charges MobileNetV2's depthwise
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
from qtrain.config.schema import is_integer
from qtrain.cost.profile import OperandSizes, operand_sizes, profile_macs
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
CP_WEIGHTS = ("blocks", "macs")
SKIP_DOWNSAMPLE = ("projection", "never")
SKIP_CHARGES = ("none", "projection")
PROJECTIONS = ("quantized", "float32")


def parse_options(options: Any) -> list[tuple[int, int]]:
    """The [fw, bw] pairs of ``method.options``; a leading [0, 0] is the skip option."""
    error = ConfigError(f"method.options={options!r} is not allowed: a list of [fw, bw] pairs with bit-widths "
                        "from 1 to 32, optionally led by [0, 0] (skip the block), with at least one pair to run")
    lists = (list, ListConfig)  # a list, also where a resolver's default gives a plain one (the table experiments)
    if not isinstance(options, lists) or not all(isinstance(p, lists) and len(p) == 2 for p in options):
        raise error
    pairs = [(p[0], p[1]) for p in options]
    run = pairs[int(bool(pairs) and pairs[0] == (0, 0)):]
    if not run or any(not is_integer(b) or not 1 <= b <= 32 for pair in run for b in pair):
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
            if not is_integer(value) or value < 1:
                allowed = "an integer >= 1 or null (one conv to the embedding)" if key == "width" else "an integer >= 1"
                raise ConfigError(f"method.gate.{key}={value!r} is not allowed: it must be {allowed}")
        check_choice(cfg, "execution", EXECUTIONS)
        check_choice(cfg, "cp_scope", CP_SCOPES)
        check_choice(cfg, "cp_weights", CP_WEIGHTS)
        if cfg.cp_scope == "model" and cfg.cp_weights == "blocks":
            raise ConfigError("method.cp_weights=blocks is not allowed with method.cp_scope=model: the whole model's "
                              "cp weighs every layer by its MACs (set method.cp_weights=macs)")
        check_choice(cfg, "skip_downsample", SKIP_DOWNSAMPLE)
        check_choice(cfg, "skip_charge", SKIP_CHARGES)
        check_choice(cfg, "projection", PROJECTIONS)
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
        self._cp_sum, self._term_sum, self._samples = 0.0, 0.0, 0

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

        def float32_projection(name: str) -> bool:
            i = block_of(name)
            return (cfg.projection == "float32" and i is not None
                    and name == f"{names[i]}.block.{self.blocks[i].block.projection_name}")

        def quantizers(name: str, layer: nn.Module) -> Any:
            if ".embed." in name or name.startswith("gate_controller.") or float32_projection(name):
                return None  # the gates stay float32, and so may the projection shortcuts
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
        if cfg.execution == "per_sample":  # one running-range and batch-norm update a step for the reference's K
            runs = len(self.run_options)
            for name in in_blocks:
                model.get_submodule(name).quant.act.momentum = float(cfg.act_momentum) ** runs
            for norm in (m for b in self.blocks for m in b.block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
                if norm.momentum is not None:  # torch's momentum is the weight on the new value
                    norm.momentum = 1.0 - (1.0 - norm.momentum) ** runs
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

    def operand_sizes(self, model: nn.Module, sample: torch.Tensor) -> dict[str, OperandSizes]:
        """Every block running, as in :meth:`profile`: in evaluation a block runs only the samples its gate does
        not skip, so a block the gates skip on ``sample`` would move no operand for the whole run."""
        with self._every_block_running():
            return operand_sizes(model, sample)

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
        block_macs = torch.tensor(block_macs, dtype=torch.float64).unsqueeze(1)
        # each block's weight in cp and the cost term: one each (the reference) or its MACs (the paper's cost)
        weights = block_macs if self.cfg.cp_weights == "macs" else torch.ones_like(block_macs)
        relative = costs / block_macs  # a block's cost at each option in its own float32 forward MACs
        in_blocks = {n for layers in self.block_layers for n, _ in layers}
        if self.cfg.cp_scope == "blocks":
            cost_cp, fixed = relative * weights * (100.0 / (3.0 * weights.sum())), 0.0
        else:
            float32 = 3.0 * sum(macs.values())
            cost_cp = costs * (100.0 / float32)
            fixed = 100.0 / float32 * sum(
                m * sum(self.outside_record[n].gemm_fractions if n in self.outside_record else (1.0, 1.0, 1.0))
                for n, m in macs.items() if n not in in_blocks)
        device = next(model.parameters()).device
        self.cost_cp = cost_cp.to(device, torch.float32)
        self.cost_units = (relative * weights / weights.mean()).to(device, torch.float32)
        self.fixed_cp = fixed
        return macs

    def loss(self, loss: torch.Tensor, info: StepInfo) -> torch.Tensor:
        shares = torch.stack([block.gates.mean(0) for block in self.blocks])
        cp = self.fixed_cp + (shares * self.cost_cp).sum()
        per_sample = (shares * self.cost_units).sum()  # the loss's term is beta times the batch's sum of it
        # the controller's sign reads the cp of the whole micro-batch (over every process); the record is this
        # process's own samples, which the cost meter charges
        local = len(self.blocks[0].gates)
        measured = distributed.mean_over_samples(torch.stack([cp, per_sample]).detach(), local, info.samples)
        measured_cp, measured_cost, *flat = torch.cat([measured, shares.detach().flatten()]).tolist()
        self._record = self._step_record(flat)
        beta = self.cfg.beta if measured_cp >= self.target_cp() else -self.cfg.beta
        self._cp_sum += measured_cp * info.samples
        self._term_sum += beta * measured_cost * info.samples * info.samples  # the batch's term, weighted as its loss
        self._samples += info.samples
        return loss + beta * per_sample * info.samples

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
        metrics["cost_term"] = self._term_sum / self._samples if self._samples else float("nan")
        self._cp_sum, self._term_sum, self._samples = 0.0, 0.0, 0
