"""Models and per-rank training runs shared by the engine tests (importable by spawned ranks)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.testing import byte_stream_batch

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
    return reference_train(make_model(seed), lambda model, idx, tgt, rank, step: model(idx, tgt, uses_extra(rank)),
                           world_size, opt, steps, micro, clip)


def reference_train(model: nn.Module, forward, world_size: int, opt: str, steps: int, micro: int,
                    clip: float | None):
    """What data parallelism must equal: one process, plain torch.optim, every rank's rows at once.

    ``forward(model, idx, tgt, rank, step)`` is rank ``rank``'s loss on its rows; the loss
    backpropagated is their mean over ranks. Returns the final state dict and each step's global
    gradient norm (before clipping). Shared with the stage-3 models (``cases3.reference``), whose
    forward also depends on the step.
    """
    optimizer = OPTIMIZERS[opt]([p for p in model.parameters() if p.requires_grad])
    norms = []
    for step, step_batches in enumerate(make_batches(world_size, steps, micro)):
        for idx, tgt in step_batches:
            losses = [forward(model, idx[r * MICRO_B:(r + 1) * MICRO_B], tgt[r * MICRO_B:(r + 1) * MICRO_B], r, step)
                      for r in range(world_size)]
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
               mode: str = "plain", bucket_mb: float = 0.0002, precision: str = "fp32", seed: int = 0):
    """One rank's run; returns its full_state_dict and step() infos.

    mode: "plain" = engine.backward(loss); "sync" = sync=True on the last micro-batch;
    "direct" = the user calls loss.backward() themselves; "no_overlap" = overlap_comm=False.
    """
    model = make_model(seed + rank)  # different on every rank: the engine must broadcast rank 0's
    if rank == 0:
        assert torch.equal(model.emb.weight, make_model(seed).emb.weight)
    cfg = ZeroConfig(stage=stage, precision=precision, bucket_mb=bucket_mb, grad_clip=clip,
                     overlap_comm=mode != "no_overlap")
    engine = ZeroEngine(model, OPTIMIZERS[opt], cfg)
    infos = []
    for step_batches in make_batches(world_size, steps, micro):
        for m, (idx, tgt) in enumerate(step_batches):
            sl = slice(rank * MICRO_B, (rank + 1) * MICRO_B)
            loss = engine(idx[sl], tgt[sl], uses_extra(rank))
            if mode == "direct":
                loss.backward()
            else:
                engine.backward(loss, sync=mode == "sync" and m == micro - 1)
        infos.append(engine.step())
    full = engine.full_state_dict()
    engine.close()  # how a run ends (docs/engine.md, "Ending a run")
    return full, infos


def equivalence_world(rank: int, world_size: int, cases: list[tuple]):
    """Run several (stage, opt, steps, micro, clip) cases in one spawned world."""
    return [engine_run(rank, world_size, *case) for case in cases]


def clone_sd(sd):
    return copy.deepcopy(sd)


# -- a small GPT for the precision, accounting and checkpoint tests -----------------------------------

GPT_SEQ, GPT_MICRO_B = 32, 4


def make_gpt(seed: int = 0, n_layer: int | None = None):
    from dataclasses import replace

    from workers.models import GPT, PRESETS

    torch.manual_seed(seed)
    cfg = replace(PRESETS["gpt-nano"], block_size=GPT_SEQ)
    if n_layer is not None:
        cfg = replace(cfg, n_layer=n_layer)
    return GPT(cfg)


def gpt_batch(step: int, micro: int, rank: int):
    """The example's learnable byte stream (``examples/engine_torchrun.py``), at the tests' sizes."""
    return byte_stream_batch(step, micro, rank, GPT_MICRO_B, GPT_SEQ)


def gpt_engine(rank: int, precision: str, stage: int, seed: int = 0, n_layer: int | None = None, **cfg):
    model = make_gpt(seed + rank, n_layer)
    config = ZeroConfig(stage=stage, precision=precision, **{"grad_clip": 1.0, **cfg})
    return ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1), config)


def gpt_steps(engine, rank: int, start: int, stop: int, accum: int = 1, overflow: dict | None = None,
              after_backward=None):
    """Train steps [start, stop); ``overflow[step]`` = ranks whose loss is blown up to inf in fp16;
    ``after_backward(step, micro)`` is called after each micro-step's backward."""
    losses, infos = [], []
    for step in range(start, stop):
        total = 0.0
        for micro in range(accum):
            x, y = gpt_batch(step, micro, rank)
            loss = engine(x, y)
            total += loss.item() / accum
            if overflow and rank in overflow.get(step, ()):
                loss = loss * 1e30  # × loss scale -> inf in the fp16 gradients
            engine.backward(loss / accum)
            if after_backward is not None:
                after_backward(step, micro)
        losses.append(total)
        infos.append(engine.step())
    return losses, infos


def precision_world(rank: int, world_size: int, steps: int, stage: int, overflow: dict):
    out = {}
    for precision in ("fp32", "bf16", "fp16"):  # gpt-nano widths, 2 layers: fp16 matmuls are slow on CPU
        engine = gpt_engine(rank, precision, stage, n_layer=2)
        out[precision] = gpt_steps(engine, rank, 0, steps)
    engine = gpt_engine(rank, "fp16", stage, n_layer=1)
    before = []
    losses, infos = [], []
    for step in range(6):
        before.append(engine.full_state_dict())
        l, i = gpt_steps(engine, rank, step, step + 1, overflow=overflow)
        losses += l
        infos += i
    before.append(engine.full_state_dict())
    out["overflow"] = (losses, infos, before)
    return out


