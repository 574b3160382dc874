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

import httpx
import pytest

from service.client import ValidationFailed
from service.log_text import plain_log
from service.schemas import JobState
from tests.helpers.tensorboard_files import rank_mean_loss, read_scalars
from tests.helpers.waiting import wait_for
from tests.integration.conftest import describe, job_owned_processes, job_processes_but_the_cleaner, train_workers

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
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def explain(client, job_id: str) -> str:
    events = "\n".join(f"  {e.from_state} -> {e.to_state} [{e.reason}] {e.message}" for e in client.events(job_id))
    return f"events:\n{events}\nlogs (tail):\n{client.logs(job_id, tail_bytes=4000)}"


def reference_memory(spec: dict) -> list[dict]:
    """engine.memory() of each rank for the same spec, from a 2-process Gloo world without Ray."""
    from workers.loop_config import LoopConfig
    from workers.train import run_local

    summaries = run_local(LoopConfig(spec={**spec, "train": {**spec["train"], "steps": 1}}, job_id="reference",
                                      api_url=None), world_size=2)
    return [s["memory"] for s in summaries]


def assert_readable_log(logs: str, steps: int) -> None:
    """What `zerotrain logs` shows a user: rank 0's progress lines once each, up to the last
    step; no terminal codes, no HTTP client chatter, no Ray error about its preemption watcher."""
    progress = [line for line in logs.splitlines() if f"/{steps}  loss " in line]
    assert progress and f"step {steps}/{steps}  loss " in progress[-1], logs[-4000:]
    assert len(progress) == len(set(progress)), "progress lines are repeated:\n" + "\n".join(progress)
    for noise in ("\x1b[", "HTTP Request:", "PreemptionWatcher"):
        assert noise not in logs, f"{noise!r} in the job's log:\n{logs[-4000:]}"


def test_two_worker_job_succeeds_with_a_metric_row_per_rank_and_step(make_control_plane, ray_head):
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
        rank_logs = {rank: client.logs(job.id, rank=rank) for rank in (0, 1)}
        # Must show 2 (issue 33): the event files hold each step's rank mean loss once
        wait_for(lambda: client.tensorboard(job.id).complete, 60, "the TensorBoard export")
        assert read_scalars(Path(client.tensorboard(job.id).logdir))["train/loss"] == rank_mean_loss(rows)

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
    # rank 0 also sent every rank's engine.memory() for the planner's predicted-vs-measured check
    assert final.memory_check["attempt"] == 1
    for rank in (0, 1):
        measured = final.memory_check["ranks"][str(rank)]["measured"]
        assert {k: measured[k] for k in ("params", "grads", "optimizer")} == \
            {k: expected[rank][k] for k in ("params", "grads", "optimizer")}

    assert [e.to_state for e in events][-2:] == [JobState.RUNNING, JobState.SUCCEEDED]
    assert "workers.launch" in logs and "RayTrainWorker" in logs
    assert_readable_log(logs, steps)
    # each rank's lines alone (zerotrain logs JOB --rank N): rank 0's progress lines are rank 0's only
    for rank, text in rank_logs.items():
        assert f"zerotrain: this process is rank {rank} of 2" in text, text[-4000:]
        assert ("step 1/" in text) is (rank == 0) and "workers.launch" not in text, text[-4000:]
    # every rank ended cleanly (train_loop ends with engine.close()): no Gloo teardown abort
    assert not [m for m in ("terminate called", "SIGABRT", "Fatal Python error") if m in logs], logs[-4000:]

    # The driver log outlives the Ray cluster's memory of the job: kept in storage at shutdown.
    plane.stop()
    kept = list((Path(plane.settings.storage_uri.removeprefix("file://")) / job.id / "logs").glob("*.log"))
    assert len(kept) == 1 and "workers.launch" in kept[0].read_text()
    assert kept[0].read_text() == plain_log(kept[0].read_text())  # kept without terminal codes
    from ray.job_submission import JobSubmissionClient

    JobSubmissionClient(ray_head.dashboard_url, headers=ray_head.auth_headers).delete_job(kept[0].stem)
    plane.start()
    with plane.client() as client:
        assert client.logs(job.id) == kept[0].read_text()  # kept and served as plain text


