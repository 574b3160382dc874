"""Stage 3, offload and activation checkpointing runs (importable by spawned ranks).

``BlockNet`` is ``cases.ToyNet`` cut into units: a ``ModuleList`` of blocks (the default wrap
policy makes each one a stage-3 unit) plus a root. It keeps every awkwardness -- an
embedding tied to the head (root), a weight tied between block 0 and block 2 (so it belongs to
the root), a frozen layer inside a block and one in the root, a parameter never used inside a
block, a root layer only some ranks use, sizes that divide neither 2 nor 3 -- and adds a
forward whose block order changes from step to step (and skips a block on some steps), and
an evaluation forward between steps that visits the blocks in yet another order.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from workers.zero import ZeroConfig, ZeroEngine

try:
    from .cases import DIM, HID, MICRO_B, OPTIMIZERS, VOCAB, ToyNet, make_batches, reference_train, uses_extra
except ImportError:  # a spawned rank loads this file by path (``testing._resolve``): so its sibling
    import pathlib

    from workers.zero.testing import load_module

    _cases = load_module("tests.workers.zero.cases", pathlib.Path(__file__).with_name("cases.py"))
    DIM, HID, MICRO_B, OPTIMIZERS, VOCAB = _cases.DIM, _cases.HID, _cases.MICRO_B, _cases.OPTIMIZERS, _cases.VOCAB
    ToyNet, make_batches, reference_train, uses_extra = (_cases.ToyNet, _cases.make_batches, _cases.reference_train,
                                                         _cases.uses_extra)


class Block(nn.Module):
    def __init__(self, frozen: bool = False, unused: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(DIM, HID)
        self.fc2 = nn.Linear(HID, DIM)
        self.frozen = nn.Linear(HID, HID) if frozen else None
        if frozen:
            self.frozen.requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(3)) if unused else None

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.frozen is not None:
            h = torch.tanh(self.frozen(h))
        return x + self.fc2(h)


class BlockNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(), Block(frozen=True), Block(unused=True), Block()])
        self.blocks[2].fc1.weight = self.blocks[0].fc1.weight  # tied across two units: the root's
        self.extra = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("shift", torch.randn(DIM) * 0.1)

    def forward(self, idx, targets, use_extra: bool, order=(0, 1, 2, 3)):
        x = torch.tanh(self.frozen(self.emb(idx) + self.shift))
        for i in order:
            x = self.blocks[i](x)
        if use_extra:
            x = x + self.extra(x)
        logits = self.head(x)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def step_order(step: int) -> tuple[int, ...]:
    """The forward's block order at ``step``: it changes, and block 1 is skipped every third step."""
    return [(0, 1, 2, 3), (3, 0, 2, 1), (0, 2, 3)][step % 3]


EVAL_ORDER = (3, 2, 1, 0)


def make(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"toy": ToyNet, "blocks": BlockNet}[kind]()


def forward(model, kind: str, idx, tgt, rank: int, step: int):
    if kind == "toy":
        return model(idx, tgt, uses_extra(rank))
    return model(idx, tgt, uses_extra(rank), step_order(step))


def reference(kind: str, world_size: int, opt: str, steps: int, micro: int, clip: float | None):
    """One process, plain torch.optim, the global batch of every rank at once."""
    return reference_train(make(kind), lambda model, idx, tgt, rank, step: forward(model, kind, idx, tgt, rank, step),
                           world_size, opt, steps, micro, clip)


