"""DFQ's gates and gated blocks (FracTrain Sec. 3.2, Eq. (1), Fig. 2; appendix F).

Every gated block has its own light embedding of its input (global average pool, 1x1 conv to 32
channels, ReLU, 1x1 conv to 16); one LSTM cell shared by all blocks carries its state from block to
block within a forward pass (reset at each forward) and a shared linear layer maps it to one logit
per precision option. The softmax's argmax picks each sample's option; the straight-through gate
``g = onehot + (p - p.detach())`` is exactly 1 for the chosen option in the forward pass and passes the
gradient to the probabilities.

Execution (``execution``):
- ``per_sample`` (default): samples are sorted by their option and each contiguous group runs the
  block at its own precision (batch norm sees every sample that runs the block); the skip option
  (FW-0/BW-0) passes the sample through unchanged. Block output ``g_chosen * block_chosen(x)``: the
  accuracy gradient reaches the chosen option, the cost term (in DFQ's loss) every option.
- ``mix_all``: the reference code's way, ``sum_k g_k * block_k(x)`` with every option run on every
  sample (K times the work); for fidelity checks. The cost charged is the chosen options', as in the
  reference.
A block whose input and output shapes differ cannot be skipped: its skip logit is masked out.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from qtrain.models.blocks import Block
from qtrain.quant.layers import set_groups

EMBED_WIDTH, EMBED_DIM = 32, 16


class GateController(nn.Module):
    """The LSTM cell and projection that all gates share, and the recurrent state of one forward pass."""

    def __init__(self, options: int, hidden: int = EMBED_DIM) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(EMBED_DIM, hidden)
        self.proj = nn.Linear(hidden, options)
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

    def __init__(self, block: Block, in_channels: int, controller: GateController, has_skip: bool, execution: str) -> None:
        super().__init__()
        self.block = block
        self.embed = nn.Sequential(nn.Conv2d(in_channels, EMBED_WIDTH, 1), nn.ReLU(inplace=True),
                                   nn.Conv2d(EMBED_WIDTH, EMBED_DIM, 1))
        self.shared = (controller,)  # a tuple, so the shared controller is registered once, on the model
        self.skip = has_skip  # option 0 is the skip
        self.mask_skip = has_skip and not block.identity
        self.execution = execution
        self.gates: torch.Tensor | None = None  # (N, options) straight-through gates of the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        controller = self.shared[0]
        logits = controller(self.embed(F.adaptive_avg_pool2d(x, 1)).flatten(1))
        if self.mask_skip:
            logits = torch.cat([torch.full_like(logits[:, :1], -torch.inf), logits[:, 1:]], 1)
        probs = logits.softmax(1)
        if controller.forced is None or (self.mask_skip and controller.forced == 0):
            choice = probs.argmax(1)
        else:
            choice = torch.full_like(probs[:, 0], controller.forced, dtype=torch.long)
        # exactly one-hot in the forward pass, the softmax's gradient in the backward pass
        gates = F.one_hot(choice, probs.shape[1]).to(probs.dtype) + (probs - probs.detach())
        self.gates = gates
        if self.execution == "mix_all":
            return self._mix_all(x, gates)
        return self._per_sample(x, gates, choice)

    def _run(self, x: torch.Tensor, groups: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """The block on ``x`` whose contiguous groups of samples run at the given options."""
        offset = 1 if self.skip else 0
        set_groups(self.block, tuple((option - offset, count) for option, count in groups))
        try:
            return self.block(x)
        finally:
            set_groups(self.block, None)

    def _per_sample(self, x: torch.Tensor, gates: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice, minlength=gates.shape[1]).tolist()
        skipped = counts[0] if self.skip else 0
        groups = tuple((k, n) for k, n in enumerate(counts) if n and not (self.skip and k == 0))
        ordered = x[order]
        out = ordered
        if groups:
            ran = self._run(ordered[skipped:], groups)
            out = torch.cat([ordered[:skipped], ran]) if skipped else ran
        chosen = gates.gather(1, choice[:, None])[order]
        out = out * chosen.view(-1, *([1] * (x.dim() - 1)))
        return out[torch.argsort(order)]

    def _mix_all(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        shape = (-1, *([1] * (x.dim() - 1)))
        first = 1 if self.skip else 0
        out = gates[:, 0].view(shape) * x if self.skip and not self.mask_skip else 0
        for k in range(first, gates.shape[1]):
            out = out + gates[:, k].view(shape) * self._run(x, ((k, len(x)),))
        return out
