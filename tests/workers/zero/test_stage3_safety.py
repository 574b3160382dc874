"""Issue 15, "stage 3 never silent": stage 3 either trains exactly like one process or says why.

(a) Ranks that run different units at the same point (rank 0 ``linears[0]``, rank 1
    ``linears[1]``: same size, so the all-gathers "succeed" with mixed data) raise on every rank,
    within the first step, an error naming the unit each rank wanted; with every rank on the same
    branch the same model trains like single-process PyTorch.
(b) Parameters used outside their unit -- a module that returns its own bias for the caller to
    add, and ``F.linear(x, blocks[0].fc.weight)`` in the root's forward -- train like
    single-process PyTorch (fp32, rtol 1e-5) under the stage-3 knobs, never reading freed storage.

Two spawned worlds of 2 ranks; every model and rank function lives here (a spawned rank loads
this file by path).
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.testing import spawn_world

N = 2
VOCAB, DIM, SEQ, ROWS = 9, 6, 4, 2  # ROWS per rank and micro-batch
STEPS, MICRO = 3, 2


def _opt(params):
    return torch.optim.AdamW(params, lr=2e-2, weight_decay=0.1)


class Branchy(nn.Module):
    """Two same-size units; ``branch`` picks which one runs (the defect: it differs per rank)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.linears = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx, tgt, branch: int):
        x = torch.tanh(self.linears[branch](self.emb(idx)))
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), tgt.reshape(-1))


class BiasOut(nn.Module):
    """Returns its bias instead of adding it (Megatron's ``skip_bias_add``): the caller adds it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) * 0.4)
        self.bias = nn.Parameter(torch.randn(DIM) * 0.3)

    def forward(self, x):
        return x @ self.weight.t(), self.bias


class DanglingBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([BiasOut(), BiasOut(), BiasOut()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for block in self.blocks:
            y, bias = block(x)
            x = torch.tanh(y + bias)
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), tgt.reshape(-1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class OutsideUse(nn.Module):
    """The root's forward reads block 0's weight after block 0 (and block 1) ran."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        x = x + F.linear(x, self.blocks[0].fc.weight)
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), tgt.reshape(-1))


MODELS = {"branchy": Branchy, "dangling_bias": DanglingBias, "outside_use": OutsideUse}


