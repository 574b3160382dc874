"""The model factory: a small causal language model, its loss from ``forward(inputs, targets)``.

The contract (docs/user-code.md): ``build(**model.kwargs)`` returns a ``torch.nn.Module``
whose ``forward(inputs, targets)`` returns the mean loss over the micro-batch as a scalar;
the engine moves, shards and averages it. The blocks are an ``nn.ModuleList``, so ZeRO stage 3
shards them one by one.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from workers.user_metrics import report


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int, dim: int, layers: int, heads: int, context: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.position = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied: counted once
        for embedding in (self.embed, self.position):  # small, so the first loss is about ln(vocab_size)
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(inputs.shape[1], device=inputs.device)
        x = self.embed(inputs) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        with torch.no_grad():  # a metric of our own, charted as "Your metrics"
            report({"accuracy": (logits.argmax(-1) == targets).float().mean()})
        return loss


def build(vocab_size: int = 64, dim: int = 64, layers: int = 2, heads: int = 4, context: int = 128) -> TinyLM:
    """``model.kwargs`` arrive here as keyword arguments; a bad value is the job's error."""
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    if dim % heads:
        raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
    return TinyLM(vocab_size, dim, layers, heads, context)
