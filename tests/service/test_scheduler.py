"""Must-show 5 and the scheduler's reconciling: claims are exclusive, launcher reports map onto
job states without overriding the driver, and waiting jobs say why (once)."""

from __future__ import annotations

import threading
from collections import Counter

from sqlalchemy import select

from service.launchers.base import LaunchHandle, LaunchPhase, LaunchRequest, LaunchStatus
from service.models import Job, JobEvent
from service.scheduler import Scheduler
from service.schemas import JobState
from service.states import transition

from service.admission import Capacity
from tests.helpers.service_specs import make_spec


class RecordingLauncher:
    """Counts starts per job and reports whatever status a test sets."""

    name = "recording"

    def __init__(self):
        self.lock = threading.Lock()
        self.starts: Counter[str] = Counter()
        self.cancelled: list[str] = []
        self.released: list[str] = []
        self.phase = LaunchStatus(LaunchPhase.RUNNING)
        self.cluster = Capacity()  # unknown unless a test sets it

    def start(self, request: LaunchRequest) -> LaunchHandle:
        with self.lock:
            self.starts[request.job_id] += 1
        return LaunchHandle(self.name, request.job_id)

    def status(self, handle: LaunchHandle) -> LaunchStatus:
        return self.phase

    def cancel(self, handle: LaunchHandle) -> None:
        self.cancelled.append(handle.external_id)
        self.phase = LaunchStatus(LaunchPhase.STOPPED)

    def release(self, handle: LaunchHandle) -> None:
        self.released.append(handle.external_id)

    def logs(self, handle: LaunchHandle, tail_bytes: int | None = None) -> str:
        return ""

    def capacity(self) -> Capacity:
        return self.cluster

    def close(self) -> None:
        pass


def add_jobs(make_session, count: int) -> list[str]:
    from service.models import utcnow

    ids = [f"job-{i:04d}" for i in range(count)]
    with make_session() as session:
        for job_id in ids:
            session.add(Job(id=job_id, name="t", owner="u", state="QUEUED", attempt=0, spec=make_spec(),
                            created_at=utcnow(), updated_at=utcnow()))
        session.commit()
    return ids


def job(make_session, job_id: str) -> Job:
    with make_session() as session:
        return session.execute(select(Job).where(Job.id == job_id)).scalar_one()


def move(make_session, job_id: str, state: JobState, reason: str | None = None) -> None:
    """What the API or the driver does to a job between two scheduler passes: one committed transition."""
    with make_session() as session:
        transition(session, job_id, state, reason=reason)
        session.commit()


