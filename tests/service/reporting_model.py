"""A model factory whose code reports its own scalars (``workers.user_metrics.report``), for tests.

``build`` reports how many parameters it made (before the first step: it goes with step 1)
and a value that is not a number (dropped with a warning, the job goes on); every forward
reports the batch's next-token accuracy and, in training mode only, a constant. Dropout makes
training and evaluation differ, as in a real model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.user_metrics import report


class ReportingLM(torch.nn.Module):
    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = torch.nn.Embedding(vocab_size, dim)
        self.hidden = torch.nn.Linear(dim, dim)
        self.dropout = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(dim, vocab_size)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.dropout(torch.tanh(self.hidden(self.embed(inputs)))))
        loss = F.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))
        report({"accuracy": (logits.argmax(-1) == targets).float().mean()})
        if self.training:
            report(constant=0.5)
        return loss


def build(vocab_size: int = 32, dim: int = 16) -> ReportingLM:
    model = ReportingLM(vocab_size, dim)
    report({"parameters": sum(p.numel() for p in model.parameters()), "not a number": "high"})
    return model
