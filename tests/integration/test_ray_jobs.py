"""Issue 5's must-shows on a real local Ray head, a real control plane and PostgreSQL.

One Ray head (2 CPUs) serves the whole module; each test gets its own control plane and
database. Jobs are gpt-nano on the standard library's sources, 2 workers × 1 CPU.
"""

from __future__ import annotations

import os
import signal
import sysconfig
import time
from pathlib import Path

import pytest

from service.schemas import JobState
from tests.integration.conftest import job_processes, train_workers, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def nano_job(steps: int, **overrides) -> dict:
    stdlib = Path(sysconfig.get_paths()["stdlib"]).as_uri()
    spec = {"name": "ray-e2e", "model": {"preset": "gpt-nano"},
            "data": {"kind": "text", "uri": stdlib, "glob": "*.py", "seq_len": 64},
            "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-3,
                      "warmup_steps": 5, "weight_decay": 0.1, "grad_clip": 1.0, "seed": 0},
            "zero": {"stage": 2, "precision": "fp32"},
            "resources": {"num_workers": 2, "cpus_per_worker": 1, "gpus_per_worker": 0},
            "max_failures": 0}
    for key, value in overrides.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) else value
    return spec


def explain(client, job_id: str) -> str:
    events = "\n".join(f"  {e.from_state} -> {e.to_state} [{e.reason}] {e.message}" for e in client.events(job_id))
    return f"events:\n{events}\nlogs (tail):\n{client.logs(job_id, tail_bytes=4000)}"


def reference_memory(spec: dict) -> list[dict]:
    """engine.memory() of each rank for the same spec, from a 2-process Gloo world without Ray."""
    from workers.train import run_local

    summaries = run_local({"spec": {**spec, "train": {**spec["train"], "steps": 1}}, "job_id": "reference",
                           "api_url": None}, world_size=2)
    return [s["memory"] for s in summaries]


def test_two_worker_job_succeeds_with_a_metric_row_per_rank_and_step(make_control_plane):
    steps = 30
    spec = nano_job(steps)
    plane = make_control_plane()
    with plane.client() as client:
        job = client.submit(spec)
        final = client.wait(job.id, timeout=240)
        assert final.state is JobState.SUCCEEDED, explain(client, job.id)
        assert final.attempt == 1
        rows = client.metrics(job.id)
        events = client.events(job.id)
        logs = client.logs(job.id)

    assert len(rows) == 2 * steps  # one per (rank, step): nothing missing, nothing twice
    for rank in (0, 1):
        mine = sorted((r for r in rows if r.rank == rank), key=lambda r: r.step)
        assert [r.step for r in mine] == list(range(1, steps + 1))
        assert {r.attempt for r in mine} == {1}
        losses = [r.loss for r in mine]
        assert sum(losses[-5:]) / 5 < sum(losses[:3]) / 3 - 0.7, losses
        for r in mine:
            assert r.tokens_per_s > 0 and r.tflops > 0 and r.comm_bytes > 0 and r.step_time_s > 0
            assert r.mem_peak_bytes > 0 and r.grad_norm is not None and r.lr > 0

    expected = reference_memory(spec)
    for r in rows:
        memory = expected[r.rank]
        assert (r.mem_params_bytes, r.mem_grads_bytes, r.mem_optimizer_bytes, r.mem_buffers_bytes) == \
            (memory["params"], memory["grads"], memory["optimizer"], memory["buffers"])

    assert [e.to_state for e in events][-2:] == [JobState.RUNNING, JobState.SUCCEEDED]
    assert "workers.launch" in logs and "RayTrainWorker" in logs
