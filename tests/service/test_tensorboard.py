"""Issue 33, Must show 2: every job's TensorBoard event files hold one value per step.

The files are read back by ``tests.helpers.tensorboard_files`` (a TFRecord reader checking every
checksum, and tensorboardX's ``Event`` proto), independently of the exporter's writer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from service import tensorboard
from service.cli import main
from service.db import make_engine, make_sessionmaker
from service.models import Job, Metric, UserMetric, utcnow
from service.schemas import JobState
from tests.helpers.service_specs import FAKE_DRIVER, make_spec
from tests.helpers.tensorboard_files import f32, rank_mean_loss, read_scalars


# ----------------------------------------------------------------------------- the exporter over rows


@pytest.fixture
def db(migrated_postgres_url):
    engine = make_engine(migrated_postgres_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def add_rows(make_session, job_id: str, attempt: int, ranks: tuple[int, ...], steps: range) -> None:
    with make_session() as session:
        for step in steps:
            for rank in ranks:
                session.add(Metric(job_id=job_id, attempt=attempt, rank=rank, step=step, time=1000.0 + step,
                                   world_size=2, loss=10.0 * attempt + step + rank / 4, lr=1e-3, grad_norm=0.5,
                                   tokens_per_s=100.0 + rank, mem_peak_bytes=1e6 * (rank + 1), comm_bytes=2e6))
                session.add(UserMetric(job_id=job_id, attempt=attempt, rank=rank, step=step, name="acc",
                                       value=0.1 * rank + attempt))
        session.commit()


def set_state(make_session, job_id: str, state: JobState) -> None:
    with make_session() as session:
        session.execute(Job.__table__.update().where(Job.__table__.c.id == job_id).values(state=state.value))
        session.commit()


def export(make_session, storage: str, job_id: str) -> int:
    with make_session() as session:
        return tensorboard.export_job(session, storage, job_id)


def test_a_running_then_resumed_then_finished_job_writes_each_step_once(db, tmp_path):
    storage, job_id = f"file://{tmp_path}", "job-tb"
    with db() as session:
        session.add(Job(id=job_id, name="t", owner="u", state="RUNNING", attempt=1, spec=make_spec(),
                        created_at=utcnow(), updated_at=utcnow()))
        session.commit()
    add_rows(db, job_id, 1, (0, 1), range(1, 5))
    add_rows(db, job_id, 1, (0,), range(5, 6))  # rank 1 has not reported step 5 yet
    assert export(db, storage, job_id) == 1
    log_dir = Path(tensorboard.log_dir(storage, job_id))
    scalars = read_scalars(log_dir)
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert scalars["train/loss"][0] == (1, f32((11.0 + 11.25) / 2))
    assert scalars["train/tokens_per_s"][0] == (1, f32((100.0 * 2 + 101.0 * 2) / 2))  # the job's total
    assert scalars["user/acc"][0] == (1, f32((1.0 + 1.1) / 2))
    assert scalars["rank1/mem_peak_bytes"][0] == (1, 2e6)
    assert export(db, storage, job_id) == 0  # nothing new: no file

    # attempt 1 dies after rank 1's step 5; attempt 2 resumes from the checkpoint of step 3
    add_rows(db, job_id, 1, (1,), range(5, 6))
    add_rows(db, job_id, 2, (0, 1), range(4, 8))
    add_rows(db, job_id, 2, (0,), range(8, 9))  # rank 1 dies before step 8 and the job fails
    assert export(db, storage, job_id) == 1
    set_state(db, job_id, JobState.FAILED)
    assert export(db, storage, job_id) == 1  # a finished job's partial step is written too
    assert export(db, storage, job_id) == 0
    with db() as session:
        job = session.execute(select(Job).where(Job.id == job_id)).scalar_one()
        assert (job.tensorboard_step, job.tensorboard_done) == (8, True)

    scalars = read_scalars(log_dir)
    assert [step for step, _ in scalars["train/loss"]] == list(range(1, 9))  # each step once
    loss = dict(scalars["train/loss"])
    assert loss[4] == f32(14.125) and loss[5] == f32(25.125)  # step 4 as first written; 5 from attempt 2
    assert loss[8] == f32(28.0)  # rank 0 alone
    assert dict(scalars["user/acc"])[7] == f32(2.05)
    assert len(list(log_dir.glob("*tfevents*"))) == 3


# ----------------------------------------------------------------------------- end to end


def test_a_two_rank_job_event_files_equal_the_metrics_api_rank_mean(make_live_service, capsys, monkeypatch):
    service = make_live_service(local_entrypoint=FAKE_DRIVER, tensorboard_export_s=0.1)
    client = service.client()
    job = client.submit({**make_spec(ranks=2), "train": {**make_spec()["train"], "steps": 30}})
    assert client.wait(job.id, timeout=120).state is JobState.SUCCEEDED
    deadline = time.monotonic() + 60
    while not client.tensorboard(job.id).complete:
        assert time.monotonic() < deadline, client.tensorboard(job.id)
        time.sleep(0.1)

    points = client.metrics(job.id)
    assert sorted((p.rank, p.step) for p in points) == [(r, s) for r in (0, 1) for s in range(30)]
    where = client.tensorboard(job.id)
    assert read_scalars(Path(where.logdir))["train/loss"] == rank_mean_loss(points)
    assert where.step == 29

    monkeypatch.setenv("ZEROTRAIN_URL", service.url)
    monkeypatch.setenv("ZEROTRAIN_TOKEN", service.admin_token)
    assert main(["tensorboard", job.id]) == 0
    assert capsys.readouterr().out == where.logdir + "\n"
    assert main(["tensorboard", job.id, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == where.model_dump(mode="json")
