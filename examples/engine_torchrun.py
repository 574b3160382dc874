"""Train a small GPT with zerotrain's ZeRO engine alone -- no service, no Ray.

    # 2 processes on this machine (Gloo on CPU, NCCL when there are GPUs):
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/engine_torchrun.py --stage 2 --precision bf16
    # one process, no process group at all:
    .venv/bin/python examples/engine_torchrun.py --stage 1
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/engine_torchrun.py --stage 3 --offload --activation-checkpointing

Every rank trains on its own slice of a synthetic byte stream (a learnable rule plus noise,
``byte_stream_batch``: the data the engine tests train on too); rank 0 prints the loss, the
global gradient norm, what the engine holds per rank (``engine.memory()``) and what it
communicated (``engine.comm_volume()``), and at the end compares both with the ZeRO
formulas (``contract.zero_math``).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from contract.zero_math import model_state_bytes
from workers.models import GPT, PRESETS, num_parameters
from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.testing import byte_stream_batch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt-nano", choices=sorted(PRESETS))
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--offload", action="store_true", help="optimizer on the host (stages 1-3)")
    p.add_argument("--activation-checkpointing", action="store_true")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device("cpu")
    if "RANK" in os.environ:  # launched by torchrun
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl")
        else:
            if os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost"):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group("gloo")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1

    torch.manual_seed(0)  # rank 0's initial weights win anyway: the engine broadcasts them
    model = GPT(replace(PRESETS[args.preset], block_size=args.seq_len)).to(device)
    phi = num_parameters(model)
    config = ZeroConfig(stage=args.stage, precision=args.precision, bucket_mb=args.bucket_mb,
                        grad_clip=args.grad_clip, offload_optimizer=args.offload,
                        activation_checkpointing=args.activation_checkpointing)
    engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=0.1), config)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{args.preset}: Φ={phi:,} parameters, {world} rank(s), stage {args.stage}, {args.precision}, "
        f"{len(engine.layout.buckets)} bucket(s)")

    for step in range(args.steps):
        t0 = time.perf_counter()
        loss_sum = 0.0
        for micro in range(args.accum):
            x, y = (t.to(device) for t in byte_stream_batch(step, micro, rank, args.micro_batch, args.seq_len))
            loss = engine(x, y) / args.accum
            engine.backward(loss, sync=micro == args.accum - 1)
            loss_sum += loss.item()
        info = engine.step()
        if step % 5 == 0 or step == args.steps - 1:
            say(f"step {info.step:4d}  loss {loss_sum:.4f}  grad_norm {info.grad_norm:.3f}"
                f"{'  SKIPPED' if info.skipped else ''}  comm {engine.comm_volume()['total']:,} el"
                f"  exposed {info.comm_exposed_s * 1e3:.1f} ms  {time.perf_counter() - t0:.2f}s")

    mem, comm = engine.memory(), engine.comm_volume()
    states = model_state_bytes(phi, world, args.precision, args.stage)
    expected = (states.gpu_params, states.gpu_grads, states.gpu_optimizer)
    say("memory per rank (bytes):  measured  vs  the ZeRO formula")
    for key, predicted in zip(("params", "grads", "optimizer"), expected):
        say(f"  {key:9s} {mem[key]:>12,}  vs {predicted:>12,}")
    say(f"  buffers   {mem['buffers']:>12,}\n  total     {mem['total']:>12,}")
    if "host" in mem:
        say(f"  host      {mem['host']:>12,}  (offloaded master, optimizer state, fp32 gradient shard)")
    say(f"communication last step: {comm} (2Φ = {2 * phi:,}; stage 2 pays Φ of reduce-scatter per micro-step, "
        f"stage 3 3Φ)")
    # waits for what is in flight, synchronizes the ranks, then destroys the process group and joins
    # Gloo's threads, so none is left to abort the process at interpreter shutdown
    engine.close(destroy_group=True)


if __name__ == "__main__":
    main()
