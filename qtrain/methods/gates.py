"""DFQ's gates and gated blocks (FracTrain Sec. 3.2, Eq. (1), Fig. 2; appendix F): a light embedding per block, one
shared LSTM cell and linear layer, each sample's option by a straight-through argmax, and the two executions
(``per_sample``, ``mix_all``). The gradient estimate, the widths and every departure: docs/methods/dfq.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from qtrain.models.blocks import Block
from qtrain.quant.layers import set_sample_bits


def reference_init(layer: nn.Conv2d | nn.Linear) -> None:
    """The reference code's weight initialization of its gate layers (biases keep torch's default)."""
    n = layer.kernel_size[0] * layer.kernel_size[1] * layer.out_channels if isinstance(layer, nn.Conv2d) else \
        layer.in_features * layer.out_features
    nn.init.normal_(layer.weight, 0.0, (2.0 / n) ** 0.5)


class GateController(nn.Module):
    """The LSTM cell and projection that all gates share, and the recurrent state of one forward pass."""

    def __init__(self, options: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(embed, hidden)
        self.proj = nn.Linear(hidden, options)
        reference_init(self.proj)
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None
        self.forced: int | None = None  # every sample takes this option where its block allows (cost profiling)

    def reset(self, *_: object) -> None:
        """Start a new forward pass (used as the model's forward pre-hook)."""
        self.state = None

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        self.state = self.cell(embedding, self.state)
        return self.proj(self.state[0])


class _GatedMerge(torch.autograd.Function):
    """``out * run_gates + skip * skip_gates``, each sample's block output where it runs (``rows``) and its skip
    path where not; the taken path's gates get its output's A, the other path's the other's, and ``out`` (``skip``)
    its gradient only where taken (docs/methods/dfq.md, "The gates' task gradient").

    The gradients of ``where(rows, out, out.detach()) * run_gates + where(rows, skip.detach(), skip) * skip_gates``
    bit for bit where ``out`` and ``skip`` have one shape (a block's output and its shortcut), without the two
    whole-tensor ``where`` copies autograd would keep for backward: it keeps ``out``, which the block's last ReLU
    keeps anyway, and ``skip``, or, where ``skip`` is an earlier gated block's output (``merged_from``, an identity
    shortcut), what it was merged from, rebuilt in backward: the merged tensor itself is then kept by no one, as a
    plain network keeps no block output beside its ReLU's. The rebuilt values are the merged tensor's only while no
    one changes a block's output in place between blocks (no model here does).
    """

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, skip: torch.Tensor, rows: torch.Tensor, run_gates: torch.Tensor,
                skip_gates: torch.Tensor, skip_source: Merged | None) -> torch.Tensor:
        ctx.skip_source = skip_source
        ctx.save_for_backward(out, skip if skip_source is None else None, rows, run_gates, skip_gates)
        return out * run_gates + skip * skip_gates

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out, skip, rows, run_gates, skip_gates = ctx.saved_tensors
        if ctx.skip_source is not None:
            # released here, as saved tensors are: the graph outlives the backward (the gates hold it to the next step)
            skip, ctx.skip_source = rebuilt(ctx.skip_source), None
        grad_out = torch.where(rows, grad * run_gates, 0.0) if ctx.needs_input_grad[0] else None
        grad_skip = torch.where(rows, 0.0, grad * skip_gates) if ctx.needs_input_grad[1] else None
        grad_run = (grad * out).sum_to_size(run_gates.shape) if ctx.needs_input_grad[3] else None
        grad_skip_gates = (grad * skip).sum_to_size(skip_gates.shape) if ctx.needs_input_grad[4] else None
        return grad_out, grad_skip, None, grad_run, grad_skip_gates, None


# A gated block's training output as what it was merged from: (its block's output, the rows that ran the block, and
# the skip path: a tensor, or an earlier block's Merged where the skip is its output); rows None: every row ran.
Merged = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | Merged | None"]


def rebuilt(merged: Merged) -> torch.Tensor:
    """The values of a gated block's output from what it was merged from (the forward's hard gates are 1 and 0)."""
    out, rows, skip = merged
    if rows is None:
        return out
    return torch.where(rows, out, skip if isinstance(skip, torch.Tensor) else rebuilt(skip))


