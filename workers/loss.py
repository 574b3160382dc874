"""The training loss of a built-in or Hugging Face model: next-token cross-entropy, weighted by tokens.

A model that is not a user factory (``model.factory`` is None: the GPT presets, whose forward
returns logits, and Hugging Face causal LMs, whose output has ``.logits``) is called with the
inputs alone, and the loop computes the loss here from ``(logits, targets)``: targets equal to
``IGNORE_INDEX`` (prompt and padding of an SFT row) are not trained on. Hugging Face's own
``labels`` argument is not used: our targets are already shifted (``targets[t] = ids[t + 1]``).

[Note: a step's loss is the mean over every unmasked token of the global batch]
Ranks and micro-batches hold different numbers of unmasked targets (SFT rows differ in
length), so the mean of per-rank (or per-micro-batch) means would weight a token of a short
batch more than one of a long batch, and depend on how the batch is split. The loss of a step
is instead ``Σ token losses / N`` with ``N`` the unmasked targets of the whole global batch:

- before its micro-steps a rank counts its unmasked targets and one ``all_reduce`` sums them
  (every rank issues it at the same point, so the collective order is the same on every rank,
  stage 3 included);
- each micro-step back-propagates ``sum_loss · W / N``: the engine averages gradients over the
  ``W`` ranks of the world (pre-divided by ``W``, also with ``shard_group_size``, docs/engine.md),
  and summed over micro-steps and averaged over ranks that is exactly ``∇ (Σ token losses / N)``,
  one process's gradient of the global token mean.

The recorded loss of a rank is its share ``Σ_rank token losses · W / N``: the mean over ranks
(how the control plane combines a step's ``loss``, ``contract.metrics``) is the global token
mean, with no extra collective. With no masked targets and equal ranks every share is that
rank's own token mean.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100  # a target not trained on: PyTorch's and Hugging Face's convention


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's forward: the tensor a GPT preset returns, or ``output.logits``."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None:
        raise TypeError(f"the model's forward returned {type(output).__name__}, neither logits nor an output "
                        "with .logits")
    return logits


def token_loss_sum(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Σ next-token cross-entropy (fp32) over the targets that are not ``IGNORE_INDEX``."""
    logits = logits_of(output)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def count_targets(targets: torch.Tensor) -> int:
    """How many of ``targets`` are trained on."""
    return int((targets != IGNORE_INDEX).sum())


def global_token_count(micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, world_size: int,
                       device: torch.device) -> int:
    """Unmasked targets of the whole global batch: this rank's micro-batches, summed over ranks."""
    count = torch.tensor(sum(count_targets(targets) for _, targets in micro_batches), dtype=torch.float64,
                         device=device)
    if world_size > 1:
        dist.all_reduce(count)
    return int(count.item())


class StepLoss:
    """One step's loss over this rank's ``micro_batches`` of the global batch.

    ``token_weighted`` (every model but a user factory): the loop's next-token cross-entropy,
    weighted by the unmasked targets of the whole global batch (the Note above; the one
    ``all_reduce`` is issued here, before the first forward). Otherwise the factory model's own
    mean loss per micro-batch (``forward(inputs, targets)``, the factory contract), averaged
    over the micro-batches.
    """

    def __init__(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, token_weighted: bool,
                 world_size: int, device: torch.device):
        self.accumulation = len(micro_batches)
        self.token_weighted = token_weighted
        if token_weighted:
            # a global batch with every target masked trains on nothing: zero loss, zero gradient
            tokens = global_token_count(micro_batches, world_size=world_size, device=device)
            self.scale = world_size / max(1, tokens)
        else:
            self.scale = 1.0 / self.accumulation
        self.total = torch.zeros((), dtype=torch.float64, device=device)  # read once, after the step

    def micro_loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """What to back-propagate for one micro-batch (the engine sums micro-steps)."""
        loss = (token_loss_sum(output, targets) if self.token_weighted else output) * self.scale
        self.total += loss.detach().double()
        return loss

    def value(self) -> float:
        """The recorded loss: this rank's token-weighted share (the Note above), or its mean loss."""
        return float(self.total)