def check_against_reference(world_size: int, cases: list[tuple], results_per_rank, label) -> list[tuple]:
    """Each case's rank-0 result against one process with torch.optim (``reference``, built once per
    (kind, optimizer, steps, micro-steps, clip)): the state dict and every step's gradient norm at
    rtol 1e-5; every other rank bitwise equal to rank 0 (parameters and norms).

    ``results_per_rank[r][i]`` is rank r's ``run()`` result of ``cases[i]``; ``label(case)`` names a
    case in failures. Returns, per case, each rank's result, for the caller's own checks.
    """
    refs: dict = {}
    for i, (kind, _cfg, opt, steps, micro, clip, *_) in enumerate(cases):
        key = (kind, opt, steps, micro, clip)
        if key not in refs:
            refs[key] = reference(kind, world_size, opt, steps, micro, clip)
        ref_sd, ref_norms = refs[key]
        what = f"world {world_size} {label(cases[i])}"
        full0, infos0 = results_per_rank[0][i][:2]
        assert set(full0) == set(ref_sd), what
        for k, ref in ref_sd.items():
            torch.testing.assert_close(full0[k], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {k}: {m}")
        norms = torch.tensor([info.grad_norm for info in infos0])
        torch.testing.assert_close(norms, torch.tensor(ref_norms), rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
        for r in range(1, world_size):
            full_r, infos_r = results_per_rank[r][i][:2]
            for k in full0:
                assert torch.equal(full_r[k], full0[k]), f"{what}: rank {r} differs on {k}"
            assert [x.grad_norm for x in infos_r] == [x.grad_norm for x in infos0], (what, r)
    return [[per_rank[i] for per_rank in results_per_rank] for i in range(len(cases))]


def run(rank: int, world_size: int, kind: str, cfg: dict, opt: str = "adamw", steps: int = 6, micro: int = 2,
        clip: float | None = 0.5, direct: bool = False):
    """One rank's run with ZeroConfig(**cfg); an evaluation forward in another order between steps."""
    model = make(kind, seed=rank)  # the engine must broadcast rank 0's values
    engine = ZeroEngine(model, OPTIMIZERS[opt], ZeroConfig(**{"precision": "fp32", "grad_clip": clip, **cfg}))
    infos, peak = [], 0
    sl = slice(rank * MICRO_B, (rank + 1) * MICRO_B)
    for step, step_batches in enumerate(make_batches(world_size, steps, micro)):
        for idx, tgt in step_batches:
            loss = forward(engine, kind, idx[sl], tgt[sl], rank, step)
            loss.backward() if direct else engine.backward(loss)
        infos.append(engine.step())
        if kind == "blocks":
            engine.eval()
            with torch.no_grad():
                engine(idx[sl], tgt[sl], uses_extra(rank), EVAL_ORDER)
            engine.train()
        peak = max(peak, getattr(engine.strategy, "max_gathered", 0))
    out = engine.full_state_dict(), infos, peak, engine.memory()["buffers"] - _buffer_bytes(engine.module)
    engine.close()  # how a run ends (docs/engine.md, "Ending a run")
    return out


def recorded_steps(engine, kind: str, rank: int, world_size: int, steps: int, counts: dict,
                   keys: tuple[str, ...], vary_order: bool = True) -> tuple[list, list, list]:
    """``steps`` steps of one micro-step each; per step the rank's loss, ``comm_volume()`` and the
    ``counts[k]`` for ``keys`` (what a patched torch.distributed was asked to send), reset after
    each step. ``vary_order``: the blocks' order changes from step to step (else step 0's)."""
    sl = slice(rank * MICRO_B, (rank + 1) * MICRO_B)
    losses, volumes, dispatched = [], [], []
    for step, ((idx, tgt),) in enumerate(make_batches(world_size, steps, 1)):
        loss = forward(engine, kind, idx[sl], tgt[sl], rank, step if vary_order else 0)
        losses.append(loss.detach().clone())
        engine.backward(loss)
        engine.step()
        volumes.append(engine.comm_volume())
        dispatched.append({k: counts[k] for k in keys})
        for k in keys:
            counts[k] = 0
    return losses, volumes, dispatched


def _buffer_bytes(model: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in model.buffers())


def world(rank: int, world_size: int, cases: list[tuple]):
    """Several (kind, cfg, opt, steps, micro, clip, direct) runs in one spawned world."""
    torch.set_num_threads(1)
    return [run(rank, world_size, *case) for case in cases]


# -- accounting: issue 3, must-show 2 ----------------------------------------------------------------


def accounting_world(rank: int, world_size: int, precision: str = "bf16"):
    """Stage 3 on the small GPT: memory() mid-forward, after backward and after a step, comm per step, both
    ``reshard_after_forward`` settings, and the per-unit sizes the checks need."""
    from workers.models import num_parameters

    from .cases import gpt_engine, gpt_steps  # in a spawned rank: the module registered above

    torch.set_num_threads(1)
    out = {}
    for reshard in (True, False):
        engine = gpt_engine(rank, precision, 3, reshard_after_forward=reshard)
        seen = []
        block = engine.module.blocks[1]
        handle = block.register_forward_pre_hook(lambda *_: seen.append(engine.memory()) if not seen else None)
        after_backward = []
        _, infos = gpt_steps(engine, rank, 0, 1, after_backward=lambda *_: after_backward.append(engine.memory()))
        handle.remove()
        mem_step = engine.memory()
        out[reshard] = {
            "phi": num_parameters(engine.module),
            "padded": engine.layout.numel,
            "units": [(u.name, u.flat.numel() * u.flat.element_size()) for u in engine.strategy.units],
            "module_buffers": sum(b.numel() * b.element_size() for b in engine.module.buffers()),
            "mid_forward": seen[0],
            "after_backward": after_backward[0],
            "after_step": mem_step,
            "comm": engine.comm_volume(),
            "info": infos[0],
            "max_gathered": engine.strategy.max_gathered,
        }
    # fp16 at stage 3 with offload: an overflow on one rank skips that step on every rank
    engine = gpt_engine(rank, "fp16", 3, n_layer=1, offload_optimizer=True, activation_checkpointing=True)
    infos, changed = [], []
    for step in range(6):
        before = engine.full_state_dict()
        infos += gpt_steps(engine, rank, step, step + 1, overflow=OVERFLOW)[1]
        after = engine.full_state_dict()
        changed.append(not all(torch.equal(before[k], after[k]) for k in before))
    out["overflow"] = (infos, changed, engine.full_state_dict())
    return out


OVERFLOW = {2: (1,), 4: (0, 1)}  # step 2: only rank 1 overflows; step 4: both


def count_sent(counts: dict, key) -> dict:
    """Count, below the engine, the elements of every fp32 collective torch.distributed is asked
    for: ``counts[key(op, kwargs)] += elements``, ``op`` one of "broadcast", "all_reduce", "isend",
    "irecv". On Gloo/CPU a parameter all-gather is one broadcast per rank slot, a reduce-scatter an
    in-place all-reduce of its input or, over two ranks, an exchange whose sends and receives add up
    to the input (``collectives.py``, the note on Gloo's copies); control messages travel as
    float64/int64 and are not counted. ``counts["restore"]()`` puts torch.distributed back."""
    import torch.distributed as dist

    real = {op: getattr(dist, op) for op in ("broadcast", "all_reduce", "isend", "irecv")}

    def counted(op):
        def call(tensor, *args, **kwargs):
            if tensor.dtype == torch.float32:
                counts[key(op, kwargs)] += tensor.numel()
            return real[op](tensor, *args, **kwargs)
        return call

    for op in real:
        setattr(dist, op, counted(op))
    counts["restore"] = lambda: [setattr(dist, op, fn) for op, fn in real.items()]
    return counts
