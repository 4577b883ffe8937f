"""float32: the plain baseline, same trainer and cost accounting (32/32/32 bits) as every method, with the options
that make AdaPT's float32 baselines (AdaPT paper Tables 1-4: ``init: tnvs``, ``l1``). See docs/methods/float32.md."""

from __future__ import annotations

import torch
from torch import nn

from qtrain.config import methods as schemas
from qtrain.methods.adapt_recipe import initialize, l1_norm
from qtrain.methods.base import Method, StepInfo


class Float32(Method):
    cfg: schemas.Float32

    def __init__(self, cfg: schemas.Float32) -> None:
        super().__init__(cfg)
        self.params: list[nn.Parameter] = []

    def prepare(self, model: nn.Module) -> nn.Module:
        initialize(model, self.cfg.init.value, self.cfg.init_scale)
        self.params = list(model.parameters())
        return model

    def loss(self, loss: torch.Tensor, info: StepInfo) -> torch.Tensor:
        return loss + self.cfg.l1 * l1_norm(self.params) if self.cfg.l1 else loss
