"""Models and per-rank training runs shared by the engine tests (importable by spawned ranks)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from workers.zero import ZeroConfig, ZeroEngine

VOCAB, DIM, HID, SEQ, MICRO_B = 11, 6, 7, 5, 2


class ToyNet(nn.Module):
    """Everything a real model throws at an engine, in a few hundred parameters.

    Tied embedding/head, a frozen layer, a parameter never used, a layer only some ranks use
    (``use_extra``), a buffer, and sizes (66, 42, 7, 5, ...) that do not divide 2 or 3.
    """

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(DIM, HID)
        self.fc2 = nn.Linear(HID, DIM)
        self.extra = nn.Linear(DIM, DIM)
        self.unused = nn.Parameter(torch.randn(5))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("shift", torch.randn(DIM) * 0.1)

    def forward(self, idx, targets, use_extra: bool):
        x = self.emb(idx) + self.shift
        x = torch.tanh(self.frozen(x))
        h = self.fc2(torch.relu(self.fc1(x)))
        if use_extra:
            h = h + self.extra(x)
        logits = self.head(h)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def make_model(seed: int = 0) -> ToyNet:
    torch.manual_seed(seed)
    return ToyNet()


def make_batches(world_size: int, steps: int, micro: int, seed: int = 1):
    """``batches[step][micro]`` = (idx, targets) of the *global* micro-batch (world_size·MICRO_B rows)."""
    g = torch.Generator().manual_seed(seed)
    n = world_size * MICRO_B
    return [
        [(torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g))
         for _ in range(micro)]
        for _ in range(steps)
    ]


def uses_extra(rank: int) -> bool:
    return rank == 0  # used on some ranks only


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=2e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9, weight_decay=0.05),
}


def reference_run(world_size: int, opt: str, steps: int, micro: int, clip: float | None, seed: int = 0):
    """Single process, plain model, plain torch.optim, the same global batches."""
    model = make_model(seed)
    optimizer = OPTIMIZERS[opt]([p for p in model.parameters() if p.requires_grad])
    norms = []
    for step_batches in make_batches(world_size, steps, micro):
        for idx, tgt in step_batches:
            losses = [
                model(idx[r * MICRO_B:(r + 1) * MICRO_B], tgt[r * MICRO_B:(r + 1) * MICRO_B], uses_extra(r))
                for r in range(world_size)
            ]
            (sum(losses) / world_size).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        else:
            norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def engine_run(rank: int, world_size: int, stage: int, opt: str, steps: int, micro: int, clip: float | None,
               bucket_mb: float = 0.0002, precision: str = "fp32", seed: int = 0):
    """One rank's run; returns its full_state_dict and step() infos."""
    model = make_model(seed + rank)  # different on every rank: the engine must broadcast rank 0's
    if rank == 0:
        assert torch.equal(model.emb.weight, make_model(seed).emb.weight)
    cfg = ZeroConfig(stage=stage, precision=precision, bucket_mb=bucket_mb, grad_clip=clip)
    engine = ZeroEngine(model, OPTIMIZERS[opt], cfg)
    infos = []
    for step_batches in make_batches(world_size, steps, micro):
        for idx, tgt in step_batches:
            sl = slice(rank * MICRO_B, (rank + 1) * MICRO_B)
            engine.backward(engine(idx[sl], tgt[sl], uses_extra(rank)))
        infos.append(engine.step())
    return engine.full_state_dict(), infos


def equivalence_world(rank: int, world_size: int, cases: list[tuple]):
    """Run several (stage, opt, steps, micro, clip) cases in one spawned world."""
    return [engine_run(rank, world_size, *case) for case in cases]


def clone_sd(sd):
    return copy.deepcopy(sd)