def make(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


def batches():
    g = torch.Generator().manual_seed(7)
    return [[(torch.randint(0, VOCAB, (N * ROWS, SEQ), generator=g), torch.randint(0, VOCAB, (N * ROWS, SEQ), generator=g))
             for _ in range(MICRO)] for _ in range(STEPS)]


def call(model, kind: str, idx, tgt, branch: int):
    return model(idx, tgt, branch) if kind == "branchy" else model(idx, tgt)


def reference(kind: str, branch_of) -> dict:
    """One process, plain AdamW, every rank's rows; ``branch_of(rank, step)``."""
    model = make(kind)
    opt = _opt(list(model.parameters()))
    for step, step_batches in enumerate(batches()):
        for idx, tgt in step_batches:
            losses = [call(model, kind, idx[r * ROWS:(r + 1) * ROWS], tgt[r * ROWS:(r + 1) * ROWS], branch_of(r, step))
                      for r in range(N)]
            (sum(losses) / N).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(rank: int, kind: str, cfg: dict, branch_of, evaluate: bool = False):
    engine = ZeroEngine(make(kind, seed=rank), _opt, ZeroConfig(stage=3, precision="fp32", **cfg))
    sl = slice(rank * ROWS, (rank + 1) * ROWS)
    for step, step_batches in enumerate(batches()):
        for idx, tgt in step_batches:
            engine.backward(call(engine, kind, idx[sl], tgt[sl], branch_of(rank, step)))
        engine.step()
        if evaluate:  # a forward without grad between steps gathers (and frees) what it reads too
            engine.eval()
            with torch.no_grad():
                call(engine, kind, idx[sl], tgt[sl], branch_of(rank, step))
            engine.train()
    leftover = engine.memory()["buffers"] - sum(b.numel() * b.element_size() for b in engine.module.buffers())
    return engine.full_state_dict(), leftover


def divergent(rank: int, step: int) -> int:
    return rank  # rank 0 runs linears[0], rank 1 linears[1]


def same_branch(rank: int, step: int) -> int:
    return step % 2  # every rank on the same branch, which changes between steps


def branches_world(rank: int, world_size: int):
    torch.set_num_threads(1)
    out = {}
    for prefetch in (1, 0):
        try:
            train(rank, "branchy", {"prefetch": prefetch}, divergent)
            out[prefetch] = None
        except RuntimeError as exc:
            out[prefetch] = str(exc)
    out["same"] = train(rank, "branchy", {}, same_branch)
    return out


OUTSIDE_CASES = [
    ("dangling_bias", {}, True),
    ("dangling_bias", {"reshard_after_forward": False}, False),
    ("dangling_bias", {"prefetch": 2, "activation_checkpointing": True}, False),
    ("outside_use", {}, True),
    ("outside_use", {"reshard_after_forward": False, "prefetch": 0}, False),
    ("outside_use", {"prefetch": 2, "activation_checkpointing": True}, False),
]


def outside_world(rank: int, world_size: int):
    torch.set_num_threads(1)
    return [train(rank, kind, cfg, same_branch, evaluate) for kind, cfg, evaluate in OUTSIDE_CASES]


def test_divergent_branches_raise_on_every_rank_naming_both_units():
    results = spawn_world(branches_world, N, timeout_s=60)
    for prefetch in (1, 0):
        messages = [r[prefetch] for r in results]
        for rank, msg in enumerate(messages):
            assert msg is not None, f"prefetch={prefetch}: rank {rank} trained on mixed parameters silently"
            assert "ranks gathered different units" in msg, msg
            assert "of step 1" in msg, msg  # caught in the first step, before any update
            assert "rank 0 wanted linears.0" in msg and "rank 1 wanted linears.1" in msg, msg
            assert "docs/engine.md" in msg, msg
        gather_no = {re.search(r"gather #(\d+)", m).group(1) for m in messages}
        assert len(gather_no) == 1, messages  # every rank stopped at the same gather
    ref = reference("branchy", same_branch)
    for rank, r in enumerate(results):
        full, leftover = r["same"]
        assert leftover == 0
        for k, v in ref.items():
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {k}: {m}")


def test_parameters_used_outside_their_unit_train_like_one_process():
    results = spawn_world(outside_world, N, timeout_s=60)
    refs = {kind: reference(kind, same_branch) for kind in ("dangling_bias", "outside_use")}
    for i, (kind, cfg, _) in enumerate(OUTSIDE_CASES):
        what = f"{kind} {cfg}"
        for rank, per_case in enumerate(results):
            full, leftover = per_case[i]
            assert leftover == 0, what  # nothing stays gathered after a step
            assert set(full) == set(refs[kind]), what
            for k, v in refs[kind].items():
                torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{what} rank {rank} {k}: {m}")


def test_tags_name_what_differs():
    """The tag comparison on its own (no world): it sees a reduce-scatter order that differs even
    when count and last unit agree (the digest), and ranks that gathered different numbers of units."""
    from workers.zero.divergence import Ledger as _Ledger

    names = ["blocks.0", "blocks.1", "blocks.2"]
    a, b = _Ledger(names, torch.device("cpu")), _Ledger(names, torch.device("cpu"))
    for unit in (0, 1, 2):
        a.reduce_scattered(unit)
    for unit in (1, 0, 2):
        b.reduce_scattered(unit)
    same = a._compare([a.tag(-1).tolist(), a.tag(-1).tolist()])
    assert same is None
    msg = a._compare([a.tag(-1).tolist(), b.tag(-1).tolist()])
    assert msg.startswith("stage 3: ranks reduce-scattered different units"), msg
    assert "rank 0 3, the last blocks.2" in msg and "rank 1 3, the last blocks.2" in msg, msg
    a.next_gather(0)
    msg = a._compare([a.tag(-1).tolist(), b.tag(-1).tolist()])
    assert "different numbers of units: rank 0 at gather #1 of step 1" in msg, msg
    assert "rank 1 at gather #0 of step 1" in msg, msg