@pytest.mark.parametrize("overrides, expected", [
    ({"data": {"glob": "no-such-dir/*.nothing"}}, "no-such-dir/*.nothing"),
    # a model factory that raises: json.loads("{") -> JSONDecodeError, in the user's code
    ({"model": {"preset": None, "factory": "json:loads", "kwargs": {"s": "{"}}}, "JSONDecodeError"),
], ids=["bad-data", "raising-factory"])
def test_an_error_in_the_users_code_fails_the_job_in_its_first_attempt(make_control_plane, overrides, expected):
    """Issue 17: restarts are for lost workers; the job's own error ends it at once, whatever
    max_failures says, with the error in a few lines."""
    plane = make_control_plane()
    spec = nano_job(10, max_failures=2)
    spec.update({k: ({kk: vv for kk, vv in {**spec[k], **v}.items() if vv is not None} if isinstance(v, dict) else v)
                 for k, v in overrides.items()})
    with plane.client() as client:
        job = client.submit(spec)
        final = client.wait(job.id, timeout=180)
        events = client.events(job.id)
    assert final.state is JobState.FAILED, explain(client, job.id)
    assert final.reason == "user_code_error"
    assert final.attempt == 1 and not any(e.to_state == "RESTARTING" for e in events), explain(client, job.id)
    assert expected in final.message and len(final.message) < 2000, final.message


def running_with_metrics(client, job_id: str, min_rows: int = 1, attempt: int = 1):
    """The job once it is RUNNING and has stored ``min_rows`` metric rows of ``attempt``."""
    job = client.get(job_id)
    if job.state in (JobState.FAILED, JobState.SUCCEEDED, JobState.CANCELLED):
        raise AssertionError(f"job ended early: {job.state.value}\n{explain(client, job_id)}")
    return job.state is JobState.RUNNING and len(client.metrics(job_id, attempt=attempt)) >= min_rows and job


def stop_while_training(plane, steps: int) -> str:
    """Submit a ``steps``-step nano job, wait until it trains, then stop ``plane`` (app,
    scheduler, launcher) under it; the job's id. The outage tests start from here."""
    with plane.client() as client:
        job = client.submit(nano_job(steps))
        wait_for(lambda: running_with_metrics(client, job.id, min_rows=4), 180, "the job to train")
    plane.stop()
    return job.id


def test_cancel_of_a_running_job_stops_its_ray_processes_within_15_s(make_control_plane):
    plane = make_control_plane()
    with plane.client() as client:
        job = client.submit(nano_job(5000))
        wait_for(lambda: running_with_metrics(client, job.id), 180, "the job to run")
        assert train_workers(job.id), "expected the job's Ray Train workers to be alive"
        asked = time.monotonic()
        client.cancel(job.id)
        final = client.wait(job.id, timeout=15)
        took = time.monotonic() - asked
        assert final.state is JobState.CANCELLED and took < 15, took
        wait_for(lambda: not job_processes_but_the_cleaner(job.id), asked + 15 - time.monotonic(),
                 "no process of the job to be left 15 s after the cancel", poll_s=0.1,
                 describe=lambda: describe(job_processes_but_the_cleaner(job.id)))
        wait_for(lambda: not job_owned_processes(job.id), 120, "Ray Train's placement-group cleaner to exit",
                 describe=lambda: describe(job_owned_processes(job.id)))
        assert [e.to_state for e in client.events(job.id)][-2:] == [JobState.CANCELLING, JobState.CANCELLED]


def _head_reports_cpus(head) -> bool:
    from service.launchers.ray_jobs import capacity_from_usage

    answer = httpx.get(f"{head.dashboard_url}/api/cluster_status", headers=head.auth_headers, timeout=10)
    usage = answer.json()["data"]["clusterStatus"]["loadMetricsReport"]["usage"] if answer.is_success else {}
    return capacity_from_usage(usage).cpus is not None


