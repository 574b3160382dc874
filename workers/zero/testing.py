"""Run a function on a fresh Gloo world of N processes (tests, examples, benchmarks).

    results = spawn_world(fn, world_size=2, args=(...))   # fn(rank, world_size, *args)

Uses ``torch.multiprocessing.spawn``; each rank initialises the default process group on
loopback with Gloo, calls ``fn`` and sends its return value back (``torch.save``/``load``, so
tensors and dicts travel). One thread per rank: a world is usually oversubscribing the CPUs.
A function that builds a ``ZeroEngine`` ends it with ``engine.close()`` (docs/engine.md,
"Ending a run"); the world then ends with a barrier before the group is destroyed.
The function is found again in the child by module name, or by file path when its module is
not importable there (pytest's importlib mode). ``byte_stream_batch`` is data such a run can
learn from without a data loader.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import importlib.util
import inspect
import os
import socket
import sys
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_module(module: str, path: str | os.PathLike) -> Any:
    """``module`` imported from ``path`` and registered under that name: how a spawned rank
    loads a test file that is not importable as a package (nor its siblings)."""
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    spec.loader.exec_module(mod)
    return mod


def _resolve(module: str, qualname: str, path: str) -> Callable:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        mod = load_module(module, path)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _entry(rank: int, world_size: int, port: int, target: tuple[str, str, str], args: tuple, outdir: str,
           timeout_s: float) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    faulthandler.enable()  # a native abort prints every thread's Python stack, not only "terminate called"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    failed = True
    try:
        result = _resolve(*target)(rank, world_size, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        del result
        gc.collect()  # what the function left behind (an engine it did not close) goes while the group lives
        if dist.is_initialized():  # not after engine.close(destroy_group=True)
            dist.barrier()  # no rank destroys the group while a peer still communicates
        failed = False
    finally:
        gc.collect()  # whatever the run built is freed now, not during interpreter shutdown
        # A rank that raised leaves its group to end with its process. Destroyed here, the engine's
        # exit hook (``teardown.release_dead_groups``) would close its connections before the process
        # is gone, and a peer's "Connection closed by peer" could reach ``mp.spawn`` first, reported in
        # place of this rank's own error.
        if dist.is_initialized() and not failed:  # after close(destroy_group=True) it is already gone
            dist.destroy_process_group()


def byte_stream_batch(step: int, micro: int, rank: int, batch_size: int, seq_len: int):
    """A learnable byte stream: next = 5·x + 3 (mod 256) 70% of the time, a random byte otherwise.

    Seeded by (step, micro-batch, rank): every rank draws its own rows, and a run repeats exactly.
    Returns CPU ``(inputs, targets)``, targets one byte ahead. One definition, so that the data
    ``examples/engine_torchrun.py`` shows is the data the engine tests check.
    """
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * micro + rank)
    x = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, 256, (batch_size,), generator=g)
    noise = torch.randint(0, 256, (batch_size, seq_len), generator=g)
    keep = torch.rand(batch_size, seq_len, generator=g) < 0.7
    for i in range(seq_len):
        x[:, i + 1] = torch.where(keep[:, i], (5 * x[:, i] + 3) % 256, noise[:, i])
    return x[:, :-1], x[:, 1:]


def spawn_world(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; return each rank's result."""
    target = (fn.__module__, fn.__qualname__, inspect.getfile(fn))
    with tempfile.TemporaryDirectory(prefix="zero-world-") as outdir:
        mp.spawn(_entry, args=(world_size, free_port(), target, args, outdir, timeout_s), nprocs=world_size,
                 join=True)
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
