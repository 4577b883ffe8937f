"""DFQ: dynamic fractional quantization (FracTrain Sec. 3.2, Eq. (1)-(2); appendix F): a gate before every residual
block picks each sample's precision option, trained on ``CE + beta * cost`` with cp steered to ``target_cp``.
The cost unit, cp's scope, the options, the two executions and every departure from the paper and the reference
code (GATECH-EIC/FracTrain): docs/methods/dfq.md."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from qtrain import distributed
from qtrain.config import methods as schemas
from qtrain.config.methods import gate_options
from qtrain.cost.profile import OperandSizes, operand_sizes, profile_macs
from qtrain.errors import ConfigError
from qtrain.methods.base import Method, RunFacts, StepInfo
from qtrain.methods.gates import GateController, GatedBlock
from qtrain.methods.sbm import is_depthwise, range_linear_quantizers, uniform_record
from qtrain.models.blocks import Block
from qtrain.precision import FLOAT32, Bits, LayerPrecision, PrecisionRecord
from qtrain.quant.layers import OperandQuantizers, swap_layers
from qtrain.quant.quantizers import RangeLinear


class DFQ(Method):
    cfg: schemas.DFQ
    skips_layers = True

    def __init__(self, cfg: schemas.DFQ) -> None:
        super().__init__(cfg)
        options = gate_options(cfg.options)
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
        self._event_rows: list[dict[str, Any]] = []
        self.optimizer: torch.optim.Optimizer | None = None

    def target_cp(self) -> float:
        """The cp (percent of float32, over ``cp_scope``) the controller steers to now."""
        return float(self.cfg.target_cp)

    def _bits(self, fw: int, bw: int) -> Bits:
        """Activations at ``fw``, both gradient paths at ``bw``, weights at ``weight_bits`` (None: float32)."""
        return Bits(32 if self.cfg.weight_bits is None else self.cfg.weight_bits, fw, bw, bw)

    def _quantizers(self, fw: int, bw: int) -> OperandQuantizers:
        """SBM's quantizers at :meth:`_bits`, none for the weights where they stay float32."""
        quantizers = range_linear_quantizers(self._bits(fw, bw), self.cfg)
        if self.cfg.weight_bits is None:
            quantizers.weight = None
        return quantizers

    def _counted(self, fractions: tuple[float, float, float]) -> float:
        """What cp and the cost term count of a layer's forward, error and weight-gradient GEMM costs (``cp_gemms``)."""
        return fractions[2] if self.cfg.cp_gemms is schemas.CpGemms.WEIGHT_GRADIENT else sum(fractions)

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
                               cfg.skip_downsample is schemas.SkipDownsample.PROJECTION, cfg.execution.value).to(device)
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
            return (cfg.projection is schemas.Precision.FLOAT32 and i is not None
                    and name == f"{names[i]}.block.{self.blocks[i].block.projection_name}")

        def quantizers(name: str, layer: nn.Module) -> Any:
            if ".embed." in name or name.startswith("gate_controller.") or float32_projection(name):
                return None  # the gates stay float32, and so may the projection shortcuts
            if is_depthwise(layer) and cfg.depthwise_bits is not None:
                return self._quantizers(cfg.depthwise_bits.fw, cfg.depthwise_bits.bw)
            if block_of(name) is not None:  # bits set per sample, at most the widest option's (which sizes the codes)
                return self._quantizers(*map(max, zip(*self.run_options)))
            return None if cfg.outside is None else self._quantizers(cfg.outside.fw, cfg.outside.bw)

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
        if cfg.execution is schemas.Execution.PER_SAMPLE:  # one running-range and batch-norm update a step for the reference's K
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

    def parameter_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """With ``gate_lr``, the network's parameters and then the gates' (their embeddings and the controller), whose
        learning rate :meth:`after_backward` sets; else one group."""
        if self.cfg.gate_lr is None:
            return super().parameter_groups(model)
        gates = {id(p) for p in self.controller.parameters()} | {id(p) for b in self.blocks for p in b.embed.parameters()}
        params = list(model.parameters())
        return [{"params": [p for p in params if id(p) not in gates]}, {"params": [p for p in params if id(p) in gates]}]

    def attach(self, optimizer: torch.optim.Optimizer, facts: RunFacts) -> None:
        super().attach(optimizer, facts)
        self.optimizer = optimizer

    def after_backward(self, info: StepInfo) -> None:
        gate_lr = self.cfg.gate_lr
        if gate_lr is not None:  # set at every step from the network's, as the logs' script does: any schedule carries over
            network, gates = self.optimizer.param_groups
            gates["lr"] = network["lr"] / (gate_lr.divide_by if info.step >= gate_lr.from_step else 1)

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
                b.eval_choices = None  # a profile's forced choices are no evaluation

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
            row = [sum(macs[n] * self._counted(bits[k].gemm_fractions()) for n, bits in layers)
                   for k in range(len(self.run_options))]
            charged = projection is not None and self.cfg.skip_charge is schemas.SkipCharge.PROJECTION
            skip = [self._counted(FLOAT32.gemm_fractions()) * macs[projection] if charged else 0.0] * self.has_skip
            rows.append(skip + row)
            block_macs.append(sum(macs[n] for n, _ in layers))
        costs = torch.tensor(rows, dtype=torch.float64)  # effective MACs per sample
        block_macs = torch.tensor(block_macs, dtype=torch.float64).unsqueeze(1)
        # each block's weight in cp and the cost term: one each (the reference) or its MACs (the paper's cost)
        weights = block_macs if self.cfg.cp_weights is schemas.CpWeights.MACS else torch.ones_like(block_macs)
        relative = costs / block_macs  # a block's cost at each option in its own float32 forward MACs
        in_blocks = {n for layers in self.block_layers for n, _ in layers}
        if self.cfg.cp_scope is schemas.CpScope.BLOCKS:
            cost_cp, fixed = relative * weights * (100.0 / (3.0 * weights.sum())), 0.0
        else:
            float32 = 3.0 * sum(macs.values())
            cost_cp = costs * (100.0 / float32)
            fixed = 100.0 / float32 * sum(
                m * self._counted(self.outside_record[n].gemm_fractions if n in self.outside_record
                                  else FLOAT32.gemm_fractions())
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
        events = {"gates_probability": "train_probs", "gates_eval": "eval_choices"}
        for event, sums in zip(events, self._take_gate_counts(list(events.values()))):
            self._record_gates(epoch, metrics.get("step"), event, sums)

    def _take_gate_counts(self, counted: list[str]) -> torch.Tensor:
        """What each block's gate counted since the last epoch's end in each of its attributes ``counted``, summed
        over processes in one all-reduce (every process takes part, counted or not), as (attribute, block, option);
        the counts start again from nothing."""
        none = torch.zeros(self.num_options, dtype=torch.float64, device=next(self.controller.parameters()).device)
        counts = torch.stack([torch.stack([none if getattr(b, name) is None else getattr(b, name).double()
                                           for b in self.blocks]) for name in counted])
        for block in self.blocks:
            for name in counted:
                setattr(block, name, None)
        return distributed.sum_(counts)

    def _record_gates(self, epoch: int, step: int | None, event: str, sums: torch.Tensor) -> None:
        """precision.csv rows (``event``) per layer and option from what each block's gate counted over the epoch
        (``sums``, block by option), as shares of it: ``gates_eval``, the options the gates chose for the samples of
        the epoch's evaluation (the eval-mode choices on the test split that the reference's logs give per epoch);
        ``gates_probability``, the mean probability they gave each option over the training epoch's samples, beside
        the epoch rows' mean shares of the options they chose."""
        if not (sums.sum(1) > 0).all():
            return  # nothing counted this epoch: no evaluation (no training batch)
        record = self._step_record((sums / sums.sum(1, keepdim=True)).flatten().tolist())
        self._event_rows += [
            {"epoch": epoch + 1, "step": step, "layer": name, "event": event, "format": record[name].fmt,
             "share": share, "weight_bits": bits.weight, "act_bits": bits.act, "grad_bits": bits.grad,
             "grad_weight_bits": bits.grad_weight}
            for layers in self.block_layers for name, _ in layers for share, bits in record[name].options]

    def drain_event_rows(self) -> list[dict[str, Any]]:
        rows, self._event_rows = self._event_rows, []
        return rows