def test_two_scheduler_loops_never_start_the_same_job_twice(db):
    make_session, settings = db
    settings = settings.model_copy(update={"max_running_jobs": None})  # all 60 may run at once
    ids = add_jobs(make_session, 60)
    launcher = RecordingLauncher()
    schedulers = [Scheduler(make_session, launcher, settings, claim_batch=3) for _ in range(2)]
    barrier = threading.Barrier(2)

    def drain(scheduler: Scheduler) -> None:
        barrier.wait()
        while True:
            claimed = scheduler.claim()
            if not claimed:
                with make_session() as session:
                    if not session.execute(select(Job.id).where(Job.state == "QUEUED")).first():
                        return
            for job_id, token in claimed:
                scheduler.launch(job_id, token)

    threads = [threading.Thread(target=drain, args=(s,)) for s in schedulers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert launcher.starts == Counter({job_id: 1 for job_id in ids})
    with make_session() as session:
        claimers = Counter(session.execute(select(Job.claimed_by)).scalars())
        starting_events = session.execute(select(JobEvent.job_id).where(JobEvent.to_state == "STARTING")).scalars()
        assert sorted(starting_events) == ids
    assert set(claimers) == {s.identity for s in schedulers}  # both loops did work


def scheduled_job(db, phase: LaunchStatus, state: JobState = JobState.RUNNING):
    make_session, settings = db
    (job_id,) = add_jobs(make_session, 1)
    launcher = RecordingLauncher()
    scheduler = Scheduler(make_session, launcher, settings)
    scheduler.run_once()
    if state is not JobState.STARTING:
        move(make_session, job_id, state)
    launcher.phase = phase
    return make_session, scheduler, launcher, job_id


def test_launcher_failure_of_a_running_job_fails_it_with_a_reason_and_stops_its_remains(db):
    make_session, scheduler, launcher, job_id = scheduled_job(db, LaunchStatus(LaunchPhase.FAILED))
    scheduler.run_once()
    scheduler.stop()  # joins the clean-up it started
    failed = job(make_session, job_id)
    assert (failed.state, failed.reason) == ("FAILED", "worker_failed")
    assert launcher.released == [job_id], "what the dead driver started must be stopped too"


def test_vanished_driver_is_driver_lost_and_stopped(db):
    make_session, scheduler, launcher, job_id = scheduled_job(db, LaunchStatus(LaunchPhase.UNKNOWN))
    scheduler.run_once()
    scheduler.stop()
    assert (job(make_session, job_id).state, job(make_session, job_id).reason) == ("FAILED", "driver_lost")
    assert launcher.released == [job_id]


def test_a_clean_up_that_fails_is_logged_and_the_job_stays_failed(db, caplog):
    make_session, scheduler, launcher, job_id = scheduled_job(db, LaunchStatus(LaunchPhase.FAILED))

    def unreachable(handle: LaunchHandle) -> None:
        raise RuntimeError("cluster unreachable")

    launcher.release = unreachable
    scheduler.run_once()
    scheduler.stop()
    assert job(make_session, job_id).state == "FAILED"
    assert f"stopping the remains of failed job {job_id} failed" in caplog.text


def test_driver_reported_state_is_not_overridden(db):
    make_session, scheduler, launcher, job_id = scheduled_job(db, LaunchStatus(LaunchPhase.SUCCEEDED))
    move(make_session, job_id, JobState.FAILED, reason="user_code_error")
    scheduler.run_once()
    scheduler.stop()
    assert (job(make_session, job_id).state, job(make_session, job_id).reason) == ("FAILED", "user_code_error")
    assert launcher.released == []  # a driver that reported its own end has cleaned up after itself


def test_waiting_for_resources_is_recorded_once_and_so_is_its_end(db):
    waiting = LaunchStatus(LaunchPhase.PENDING, "insufficient_resources", "asked 8 CPUs, cluster has 2")
    make_session, scheduler, _, job_id = scheduled_job(db, waiting, state=JobState.STARTING)
    for _ in range(3):
        scheduler.run_once()
    pending = job(make_session, job_id)
    assert (pending.state, pending.reason, pending.message) == (
        "STARTING", "insufficient_resources", "asked 8 CPUs, cluster has 2")
    with make_session() as session:
        reasons = session.execute(select(JobEvent.reason).where(JobEvent.job_id == job_id)).scalars().all()
    assert reasons.count("insufficient_resources") == 1

    scheduler.launcher.phase = LaunchStatus(LaunchPhase.RUNNING)
    scheduler.run_once()
    scheduler.run_once()
    assert job(make_session, job_id).reason == "resources_acquired"
    with make_session() as session:
        reasons = session.execute(select(JobEvent.reason).where(JobEvent.job_id == job_id)).scalars().all()
    assert reasons[-2:] == ["insufficient_resources", "resources_acquired"]


def test_cancelling_job_is_stopped_through_the_launcher(db):
    make_session, scheduler, launcher, job_id = scheduled_job(db, LaunchStatus(LaunchPhase.RUNNING))
    move(make_session, job_id, JobState.CANCELLING, reason="cancelled_by_user")
    scheduler.run_once()
    assert launcher.cancelled == [job_id]
    cancelled = job(make_session, job_id)
    assert (cancelled.state, cancelled.reason) == ("CANCELLED", "cancelled_by_user")
    assert cancelled.ingest_token_hash is None


def test_launch_failure_fails_the_job(db):
    make_session, settings = db
    (job_id,) = add_jobs(make_session, 1)
    launcher = RecordingLauncher()
    launcher.start = lambda request: (_ for _ in ()).throw(RuntimeError("no cluster"))
    Scheduler(make_session, launcher, settings).run_once()
    failed = job(make_session, job_id)
    assert (failed.state, failed.reason, failed.message) == ("FAILED", "launch_failed", "RuntimeError: no cluster")


def test_job_over_its_max_runtime_is_cancelled_with_that_reason(db):
    from datetime import timedelta

    from sqlalchemy import update

    from service.models import utcnow

    make_session, scheduler, launcher, job_id = scheduled_job(db, LaunchStatus(LaunchPhase.RUNNING))
    with make_session() as session:
        spec = {**make_spec(), "max_runtime_s": 60}
        session.execute(update(Job).where(Job.id == job_id)
                        .values(spec=spec, started_at=utcnow() - timedelta(seconds=61)))
        session.commit()
    scheduler.run_once()
    assert job(make_session, job_id).state == "CANCELLING"
    scheduler.run_once()
    stopped = job(make_session, job_id)
    assert (stopped.state, stopped.reason) == ("CANCELLED", "max_runtime_exceeded")
    assert launcher.cancelled == [job_id]


def test_claim_abandoned_before_launch_fails_after_the_launch_timeout(db):
    from datetime import timedelta

    from sqlalchemy import update

    from service.models import utcnow

    make_session, settings = db
    (job_id,) = add_jobs(make_session, 1)
    scheduler = Scheduler(make_session, RecordingLauncher(), settings)
    assert [claimed for claimed, _ in scheduler.claim()] == [job_id]  # ... and the process dies here
    scheduler.reconcile()
    assert job(make_session, job_id).state == "STARTING"
    with make_session() as session:
        session.execute(update(Job).where(Job.id == job_id).values(
            updated_at=utcnow() - timedelta(seconds=settings.launch_timeout_s + 1)))
        session.commit()
    scheduler.reconcile()
    failed = job(make_session, job_id)
    assert (failed.state, failed.reason) == ("FAILED", "launch_failed")


def test_admission_starts_jobs_in_order_as_capacity_frees_and_says_why_the_rest_wait(db):
    make_session, settings = db
    ids = add_jobs(make_session, 4)  # 2 workers × 1 CPU each (make_spec)
    launcher = RecordingLauncher()
    launcher.cluster = Capacity(cpus=2)
    scheduler = Scheduler(make_session, launcher, settings)
    assert [job_id for job_id, _ in scheduler.claim()] == ["job-0000"]
    assert scheduler.claim() == []  # job-0000 holds both CPUs while it is STARTING
    first_waiting = job(make_session, "job-0001")
    assert first_waiting.reason == "insufficient_resources" and "free now 0 CPUs of 2 CPUs" in first_waiting.message
    assert "behind a job ahead of it" in job(make_session, "job-0002").message
    move(make_session, "job-0000", JobState.RUNNING)
    move(make_session, "job-0000", JobState.SUCCEEDED)
    assert [job_id for job_id, _ in scheduler.claim()] == ["job-0001"]
    with make_session() as session:  # one notice per distinct reason, not one per pass
        notices = session.execute(select(JobEvent).where(JobEvent.job_id == "job-0003",
                                                         JobEvent.from_state == JobEvent.to_state)).scalars().all()
    assert len(notices) == 1
    assert ids[:2] == ["job-0000", "job-0001"]


def test_each_launch_under_a_file_root_writes_a_new_storage_marker_and_tells_the_job_its_nonce(db):
    """Issue 19: the control plane proves a file:// root is shared (storage.shared)."""
    import json

    from service.launchers.driver import STORAGE_MARKER_ENV, job_environment
    from storage.shared import check_marker

    make_session, settings = db
    (job_id,) = add_jobs(make_session, 1)
    launcher = RecordingLauncher()
    requests: list[LaunchRequest] = []
    launcher.start = lambda request: requests.append(request) or LaunchHandle(launcher.name, request.job_id)
    Scheduler(make_session, launcher, settings).run_once()
    (request,) = requests
    marker = settings.home / "storage" / job_id / "storage-marker.json"
    assert settings.storage_uri == f"file://{settings.home / 'storage'}"
    assert json.loads(marker.read_text())["nonce"] == request.storage_marker
    assert job_environment(request)[STORAGE_MARKER_ENV] == request.storage_marker
    check_marker(settings.storage_uri, job_id, request.storage_marker)  # what every rank does first

