"""Fault: the S3 server is unavailable while a checkpoint uploads.

A real moto S3 server (its own, on a free port) that is stopped mid-run and started again;
the production storage client (s3fs/botocore) speaks to it over HTTP. The upload is tried
exactly ``upload_attempts`` times, then that checkpoint is reported failed (to the control
plane's ``report_failure``, in ``CheckpointManager.failed_saves`` and an error log) and
training continues; no partial shard is left as an object, the previous checkpoint stays the
latest and loads intact, and the next checkpoint after the outage commits. An outage that
ends between two attempts costs nothing: the retry commits. (The same fault through a whole
Ray job and the control plane: ``test_s3_outage_ray.py``.)
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from tests.helpers.waiting import wait_for
from tests.workers.checkpoint.ranks import GLOBAL_BATCH, MICRO, SEQ, VOCAB, make_engine
from workers.checkpoint import CheckpointManager, checkpoints_uri
from storage.manifest import committed_steps
from storage.storage import Storage
from workers.data import ShardedBatchLoader, SyntheticDataset

pytestmark = pytest.mark.faults


class S3Server:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.up = False

    def start(self) -> None:
        self.server.start()
        self.up = True

    def stop(self) -> None:
        self.server.stop()
        self.up = False

    def use_in(self, env: pytest.MonkeyPatch) -> None:
        """Point ``storage.storage`` in this process (and the processes it starts)
        at this server, with test credentials and no AWS profile or session token.

        botocore's own retries are off (``AWS_MAX_ATTEMPTS=1``): an attempt against a stopped
        server then fails in about a second, and the retries counted are the product's
        (``workers.checkpointing.writer``)."""
        for name, value in {"ZEROTRAIN_S3_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing",
                            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                            "AWS_MAX_ATTEMPTS": "1"}.items():
            env.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
            env.delenv(name, raising=False)

    def create_bucket(self, name: str) -> None:
        import boto3

        self.bucket = name
        boto3.client("s3", endpoint_url=self.url, region_name="us-east-1").create_bucket(Bucket=name)


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    server = S3Server()
    server.start()
    server.use_in(monkeypatch)
    server.create_bucket(f"zt-{uuid.uuid4().hex[:12]}")
    try:
        yield server
    finally:
        if server.up:
            server.stop()


def train(engine, loader, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        for x, y in loader.next_batch():
            loss = engine(x, y) / loader.accumulation_steps
            engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def training(s3: S3Server, job_id: str, **manager_options):
    """An engine, its loader, and a manager saving to ``job_id``'s checkpoints in the bucket,
    whose failure reports land in the returned list."""
    torch.set_num_threads(1)
    engine = make_engine(2, seed=0)
    loader = ShardedBatchLoader(SyntheticDataset(VOCAB, SEQ), global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO)
    uri = checkpoints_uri(f"s3://{s3.bucket}", job_id)
    reported: list[tuple[int, str]] = []
    manager = CheckpointManager(uri, job_id=job_id, report_failure=lambda step, error: reported.append((step, error)),
                                **manager_options)
    return engine, loader, uri, manager, reported


def test_an_upload_during_an_s3_outage_fails_alone_and_training_continues(s3, caplog):
    engine, loader, uri, manager, reported = training(s3, "s3-outage", keep_last=5, upload_attempts=3)
    caplog.set_level(logging.WARNING, logger="workers.checkpointing.writer")
    try:
        train(engine, loader, 1)
        manager.save(1, engine, loader, wait=True)
        at_step_1 = {k: v.clone() for k, v in engine.full_state_dict().items()}
        assert committed_steps(Storage.at(uri)) == [1]

        s3.stop()
        started = time.monotonic()
        manager.save(2, engine, loader)  # uploads in the background, into the outage
        trained = train(engine, loader, 2)  # training goes on meanwhile
        wait_for(lambda: manager.writer._thread is not None and not manager.writer._thread.is_alive(), 120,
                 "the upload during the outage to give up")
        gave_up_after = time.monotonic() - started
        s3.start()

        assert committed_steps(Storage.at(uri)) == [1], "the failed checkpoint must not be committed"
        assert Storage.at(uri).list_files("step_00000002") == [], "a partial shard was left as an object"
        retries = [r for r in caplog.records if "retrying in" in r.getMessage()]
        assert [r.getMessage().split("(attempt ")[1][:6] for r in retries] == ["1 of 3", "2 of 3"]
        assert [step for step, _ in reported] == [2], "the control plane hears of the failure at once"
        assert "gave up after 3 attempts" in reported[0][1], reported
        with caplog.at_level(logging.ERROR, logger="workers.checkpoint"):
            manager.save(4, engine, loader, wait=True)  # reports step 2's failure, then saves step 4
        trained += train(engine, loader, 1)
        assert len(manager.failed_saves) == 1 and "step 2 not committed" in manager.failed_saves[0]
        assert "training continues" in caplog.text and "step 2" in caplog.text
        assert committed_steps(Storage.at(uri)) == [1, 4]
        assert len(trained) == 3 and all(loss == loss for loss in trained)
    finally:
        manager.close()

    fresh = make_engine(1, seed=3)  # the checkpoint from before the outage is intact
    CheckpointManager(uri, job_id="s3-outage").load(fresh, step=1)
    for key, value in at_step_1.items():
        assert torch.equal(fresh.full_state_dict()[key], value), key
    print(f"\nS3 outage: upload gave up after {gave_up_after:.1f} s; committed {committed_steps(Storage.at(uri))}")


def test_an_outage_that_ends_between_attempts_costs_nothing(s3, caplog):
    engine, loader, uri, manager, reported = training(s3, "s3-blip", upload_attempts=3)
    manager.writer.first_retry_delay_s = 5.0  # room to bring the server back before the second attempt
    caplog.set_level(logging.WARNING, logger="workers.checkpointing.writer")
    try:
        train(engine, loader, 1)
        s3.stop()
        manager.save(1, engine, loader)
        wait_for(lambda: any("attempt 1 of 3" in r.getMessage() for r in caplog.records), 120,
                 "the first attempt to fail")
        s3.start()
        report = manager.wait()
    finally:
        manager.close()
    assert report.committed and report.attempts == 2, report
    assert reported == [] and manager.failed_saves == []
    assert committed_steps(Storage.at(uri)) == [1]
    fresh = make_engine(1, seed=3)
    CheckpointManager(uri, job_id="s3-blip").load(fresh)
    for key, value in engine.full_state_dict().items():
        assert torch.equal(fresh.full_state_dict()[key], value), key


def test_the_last_save_of_a_run_given_up_fails_the_attempt(s3):
    """The run's final checkpoint is its product: the loop waits for it, and a job must not
    report success without it (the attempt fails; max_failures may retry it from the latest)."""
    from workers.checkpoint import CheckpointError, TrainCheckpointHook

    engine, loader, _, manager, reported = training(s3, "s3-last", every_steps=100, upload_attempts=1)
    hook = TrainCheckpointHook(manager, total_steps=2)
    try:
        train(engine, loader, 2)
        s3.stop()
        assert hook.maybe_save(1, engine, loader) == 0.0  # not due: nothing written, nothing waited for
        hook.maybe_save(2, engine, loader)  # started; the loop reports the step's record, then waits:
        with pytest.raises(CheckpointError, match="step 2 not committed.*gave up after 1 attempt"):
            hook.finish()
    finally:
        hook.close()
    assert [step for step, _ in reported] == [2]