def accounting_world(rank: int, world_size: int, stages: list[int], precision: str):
    """memory() and comm_volume() after one step (1 micro-step) and after a 2-micro-step step, and
    memory() between that step's two micro-steps (what gradient accumulation holds)."""
    from workers.models import num_parameters

    out = {}
    for stage in stages:
        engine = gpt_engine(rank, precision, stage, bucket_mb=0.5)
        phi = num_parameters(engine.module)
        gpt_steps(engine, rank, 0, 1)
        one = (engine.memory(), engine.comm_volume())
        step_memory = engine.step_memory()
        between = []
        gpt_steps(engine, rank, 1, 2, accum=2,
                  after_backward=lambda step, micro: between.append(engine.memory()) if micro == 0 else None)
        two = (engine.memory(), engine.comm_volume())
        out[stage] = {
            "phi": phi,
            "padded": engine.layout.numel,
            "buckets": len(engine.layout.buckets),
            "one": one,
            "two": two,
            "between_micro_steps": between[0],
            "step_memory": step_memory,
        }
    return out


def resume_world(rank: int, world_size: int, cases: list[tuple[int, str]], steps: int = 6, save_after: int = 3):
    """Train ``steps``; separately, a fresh engine loads the state saved after ``save_after`` steps
    and trains the rest. Returns both runs' losses and final full state dicts."""
    out = {}
    for stage, precision in cases:
        a = gpt_engine(rank, precision, stage, n_layer=2, bucket_mb=0.25)
        first, _ = gpt_steps(a, rank, 0, save_after, accum=2)
        sd = clone_sd(a.state_dict())
        rest_a, infos_a = gpt_steps(a, rank, save_after, steps, accum=2)
        b = gpt_engine(rank, precision, stage, seed=1234, n_layer=2, bucket_mb=0.25)
        b.load_state_dict(sd)
        rest_b, infos_b = gpt_steps(b, rank, save_after, steps, accum=2)
        out[(stage, precision)] = {
            "a": (rest_a, infos_a, a.full_state_dict(), a.state_dict()),
            "b": (rest_b, infos_b, b.full_state_dict(), b.state_dict()),
            "saved": sd,
        }
    return out


def collectives_world(rank: int, world_size: int):
    """Counting of each collective kind, the hang watchdog, and full-state round trips."""
    import logging
    import time

    import torch.distributed as dist

    from workers.zero.collectives import Collectives

    out = {}
    comm = Collectives(dist.group.WORLD, torch.device("cpu"), timeout_s=0.2)
    x = torch.full((6,), float(rank + 1))
    comm.all_reduce(x, label="ar").wait()
    shard = torch.empty(3)
    comm.reduce_scatter(shard, torch.arange(6.0) * (rank + 1), label="rs").wait()
    full = torch.zeros(6)
    full[rank * 3:(rank + 1) * 3] = rank + 1
    comm.all_gather(full, full[rank * 3:(rank + 1) * 3], label="ag").wait()
    out["values"] = (x, shard, full)
    out["counts"] = comm.counter.snapshot()

    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("workers.zero.collectives")
    logger.addHandler(Grab())
    if rank == 1:
        time.sleep(1.0)  # rank 0 is left waiting on collective #4
    comm.all_reduce(torch.ones(2), label="all_reduce bucket 7").wait()
    out["log"] = records

    # full_state_dict / load_full_state_dict round trip at stage 2, bf16
    engine = gpt_engine(rank, "bf16", 2, n_layer=1, bucket_mb=0.1)
    gpt_steps(engine, rank, 0, 2)
    full_sd = engine.full_state_dict()
    other = gpt_engine(rank, "bf16", 2, seed=99, n_layer=1, bucket_mb=0.1)
    other.load_full_state_dict(full_sd)
    out["roundtrip"] = (full_sd, other.full_state_dict())
    out["compute_params"] = {k: v.detach().clone() for k, v in other.module.state_dict().items()}
    out["tiny"] = {stage: tiny_run(rank, world_size, stage) for stage in (0, 1, 2)}
    return out


def tiny_run(rank: int, world_size: int, stage: int, steps: int = 3):
    """One 1-element parameter: at N=2 rank 1's shard is pure padding."""
    torch.manual_seed(0)
    model = nn.Linear(1, 1, bias=False)
    engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=0.1), ZeroConfig(stage=stage, precision="fp32"))
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(world_size, 1, generator=g)
        engine.backward(((engine(x[rank:rank + 1]) - 1.0) ** 2).mean())
        engine.step()
    out = engine.full_state_dict()["weight"], len(engine.state_dict()["optimizer_params"])
    engine.close()
    return out


def tiny_reference(world_size: int, steps: int = 3):
    torch.manual_seed(0)
    model = nn.Linear(1, 1, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(world_size, 1, generator=g)
        ((model(x) - 1.0) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model.weight.detach().clone()
