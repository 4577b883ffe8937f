"""DFQ's gates and gated blocks (FracTrain Sec. 3.2, Eq. (1), Fig. 2; appendix F).

Every gated block has its own light embedding of its input (global average pool, 1x1 conv to
``width`` channels, ReLU, 1x1 conv to ``embed``; with ``width`` null, one 1x1 conv straight to ``embed``);
one LSTM cell shared by all blocks carries its state from block to block within a forward pass (reset at
each forward) and a shared linear layer maps it to one logit per precision option. The widths follow the
reference code (GATECH-EIC/FracTrain, the model config's ``dfq_gate``): 32/16 with a 16-unit cell for the
CIFAR ResNets and 64/32 with a 32-unit cell for MobileNetV2 (``fractrain_cifar/models.py``), one conv to 40
with a 20-unit cell for ResNet-18/34 on ImageNet (``fractrain_imagenet/models.py``, ``ResNet_RNN``); and so
does the initialization of the embedding convolutions and the projection (normal, standard
deviation ``sqrt(2 / n)`` with ``n`` = kernel area x output channels, or inputs x outputs).
The softmax's argmax picks each sample's option; the straight-through gate
``g = onehot + (p - p.detach())`` is exactly 1 for the chosen option in the forward pass and passes
the gradient to the probabilities.

Execution (``execution``):
- ``per_sample`` (default): in training the block runs once over the whole batch, each sample that runs
  it at its option and each sample that skips it at its most probable run option: every quantized
  layer of the block shares its weight, GEMM and quantization range over the batch and rounds each
  sample's activation and gradient at that sample's option (:func:`~qtrain.quant.layers.set_sample_bits`).
  Batch norm's batch statistics and the activation ranges are thus the whole batch's, as in the
  reference, where every option runs on the whole batch (their running averages are updated once a
  step, with the momenta DFQ sets to the reference's K updates' decay).
  A sample's output is its option's (the block's output, or the skip's); the block's weights get task
  gradient only from the samples that run it (a skipping sample's block output enters detached, as the
  reference's gate, 0 in the forward pass, masks it), though batch statistics couple the rows as in any
  batch norm. The simulation runs the block, forward and backward, for every sample: about the
  reference's work for one option, not K. In evaluation (hard gates, running statistics and ranges,
  each sample alone) only the samples that run the block run it. The gates learn from an estimate of
  the reference's gradient, below. The cost charged is the chosen options' either way.
- ``mix_all``: the reference code's way (GATECH-EIC/FracTrain, fractrain_cifar/models.py,
  ``ResNetRecurrentGateSP.forward``), ``y = sum_k g_k * o_k`` with every option's output ``o_k`` run
  on every sample (K times the work): the reference's exact gradient. The cost charged is the chosen
  options', as in the reference.

The gates' task gradient. With ``A_k = <dL/dy, o_k>`` (per sample), the reference's mixture gives the
probabilities ``dL/dp_k = A_k`` and the logits ``dL/dz_j = p_j (A_j - sum_k p_k A_k)``: what is common
to all options' ``A`` cancels, and a logit moves by how much its option's output would lower the loss
against the average. Returning ``g_c * o_c`` for the chosen option ``c`` alone would give ``dL/dz_j =
A_c p_j (delta_cj - p_c)``: no cancellation, so an option with a larger output (a run option's
``relu(x + F(x))`` against a skip's ``x``) is pushed by its whole ``A``, about a hundred times the
cost term's gradient at the default ``beta``, and the gates drift toward skipping. ``per_sample``
therefore returns, with ``r = sum_{k runs} g_k``, ``y = r * o_c + g_skip * skip(x)`` for a sample that
runs option ``c`` and ``y = g_skip * skip(x) + r * o_run`` for a sample that skips: the forward output
is ``o_c`` or ``skip(x)`` as before (``r`` and ``g_skip`` are exactly 1 and 0, or 0 and 1), and the
path not taken enters detached. ``skip(x)`` is the shortcut (``x`` itself, or the float32 projection
over the whole batch's statistics); ``o_run``, for a skipped sample, is its row of the block's one pass
over the whole batch, at its most probable run option. Every run option's ``A`` is taken as the one run
output's, so the skip logit moves by ``p_skip (1 - p_skip) <dL/dy, skip(x) - o_run>`` on both sides, as
in the reference; this is the reference's gradient exactly where all run options produce the same
output (batch statistics included: both run the block over the whole batch), and otherwise differs by
the run options' output differences. Both sides are needed:
a loss's linearization at either end of the segment from ``skip(x)`` to ``o_run`` usually says to move
toward the other end, so the running samples alone would drive the gates to skip (measured on a
ResNet-20 CIFAR-10 miniature, 1,536 images, cp target 3, when ``per_sample`` still ran the block over the
samples that take it alone: epochs 2-4 at cp 0.7-0.8 with the running samples' side alone, 2.2-2.5 with
both; 2.7-2.9 under ``mix_all``, epochs 2-3). Without a skip option the task
gives the gates no gradient here: the cost term (in DFQ's loss) alone moves them, and it reaches every
option through the probabilities. The reference's run options' outputs differ by their quantization, so
its ``A`` differ a little and the task steers the choice among them a little; ``mix_all`` keeps that.

The skip option (FW-0/BW-0) passes a sample through unchanged where the block keeps the shape. A
block that changes the shape skips through its projection shortcut in float32, as SkipNet and the
reference code do (``skip_projection``), or, where it has none or that is turned off, cannot be
skipped: its skip logit is masked out. In training, under either execution, that projection runs over
the whole batch at every step, whether or not a sample skips, and updates its batch norm's running
statistics, as the reference's skip path does (the block's own pass, whose shortcut it is, updates them too).
"""

from __future__ import annotations

from collections.abc import Sequence

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
        # exactly one-hot in the forward pass, the softmax's gradient in the backward pass
        gates = F.one_hot(choice, probs.shape[1]).to(probs.dtype) + (probs - probs.detach())
        self.gates = gates
        if self.execution == "mix_all":
            return self._mix_all(x, gates)
        return self._per_sample(x, gates, choice, probs.detach())

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
        run_gates = gates[:, first:].sum(1).view(shape)
        if not self.skip or self.mask_skip:  # every sample runs: every option gets the chosen output's A
            return out * run_gates if gates.requires_grad else out
        skip = self._skipped(x)
        rows = running.view(shape)
        if not gates.requires_grad:
            return torch.where(rows, out, skip)
        # forward: exactly out or skip(x); backward: the taken path's gates get its output's A, the other path's the
        # other's (module docstring), and the block's weights learn from the samples that run it
        return (torch.where(rows, out, out.detach()) * run_gates
                + torch.where(rows, skip.detach(), skip) * gates[:, :1].view(shape))

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
