"""The checkpoint hook inside ``workers.train.train_loop`` (local Gloo worlds, a live control plane).

A job trains on two ranks with ``checkpoint.every_steps=2`` and fails at step 6 (its data
raises); its checkpoints are registered with the control plane and listed by
``GET /api/v1/jobs/{id}/checkpoints``. Run again under the same job id -- a restarted attempt
-- it resumes from its latest committed checkpoint and its losses continue exactly those of
an uninterrupted run. A new job with ``resume_from: {job_id, step: 2}`` starts from step 2.
Ranks killed outright the moment a checkpoint is committed have delivered the metric record
of every step up to it: a resumed attempt never trains those steps again.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from storage.manifest import committed_steps, read_manifest
from storage.storage import Storage
from workers.loop_config import LoopConfig
from workers.train import run_local

REPO = str(Path(__file__).resolve().parents[3])  # the factories are imported by name in the ranks
STEPS = 8
SPEC = {
    "name": "hooked",
    "model": {"factory": "tests.workers.checkpoint.job_parts:tiny_gpt"},
    "data": {"factory": "tests.workers.checkpoint.job_parts:flaky_data", "kwargs": {}, "seq_len": 8},
    "train": {"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 2,
              "weight_decay": 0.1, "grad_clip": 1.0, "seed": 0},
    "zero": {"stage": 2, "precision": "fp32", "bucket_mb": 0.001},
    "resources": {"num_workers": 2},
    "checkpoint": {"every_steps": 2, "keep_last": 2, "uri": None},
    "max_failures": 1,
}
SAMPLES_PER_RANK_AND_STEP = 8 // 2


def spec_with(**changes) -> dict:
    spec = copy.deepcopy(SPEC)
    for key, value in changes.items():
        spec[key] = {**spec[key], **value} if isinstance(spec.get(key), dict) else value
    return spec


def test_restarted_attempt_and_resume_from(make_live_service, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(REPO)  # spawned ranks inherit sys.path
    storage = f"file://{tmp_path}/storage"
    service = make_live_service(scheduler_enabled=False, storage_uri=storage)
    client = service.client()
    job_id = client.submit(spec_with(data={"kwargs": {}})).id
    (_, ingest), = service.app.state.scheduler.claim()
    monkeypatch.setenv("ZEROTRAIN_INGEST_TOKEN", ingest)

    failing = spec_with(data={"kwargs": {"fail_after": 5 * SAMPLES_PER_RANK_AND_STEP,
                                         "marker": str(tmp_path / "failed-once")}})
    with pytest.raises(mp.ProcessRaisedException, match="injected worker failure"):
        run_local(LoopConfig(spec=failing, job_id=job_id, api_url=service.url, storage_uri=storage), 2)

    checkpoints = Storage.at(f"{storage}/{job_id}/checkpoints")
    saved = committed_steps(checkpoints)
    assert saved in ([2, 4], [2])  # step 4's upload may have been cut short by the failure
    listed = client.checkpoints(job_id)
    assert [c.step for c in listed] == saved
    manifest = read_manifest(checkpoints.child(f"step_{saved[-1]:08d}"))
    assert (listed[-1].world_size, listed[-1].stage) == (2, 2) == (manifest["world_size"], manifest["stage"])
    assert listed[-1].uri == checkpoints.child(f"step_{saved[-1]:08d}").uri

    # the restarted attempt: same job, new process group, no control plane this time
    resumed = run_local(LoopConfig(spec=failing, job_id=job_id, api_url=None, storage_uri=storage), 2)
    straight = run_local(LoopConfig(spec=SPEC, job_id="straight", api_url=None, storage_uri=None), 2)
    for rank in range(2):
        assert len(resumed[rank]["losses"]) == STEPS - saved[-1]  # no step lost or repeated
        assert resumed[rank]["losses"] == pytest.approx(straight[rank]["losses"][saved[-1]:], rel=1e-6)
    assert committed_steps(checkpoints) == [6, 8]  # keep_last=2, and the final step is saved

    # a new job that starts from another job's checkpoint
    child = run_local(LoopConfig(spec=spec_with(resume_from={"job_id": job_id, "step": 6}), job_id="child",
                                  api_url=None, storage_uri=storage), 2)
    assert len(child[0]["losses"]) == STEPS - 6
    assert child[0]["losses"] == pytest.approx(straight[0]["losses"][6:], rel=1e-6)


def test_ranks_killed_right_after_a_commit_delivered_every_step_up_to_it(make_live_service, tmp_path, monkeypatch):
    """A node lost just after a commit: the steps at or before the checkpoint are never trained
    again, so their records must be stored already. Before the fix, the commit did not wait
    for them and the last ones died in the ranks' buffers (``workers.reporting``)."""
    monkeypatch.syspath_prepend(REPO)
    storage = f"file://{tmp_path}/storage"
    service = make_live_service(scheduler_enabled=False, storage_uri=storage)
    client = service.client()
    job_id = client.submit(SPEC).id
    (_, ingest), = service.app.state.scheduler.claim()
    monkeypatch.setenv("ZEROTRAIN_INGEST_TOKEN", ingest)
    manifest = tmp_path / "storage" / job_id / "checkpoints" / "step_00000004" / "manifest.json"
    dying = spec_with(data={"factory": "tests.workers.checkpoint.job_parts:dies_after_commit",
                            "kwargs": {"after": 4 * SAMPLES_PER_RANK_AND_STEP, "manifest": str(manifest)}})
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        run_local(LoopConfig(spec=dying, job_id=job_id, api_url=service.url, storage_uri=storage), 2)
    assert manifest.exists()
    stored = {(m.rank, m.step) for m in client.metrics(job_id)}
    assert {(rank, step) for rank in (0, 1) for step in range(1, 5)} <= stored
