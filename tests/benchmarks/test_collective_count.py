"""The engine benchmark's one collective counter counts what a 2-rank Gloo world dispatches.

Every row's "comm el/step" and per-kind collectives come from ``CollectiveCounter``; if it
missed an op kind, or counted an all-gather's input instead of its output, every row's
communication column would be wrong. Two real Gloo ranks run a known set of collectives under it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from service.launchers.ports import free_port

REPO = Path(__file__).resolve().parents[2]

RANK_SCRIPT = r"""
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from benchmarks.collective_count import CollectiveCounter
dist.init_process_group("gloo")
rank = dist.get_rank()
counter = CollectiveCounter()
with counter.mode:
    gathered = torch.empty(10)
    dist.all_gather_into_tensor(gathered, torch.full((5,), float(rank)))   # all-gather: output 10
    shard = torch.empty(3)
    dist.reduce_scatter_tensor(shard, torch.ones(6))                       # reduce-scatter: input 6
    summed = torch.full((7,), float(rank + 1))
    dist.all_reduce(summed)                                                # all-reduce: 7 (volume 14)
    dist.broadcast(torch.zeros(4), src=0)                                  # broadcast: 4
    dist.reduce(torch.ones(3), dst=0)                                      # reduce: 3
    dist.all_gather([torch.empty(5), torch.empty(5)], torch.ones(5))       # all-gather (list): output 10
    funcol.all_gather_single(torch.ones(5), 0, dist.group.WORLD).wait()    # functional all-gather: 10
    inbox = torch.empty(8)                                                 # an exchange: send 8, receive 8
    works = [dist.irecv(inbox, src=1 - rank), dist.isend(torch.full((8,), float(rank)), dst=1 - rank)]
    [w.wait() for w in works]
    dist.barrier()                                                         # not a data collective
assert gathered.tolist() == [0.0] * 5 + [1.0] * 5 and summed.tolist() == [3.0] * 7 and shard.tolist() == [2.0] * 3
assert inbox.tolist() == [float(1 - rank)] * 8
print(json.dumps(counter.report()), flush=True)
dist.destroy_process_group()
# What is checked is above. In 1 of 10 runs on a loaded machine (2026-12-02), the interpreter's own
# teardown after a functional collective aborted in Gloo ("terminate called without an active
# exception", SIGABRT) after the report was printed; leave without that teardown.
os._exit(0)
"""


def test_counter_counts_each_kind_on_two_gloo_ranks() -> None:
    port = free_port()
    base = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": "2", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], cwd=REPO, env={**base, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    expected = {
        "all_gather": {"calls": 3, "elements": 30},
        "reduce_scatter": {"calls": 1, "elements": 6},
        "all_reduce": {"calls": 1, "elements": 7},
        "broadcast": {"calls": 1, "elements": 4},
        "reduce": {"calls": 1, "elements": 3},
        "send": {"calls": 1, "elements": 8},
        "recv": {"calls": 1, "elements": 8},
    }
    for report in reports:  # every rank dispatches the same collectives
        assert report["kinds"] == expected
        # an all-reduce counts twice its elements, a send and a receive theirs
        assert report["volume"] == 30 + 6 + 2 * 7 + 4 + 3 + 8 + 8
