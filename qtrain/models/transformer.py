"""A decoder-only Transformer language model (Vaswani et al., 2017; FracTrain Sec. 4.1, appendix D), every GEMM a
module the cost profile sees and a method can quantize; its sizes by preset (:data:`qtrain.config.models.PRESETS`)
or one by one. See docs/models.md."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from qtrain.quant.layers import MatMul
from qtrain.task import LANGUAGE_MODEL


def sinusoids(length: int, d_model: int) -> torch.Tensor:
    """The fixed position encoding: sin at even, cos at odd features, wavelengths 2*pi .. 10000*2*pi."""
    position = torch.arange(length, dtype=torch.float64).unsqueeze(1)
    rate = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * rate)
    table[:, 1::2] = torch.cos(position * rate)[:, : d_model // 2]
    return table.float()


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads, self.d_head = heads, d_model // heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.scores = MatMul()
        self.mix = MatMul()
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.d_head).permute(2, 0, 3, 1, 4)
        scores = self.scores(q * self.d_head ** -0.5, k.transpose(-2, -1))  # (b, heads, t, t)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(-1)
        mixed = self.mix(weights, v)  # (b, heads, t, d_head)
        return self.out(mixed.transpose(1, 2).reshape(b, t, d))


class DecoderBlock(nn.Module):
    def __init__(self, d_model: int, heads: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.attention = CausalSelfAttention(d_model, heads)
        self.norm1 = nn.LayerNorm(d_model)
        self.ffn1 = nn.Linear(d_model, ffn)
        self.ffn2 = nn.Linear(ffn, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.dropout(self.attention(x)))
        return self.norm2(x + self.dropout(self.ffn2(F.relu(self.ffn1(x)))))


class TransformerLM(nn.Module):
    """Token ids (batch, T) to next-token scores (batch, T, vocab_size), T at most ``seq_len``."""

    task = LANGUAGE_MODEL
    options = ("layers", "d_model", "heads", "ffn", "dropout", "seq_len")

    def __init__(self, vocab_size: int, layers: int = 6, d_model: int = 512, heads: int = 8, ffn: int = 2048,
                 dropout: float = 0.1, seq_len: int = 256) -> None:
        super().__init__()
        self.d_model, self.seq_len = d_model, seq_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.register_buffer("positions", sinusoids(seq_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(DecoderBlock(d_model, heads, ffn, dropout) for _ in range(layers))
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # shared (Sec. 3.4): one parameter, in the optimizer once
        nn.init.normal_(self.embed.weight, std=d_model ** -0.5)  # unit-variance inputs once scaled by sqrt(d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"a sequence of {t} tokens is longer than the model's seq_len={self.seq_len}")
        x = self.dropout(self.embed(tokens) * self.d_model ** 0.5 + self.positions[:t])
        for block in self.blocks:
            x = block(x)
        return self.head(x)
