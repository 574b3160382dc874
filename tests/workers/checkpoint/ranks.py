"""What one rank does in the checkpoint tests (importable by spawned ranks).

``train_tasks(rank, world_size, tasks)`` runs several short training runs one after the other
on the same Gloo world, each described by a dict:

    uri, job_id     where its checkpoints go ({uri}/{job_id}/checkpoints)
    stage           ZeRO stage of this run
    shard_group_size  hybrid sharding's group size (ZeroConfig), or None
    global_batch    samples per step (default GLOBAL_BATCH)
    until           train until this many completed steps, then save (waiting for the commit)
    every           also save every this many steps (asynchronously), or None
    keep_last       retention
    resume          None, or {"job_id", "step"}: load that checkpoint first (any world/stage)
    dropout         the model's dropout (exercises RNG restore)
    init_seed       seed of the model's initial weights (a resumed run uses another, to
                    prove that everything comes from the checkpoint)

The model is a tiny GPT with a tied embedding/head, a frozen position table and a buffer; the
data the synthetic Markov chain through ``ShardedBatchLoader``, so a resume also has to
restore the data position. Each task returns its full fp32 state, losses, checkpoint reports
and, after a load, the bytes this rank read next to the bytes its new shard needs.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch

from workers.checkpoint import CheckpointManager, checkpoints_uri
from workers.data import ShardedBatchLoader, SyntheticDataset
from workers.models import GPT, preset_config
from workers.zero import ZeroConfig, ZeroEngine

VOCAB, SEQ, GLOBAL_BATCH, MICRO = 32, 8, 12, 2  # 12 divides by 2 x {1, 2, 3} ranks


def tiny_gpt(seed: int, dropout: float = 0.0) -> GPT:
    """Without biases: a key bias gets no gradient but rounding noise, which Adam scales up to
    a full step, and runs at different world sizes round differently; with a real gradient
    everywhere, runs that differ only in summation order stay within float tolerance."""
    torch.manual_seed(seed)
    model = GPT(preset_config("gpt-nano", vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16,
                              dropout=dropout, bias=False))
    model.wpe.weight.requires_grad_(False)  # a frozen parameter
    model.register_buffer("marker", torch.arange(5, dtype=torch.float32) + seed)  # a buffer
    return model


def make_engine(stage: int, seed: int, dropout: float = 0.0, shard_group_size: int | None = None,
                hpz_partition_size: int | None = None) -> ZeroEngine:
    config = ZeroConfig(stage=stage, precision="fp32", bucket_mb=0.002, grad_clip=1.0,
                        shard_group_size=shard_group_size, hpz_partition_size=hpz_partition_size)
    return ZeroEngine(tiny_gpt(seed, dropout), lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1), config)


def needed_bytes(engine: ZeroEngine) -> int:
    """What this rank's new shard needs from a checkpoint: its pieces of the fp32 master and of
    AdamW's two moment tensors, AdamW's scalar ``step`` per held piece, frozen params, buffers."""
    meta = engine.state_dict_meta()
    held = [e["shard_range"] for e in meta["params"].values() if e["shard_range"] is not None]
    total = sum(4 * 3 * (b - a) + 4 for a, b in held)
    frozen = [p for p in engine.module.parameters() if not p.requires_grad]
    return total + sum(4 * p.numel() for p in frozen) + sum(4 * b.numel() for b in engine.module.buffers())


def run_task(rank: int, world_size: int, task: dict[str, Any]) -> dict[str, Any]:
    engine = make_engine(task["stage"], task.get("init_seed", 0), task.get("dropout", 0.0),
                         task.get("shard_group_size"), task.get("hpz_partition_size"))
    torch.manual_seed(1000 + rank)  # dropout streams differ per rank, as in workers.train
    loader = ShardedBatchLoader(SyntheticDataset(VOCAB, SEQ, seed=0),
                                global_batch_size=task.get("global_batch", GLOBAL_BATCH),
                                micro_batch_size=MICRO, rank=rank, world_size=world_size)
    manager = CheckpointManager(checkpoints_uri(task["uri"], task["job_id"]), job_id=task["job_id"],
                                every_steps=task.get("every"), keep_last=task.get("keep_last"))
    out: dict[str, Any] = {"job_id": task["job_id"], "losses": [], "blocked": [], "reports": []}
    step = 0
    if task.get("resume"):
        resume = task["resume"]
        step = manager.load(engine, loader, step=resume.get("step", "latest"),
                            uri=checkpoints_uri(task["uri"], resume["job_id"]))
        out["loaded_step"], out["bytes_read"], out["bytes_needed"] = step, manager.last_load.bytes_read, \
            needed_bytes(engine)
    accumulation = loader.accumulation_steps
    while step < task["until"]:
        for inputs, targets in loader.next_batch():
            loss = engine(inputs, targets)
            engine.backward(loss / accumulation)
            out["losses"].append(float(loss.detach()))
        engine.step()
        step += 1
        last = step == task["until"]
        if task.get("save", True) and (manager.due(step) or last):
            out["blocked"].append(manager.save(step, engine, loader, wait=last))
            if last:
                out["reports"].append(manager.last_report)
    manager.close()
    out["full"] = engine.full_state_dict()
    out["position"] = loader.position
    return out


def train_tasks(rank: int, world_size: int, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [run_task(rank, world_size, task) for task in tasks]


# ----------------------------------------------------------------------------- crash


def crash_during_save(rank: int, world_size: int, uri: str, job_id: str, marker_dir: str) -> None:
    """Save at step 2, then die inside the save of step 4: rank 1 writes part of its shard and
    hangs (the test kills it there); rank 0 writes its shard and waits for rank 1 forever."""
    torch.set_num_threads(1)
    engine = make_engine(2, 0)
    loader = ShardedBatchLoader(SyntheticDataset(VOCAB, SEQ, seed=0), global_batch_size=GLOBAL_BATCH,
                                micro_batch_size=MICRO, rank=rank, world_size=world_size)
    manager = CheckpointManager(checkpoints_uri(uri, job_id), job_id=job_id)
    for step in range(1, 5):
        for inputs, targets in loader.next_batch():
            engine.backward(engine(inputs, targets) / loader.accumulation_steps)
        engine.step()
        if step == 2:
            manager.save(step, engine, loader, wait=True)
            full = engine.full_state_dict()
            if rank == 0:
                torch.save(full, os.path.join(marker_dir, "step2_full.pt"))
    if rank == 1:
        from workers.checkpointing import writer

        def stalled_write(step_storage, snap):
            with step_storage.open_write(snap.file) as sink:
                sink.write(b"\0" * 4096)
                sink.flush()
                Path(marker_dir, "rank1_writing").touch()
                threading.Event().wait()  # killed here
            raise AssertionError("unreachable")

        writer.write_shard = stalled_write
    manager.save(4, engine, loader)
    Path(marker_dir, f"rank{rank}_returned_from_save").touch()
    manager.wait()  # never returns: rank 0's commit waits for rank 1