class GatedBlock(nn.Module):
    """A :class:`Block` behind its gate; option 0 is the skip when ``has_skip``, the rest run ``block``."""

    def __init__(self, block: Block, in_channels: int, controller: GateController, width: int | None, embed: int,
                 has_skip: bool, skip_projection: bool, execution: str) -> None:
        super().__init__()
        self.block = block
        if width is None:
            self.embed = nn.Sequential(nn.Conv2d(in_channels, embed, 1))
        else:
            self.embed = nn.Sequential(nn.Conv2d(in_channels, width, 1), nn.ReLU(inplace=True), nn.Conv2d(width, embed, 1))
        for layer in self.embed:
            if isinstance(layer, nn.Conv2d):
                reference_init(layer)
        self.shared = (controller,)  # a tuple, so the shared controller is registered once, on the model
        self.skip = has_skip  # option 0 is the skip
        # how a skipped sample passes: unchanged, through the float32 projection shortcut, or not at all
        self.skip_by_projection = has_skip and not block.identity and skip_projection and block.projection_name is not None
        self.mask_skip = has_skip and not block.identity and not self.skip_by_projection
        self.execution = execution
        self.gates: torch.Tensor | None = None  # (N, options) straight-through gates of the last forward
        self.probs: torch.Tensor | None = None  # (N, options) the probabilities they were chosen from, detached
        self.eval_choices: torch.Tensor | None = None  # (options,) samples that took each option in evaluation
        self.train_probs: torch.Tensor | None = None  # (options,) the training samples' probabilities, summed
        self.option_layers: list[nn.Module] = []  # the layers whose bits follow the option
        self.option_bits: torch.Tensor | None = None  # (run options, 2): activation and gradient bits

    def set_options(self, layers: Sequence[nn.Module], bits: Sequence[tuple[int, int]]) -> None:
        """The quantized layers that run at each sample's option, and each run option's (activation, gradient) bits."""
        self.option_layers = list(layers)
        self.option_bits = torch.tensor(bits, dtype=torch.float32, device=next(self.embed.parameters()).device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        controller = self.shared[0]
        logits = controller(self.embed(F.adaptive_avg_pool2d(x, 1)).flatten(1))
        if self.mask_skip:
            logits = torch.cat([torch.full_like(logits[:, :1], -torch.inf), logits[:, 1:]], 1)
        probs = logits.softmax(1)
        choice = self.choose(probs)
        self.probs = probs.detach()
        if self.training:  # how sure the gates are of their training choices, summed to the epoch's record
            summed = self.probs.sum(0, dtype=torch.float64)
            self.train_probs = summed if self.train_probs is None else self.train_probs + summed
        else:  # what the gates choose in evaluation, as the reference's logs record them
            counts = torch.bincount(choice, minlength=probs.shape[1])
            self.eval_choices = counts if self.eval_choices is None else self.eval_choices + counts
        # exactly one-hot in the forward pass, the softmax's gradient in the backward pass
        gates = F.one_hot(choice, probs.shape[1]).to(probs.dtype) + (probs - self.probs)
        self.gates = gates
        if self.execution == "mix_all":
            return self._mix_all(x, gates)
        return self._per_sample(x, gates, choice, self.probs)

    def choose(self, probs: torch.Tensor) -> torch.Tensor:
        """Each sample's option: the most probable, or the controller's forced one where the block allows it."""
        forced = self.shared[0].forced
        if forced is None or (self.mask_skip and forced == 0):
            return probs.argmax(1)
        return torch.full_like(probs[:, 0], forced, dtype=torch.long)

    def _run(self, x: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
        """The block on ``x``, each sample at its run option (0-based, the skip not counted)."""
        bits = self.option_bits[options]
        set_sample_bits(self.option_layers, (bits[:, 0], bits[:, 1]))
        try:
            return self.block(x)
        finally:
            set_sample_bits(self.option_layers, None)

    def _skipped(self, x: torch.Tensor) -> torch.Tensor:
        return self.block.projection(x) if self.skip_by_projection else x

    def _per_sample(self, x: torch.Tensor, gates: torch.Tensor, choice: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        shape = (-1, *([1] * (x.dim() - 1)))
        first = int(self.skip)
        running = choice >= first
        if not (self.training or gates.requires_grad):
            return self._evaluate(x, choice - first, running)
        # the whole batch runs the block once, a skipping sample at its most probable run option: batch statistics
        # and activation ranges are the whole batch's, as in the reference
        out = self._run(x, torch.where(running, choice - first, probs[:, first:].argmax(1)))
        may_skip = self.skip and not self.mask_skip
        if not gates.requires_grad:
            return torch.where(running.view(shape), out, self._skipped(x)) if may_skip else out
        run_gates = gates[:, first:].sum(1).view(shape)
        if not may_skip:  # every sample runs: every option gets the chosen output's A
            merged, source = out * run_gates, (out, None, None)
        else:
            skip = self._skipped(x)
            rows = running.view(shape)
            earlier = getattr(x, "merged_from", None) if skip is x else None
            merged = _GatedMerge.apply(out, skip, rows, run_gates, gates[:, :1].view(shape), earlier)
            source = (out, rows, skip if earlier is None else earlier)
        merged.merged_from = source  # for the next block's merge, which would otherwise keep this tensor
        return merged

    def _evaluate(self, x: torch.Tensor, options: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        """Hard gates without the gates' gradient, in evaluation: running statistics and ranges treat every
        sample alone, so only the samples that run the block run it."""
        if running.all():
            return self._run(x, options)
        skipped = self._skipped(x[~running])
        if not running.any():
            return skipped
        ran = self._run(x[running], options[running])
        out = ran.new_empty((len(x), *ran.shape[1:]))
        out[running], out[~running] = ran, skipped
        return out

    def _mix_all(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        shape = (-1, *([1] * (x.dim() - 1)))
        first = int(self.skip)
        out = gates[:, 0].view(shape) * self._skipped(x) if self.skip and not self.mask_skip else 0
        for k in range(first, gates.shape[1]):
            options = torch.full((len(x),), k - first, dtype=torch.long, device=x.device)
            out = out + gates[:, k].view(shape) * self._run(x, options)
        return out