def test_jobs_larger_than_a_fixed_cluster_are_refused_at_submit_with_the_numbers(make_control_plane, ray_head):
    wait_for(lambda: _head_reports_cpus(ray_head), 60, "the Ray head to report its CPUs")
    plane = make_control_plane()  # the module's head: 2 CPUs, no GPU, no autoscaling
    with plane.client() as client:
        for resources, fragment in (({"num_workers": 2, "cpus_per_worker": 2}, "lacks 4 CPUs (has 2)"),
                                    ({"num_workers": 2, "gpus_per_worker": 1}, "lacks 2 GPUs (has 0)")):
            with pytest.raises(ValidationFailed) as refused:
                client.submit(nano_job(10, resources=resources))
            assert refused.value.status == 422 and fragment in str(refused.value), str(refused.value)
            assert refused.value.errors[0]["field"] == "resources.num_workers"
        assert client.list().items == []  # nothing was stored


def test_jobs_asking_more_cpus_or_gpus_than_the_cluster_has_say_so_with_the_numbers(make_control_plane):
    plane = make_control_plane(cluster_autoscales=True)  # today's totals are no bound: Ray says what it waits for
    with plane.client() as client:
        cpu_job = client.submit(nano_job(10, resources={"num_workers": 2, "cpus_per_worker": 2}))
        gpu_job = client.submit(nano_job(10, resources={"num_workers": 2, "gpus_per_worker": 1}))

        def waiting_event(job_id: str):
            return next((e for e in client.events(job_id) if e.reason == "insufficient_resources"), None)

        cpu_event = wait_for(lambda: waiting_event(cpu_job.id), 120, "the CPU job's insufficient_resources event")
        gpu_event = wait_for(lambda: waiting_event(gpu_job.id), 60, "the GPU job's insufficient_resources event")
        for job in (cpu_job, gpu_job):
            waiting = client.get(job.id)
            assert waiting.state in (JobState.QUEUED, JobState.STARTING)
            assert waiting.reason == "insufficient_resources"
        assert "asked 4 CPU (2 workers × 2 CPU)" in cpu_event.message
        assert "2 CPU in total" in cpu_event.message and "available" in cpu_event.message
        assert "asked 2 CPU, 2 GPU (2 workers × 1 CPU, 1 GPU)" in gpu_event.message
        assert "0 GPU in total" in gpu_event.message
        for job in (cpu_job, gpu_job):
            client.cancel(job.id)
        for job in (cpu_job, gpu_job):
            assert client.wait(job.id, timeout=30).state is JobState.CANCELLED
            wait_for(lambda: not job_owned_processes(job.id), 15, "the waiting job's processes to exit",
                     describe=lambda: describe(job_owned_processes(job.id)))


def test_killing_a_worker_restarts_the_group_and_the_job_still_succeeds(make_control_plane):
    steps = 30
    plane = make_control_plane()
    with plane.client() as client:
        job = client.submit(nano_job(steps, max_failures=1))
        wait_for(lambda: running_with_metrics(client, job.id, min_rows=4), 180, "the first attempt to train")
        victim = train_workers(job.id)[-1]
        os.kill(victim, signal.SIGKILL)
        final = client.wait(job.id, timeout=300)
        assert final.state is JobState.SUCCEEDED, explain(client, job.id)
        assert final.attempt == 2
        events = client.events(job.id)
        transitions = [(e.to_state, e.attempt) for e in events]
        restart = transitions.index((JobState.RESTARTING, 2))
        assert (JobState.RUNNING, 2) in transitions[restart:], transitions
        assert events[restart].reason == "worker_failed" and "rank" in events[restart].message
        second = client.metrics(job.id, attempt=2)
        assert sorted((r.rank, r.step) for r in second) == [(k, s) for k in (0, 1) for s in range(1, steps + 1)]


def test_a_control_plane_down_for_ten_seconds_loses_no_metric_rows(make_control_plane):
    steps = 100
    plane = make_control_plane()
    job_id = stop_while_training(plane, steps)
    down, up = time.time(), time.time() + 10
    time.sleep(10)  # the outage itself: workers keep training and buffering meanwhile
    plane.start()
    with plane.client() as client:
        final = client.wait(job_id, timeout=300)
        assert final.state is JobState.SUCCEEDED, explain(client, job_id)
        rows = client.metrics(job_id)
    keys = [(r.rank, r.step) for r in rows]
    assert len(keys) == len(set(keys)) == 2 * steps
    assert sorted(keys) == [(k, s) for k in (0, 1) for s in range(1, steps + 1)]
    trained_while_down = [r for r in rows if down < r.time < up]
    assert {r.rank for r in trained_while_down} == {0, 1}, "the outage should fall in the middle of training"
