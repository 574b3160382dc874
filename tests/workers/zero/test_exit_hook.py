"""The endings users write leave nothing of Gloo's to interpreter shutdown (``teardown.release_dead_groups``).

A script that ends with ``engine.close()`` then ``dist.destroy_process_group()`` -- or destroys the
group with the engine still alive, stage 1's parameter gathers in flight -- keeps the dead group
in the engine (a module global) and in torch's own default arguments until interpreter shutdown,
where a Gloo thread asking for the GIL aborts the rank (``workers/zero/teardown.py``). The engine's
``atexit`` function drops those references while the interpreter is alive. Each world here is two
fresh interpreters that list their Gloo and store threads from an ``atexit`` function registered
before the engine's (so it runs after it): none may be left, and every rank exits 0. A group the
caller did not destroy (Ray Train's) is left alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks.exit_loop import Net, _batch
from workers.zero import ZeroConfig, ZeroEngine, teardown
from workers.zero.testing import free_port, spawn_world

ROOT = Path(__file__).resolve().parents[3]
MARK = "gloo threads at exit: "

RANK = r"""
import atexit, json, os, sys
import torch
import torch.distributed as dist
from benchmarks.exit_loop import Net, _batch
from workers.zero import ZeroConfig, ZeroEngine


def gloo_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:
            pass
    return sorted(n for n in names if n.startswith(("pt_gloo", "gloo_", "pt_tcpstore")))


atexit.register(lambda: print(MARK + json.dumps(gloo_threads()), flush=True))  # runs after the engine's
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="env://")
rank = dist.get_rank()
engine = ZeroEngine(Net(), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                    ZeroConfig(stage=STAGE, precision="fp32", bucket_mb=0.002))
for step in range(2):
    x, y = _batch(step, 0, rank)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
print(MARK.replace("at exit", "while training") + json.dumps(gloo_threads()), flush=True)
ENDING
"""


def _world(stage: int, ending: str) -> list[tuple[int, list[str], list[str], str]]:
    """Two fresh ranks running ``RANK``; per rank (exit code, Gloo threads while training, at exit, stderr)."""
    script = RANK.replace("MARK", repr(MARK)).replace("STAGE", str(stage)).replace("ENDING", ending)
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        lines = {line.split(": ", 1)[0]: json.loads(line.split(": ", 1)[1])
                 for line in stdout.splitlines() if line.startswith("gloo threads")}
        assert "terminate called" not in stderr, stderr[-3000:]
        out.append((proc.returncode, lines.get("gloo threads while training"), lines.get("gloo threads at exit"),
                    stderr[-3000:]))
    return out


@pytest.mark.parametrize("stage, ending", [
    (2, "engine.close(); dist.destroy_process_group()"),
    (1, "dist.destroy_process_group()"),  # the engine alive, its parameter gathers in flight
])
def test_destroyed_group_leaves_no_thread_at_exit(stage, ending):
    for rank, (code, training, at_exit, stderr) in enumerate(_world(stage, ending)):
        assert training, (rank, "Gloo's threads are found by name while the group lives")
        assert at_exit == [] and code == 0, (rank, at_exit, code, stderr)


def alive_world(rank: int, world_size: int):
    """release_dead_groups with the group still initialized (Ray Train's, or a script that keeps it):
    nothing is dropped and the group still works; after close() the engine still holds it."""
    engine = ZeroEngine(Net(), lambda ps: torch.optim.SGD(ps, lr=0.1), ZeroConfig(stage=2, precision="fp32"))
    x, y = _batch(0, 0, rank)
    engine.backward(engine(x, y))
    engine.step()
    engine.close()
    released = teardown.release_dead_groups()
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"released": released, "held": engine.comm.dp_group is dist.group.WORLD, "total": total.item(),
            "initialized": dist.is_initialized()}


def test_live_group_is_left_alone():
    for res in spawn_world(alive_world, world_size=2):
        assert res == {"released": False, "held": True, "total": 2.0, "initialized": True}, res
