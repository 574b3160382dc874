"""Ending a run: ``engine.close()``, nothing in flight between steps, and ranks that exit 0.

Two parts. ``test_close_contract`` checks in one Gloo world, at every stage (and stage 3 with
offload), what a script relies on: after every forward, backward and ``step()`` the
collectives' pending list is empty -- except the parameter all-gathers stages 1/2 leave in flight
after ``step()``, for the next forward to wait (``param_gathers.py``); ``close()`` stops the
watchdog thread, removes the hooks, is idempotent, and the engine then refuses to train with a RuntimeError; the ``with`` form
closes too, and after an exception inside it closes without communicating and lets the
exception through. ``test_close_destroy_group_joins_every_thread``: ``close(destroy_group=True)``
(hybrid sharding: the engine's own groups too) leaves no thread of Gloo or the store running.
``test_worlds_exit_cleanly`` is a small run of ``benchmarks/exit_loop.py``: fresh worlds ending
with ``close(destroy_group=True)``, with ``close()`` + ``destroy_process_group()`` or with a bare
destroy exit 0 with no such thread left at exit; without the engine's exit hook the second
ending leaves them (``workers/zero/teardown.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from benchmarks.exit_loop import Net, _batch
from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.testing import spawn_world

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = [dict(stage=0), dict(stage=1), dict(stage=2), dict(stage=3), dict(stage=3, prefetch=2),
           dict(stage=2, offload_optimizer=True), dict(stage=3, offload_optimizer=True)]


def _watchdog_alive() -> bool:
    return any(t.name == "zero-comm-watchdog" and t.is_alive() for t in threading.enumerate())


def contract_world(rank: int, world_size: int):
    out = []
    for cfg in CONFIGS:
        engine = ZeroEngine(Net(), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                            ZeroConfig(precision="fp32", bucket_mb=0.002, **cfg))
        seen = {}
        for step in range(2):
            for micro in range(2):
                x, y = _batch(step, micro, rank)
                loss = engine(x, y)
                seen.setdefault("after forward", []).extend(engine.comm.pending())
                engine.backward(loss)  # not sync: stage 2/3 buckets would stay in flight
                seen.setdefault("after backward", []).extend(engine.comm.pending())
                # stage 3's end-of-backward tag gather is checked later, but must not stay in flight
                tag = getattr(engine.strategy, "_rs_check", None)
                seen["after backward"] += [tag.label] if tag is not None and not tag.done else []
            engine.step()
            seen.setdefault("after step", []).extend(engine.comm.pending())
        seen["gathers"] = [f"all_gather bucket {b.spec.index}" for b in reversed(engine.buckets)]
        watchdog_before = _watchdog_alive()
        engine.close()
        engine.close()  # idempotent
        refused = []
        for name, call in [("forward", lambda: engine(x, y)), ("backward", lambda: engine.backward(loss)),
                           ("step", engine.step), ("full_state_dict", engine.full_state_dict)]:
            with pytest.raises(RuntimeError, match=r"after close\(\)") as info:
                call()
            refused.append(name in str(info.value))
        out.append({"cfg": cfg, "pending": seen, "watchdog_before": watchdog_before,
                    "watchdog_after": _watchdog_alive(), "hooks": len(engine._hooks) + len(
                        getattr(engine.strategy, "_handles", [])), "refused": refused,
                    "memory": engine.memory()["total"] > 0})

    # the context-manager form: closes at the end; after an exception, locally, exception intact
    with ZeroEngine(Net(), lambda ps: torch.optim.SGD(ps, lr=0.1), ZeroConfig(stage=2, precision="fp32")) as engine:
        x, y = _batch(0, 0, rank)
        engine.backward(engine(x, y))
        engine.step()
    with_closed = engine.closed
    try:
        with ZeroEngine(Net(), lambda ps: torch.optim.SGD(ps, lr=0.1), ZeroConfig(stage=3, precision="fp32")) as e3:
            raise KeyError("training failed")
    except KeyError as exc:
        passed_through = exc.args == ("training failed",)
    return {"configs": out, "with_closed": with_closed, "passed_through": passed_through, "abandoned": e3.closed,
            "watchdog_end": _watchdog_alive()}


def test_close_contract():
    for rank, res in enumerate(spawn_world(contract_world, world_size=2)):
        for case in res["configs"]:
            where = f"rank {rank}, {case['cfg']}"
            gathers = case["pending"].pop("gathers")
            # stages 1/2: the parameter gathers of each step, in forward order (the last bucket first),
            # waited by the next forward
            after_step = gathers * 2 if case["cfg"]["stage"] in (1, 2) else []
            assert case["pending"] == {"after forward": [], "after backward": [], "after step": after_step}, where
            assert case["watchdog_before"] and not case["watchdog_after"], where
            assert case["hooks"] == 0, where
            assert case["refused"] == [True] * 4, where
            assert case["memory"], where  # observation still answers
        assert res["with_closed"] and res["abandoned"] and res["passed_through"]
        assert not res["watchdog_end"]


def _gloo_threads() -> list[str]:
    """This process's threads of Gloo and the TCPStore, by the names torch gives them."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return sorted(n for n in names if n.startswith(("pt_gloo", "gloo_", "pt_tcpstore")))


