"""The block unit that DFQ gates (FracTrain Sec. 3.2): a residual block that may be skipped.

Models mark their blocks by subclassing :class:`Block`. ``identity`` says whether the block's input
and output have the same shape, so that skipping it (DFQ's FW-0/BW-0 option, SkipNet's skip) is the
identity; a block that changes the shape always runs.
"""

from __future__ import annotations

from torch import nn


class Block(nn.Module):
    identity: bool = False