def destroy_world(rank: int, world_size: int):
    """close(destroy_group=True) on a hybrid engine (its own groups) then on a plain one."""
    out = {"before": _gloo_threads()}
    hybrid = ZeroEngine(Net(), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                        ZeroConfig(stage=2, precision="fp32", bucket_mb=0.002, shard_group_size=1))
    x, y = _batch(0, 0, rank)
    hybrid.backward(hybrid(x, y))
    hybrid.step()
    hybrid.close(destroy_group=True)
    out["after"] = _gloo_threads()
    out["initialized"] = torch.distributed.is_initialized()
    out["answers"] = hybrid.memory()["total"] > 0 and len(hybrid.state_dict()) > 0
    hybrid.close(destroy_group=True)  # idempotent
    out["watchdog"] = _watchdog_alive()
    return out


def test_close_destroy_group_joins_every_thread():
    """After close(destroy_group=True) no Gloo, transport or store thread (nor ours) is left: nothing
    of torch.distributed can run into interpreter shutdown. On the old end (close(), then
    destroy_process_group()) they all are still there: torch's defaults pin the default group."""
    for rank, res in enumerate(spawn_world(destroy_world, world_size=2)):
        assert res["before"], rank  # the group's threads exist, and are found by name
        assert res["after"] == [] and not res["initialized"], (rank, res)
        assert res["answers"] and not res["watchdog"], (rank, res)


@pytest.mark.slow  # 8 exit-loop worlds, about 30 s: make test keeps the endings' own tests (above, test_exit_hook.py)
def test_worlds_exit_cleanly(tmp_path):
    """Fresh worlds (stages 0-3) ending with close(destroy_group=True), with close() then
    destroy_process_group(), or with a bare destroy (the engine alive) exit 0 with no thread of
    torch.distributed's left at atexit time; A0 (the second ending without the engine's exit hook,
    teardown.release_dead_groups) shows what that measures (threads left)."""
    out = tmp_path / "exit.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.exit_loop", "--worlds", "4", "--reproduce", "--old-worlds", "1",
         "--jobs", "2", "--timeout", "120", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for ending in ("closed", "close", "bare"):
        mine = [w for w in result["worlds"] if w["ending"] == ending]
        assert sorted(w["stage"] for w in mine) == [0, 1, 2, 3], ending
        assert not [w for w in mine if w["failed"] or w["threads_left"] != 0], json.dumps(mine, indent=1)[-3000:]
    unhooked = [w for w in result["worlds"] if w["ending"] == "unhooked"]
    # without the hook the group's threads run into interpreter shutdown (or a rank died)
    assert len(unhooked) == 1 and unhooked[0]["threads_left"] != 0, unhooked
