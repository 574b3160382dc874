"""The scheduler: claims QUEUED jobs, hands them to the launcher, reconciles what it reports.

Claiming locks candidate rows with ``SELECT … FOR UPDATE SKIP LOCKED`` (PostgreSQL), so two
control planes never pick the same job; the claim itself is the conditional QUEUED→STARTING
transition of ``service.states``, which also keeps SQLite (no row locks) exclusive.

Reconciling maps ``LaunchPhase`` onto job states without overriding what the driver already
reported: a job the driver finished is left alone, a job whose driver vanished fails with a
reason, a job waiting for resources says why (once, not on every poll), and CANCELLING jobs
are stopped through the launcher and then marked CANCELLED.

[Note: a failed job is released too]
When the launcher itself reports a job FAILED, STOPPED or gone, the job's driver has exited
but what it started may not have (Ray Train's controller and workers). The scheduler then
calls ``launcher.release``, which frees what is left and keeps the logs (Ray: stop the job;
local: end the process group; KubeRay: nothing, KubeRay tears the cluster down itself). That
runs in its own thread: a launcher's bounded wait for processes to go must not stall
reconciling other jobs.

[Note: replicas] With several replicas, only the holder of the leader lease
(``service.leadership``) runs passes, and every write a pass makes is fenced: its transaction
opens with ``lease.begin`` and ends with ``lease.commit``, which check in that transaction that
the lease is still this replica's. A leader paused past its lease that resumes mid-pass gets
``LeadershipLost`` instead of admitting, launching or moving a job. Launching is also checked
just before the launcher is called; and the Ray launcher names a submission after the job and
its attempt, so a second start of the same attempt is refused by Ray itself.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from contract.reasons import Reason
from service import admission, metric_retention, preemption, preemption_notes, quotas, tensorboard
from service.auth import INGEST_TOKEN_PREFIX, hash_token, new_token
from service.code_package_retention import delete_unused_packages
from service.launchers.base import (
    Launcher,
    LaunchHandle,
    LaunchPhase,
    LaunchRequest,
    LaunchStatus,
)
from service.leadership import SOLE_LEADER, LeadershipLost, Lease, SoleLeader
from service.models import Job, utcnow
from service.poll_loop import PollLoop
from service.schemas import JobState
from service.settings import Settings
from service.states import IllegalTransition, note_waiting, transition
from storage import shared as shared_storage

log = logging.getLogger(__name__)
S = JobState
HOLDING_STATES = admission.HOLDING_STATES  # a job in these holds its workers (and a driver) for admission
RECONCILED_STATES = HOLDING_STATES  # STARTING, RUNNING, RESTARTING, CANCELLING
ADMISSION_SCAN = 500  # queued jobs considered per pass, in queue order (priority, then oldest first)
ADMISSION_LOCK_KEY = 0x7A657472  # pg_advisory_xact_lock key of the admission decision
# what the launcher reports when a job ended without the driver saying so
LOST_PHASES = (LaunchPhase.FAILED, LaunchPhase.STOPPED, LaunchPhase.UNKNOWN)


class Scheduler:
    def __init__(self, make_session: sessionmaker[Session], launcher: Launcher, settings: Settings,
                 *, claim_batch: int = 8, identity: str | None = None, lease: Lease | SoleLeader = SOLE_LEADER):
        self.make_session = make_session
        self.lease = lease
        self.launcher = launcher
        self.settings = settings
        self.claim_batch = claim_batch
        self.identity = identity or replica_identity()
        self._loop = PollLoop("zerotrain-scheduler", self.run_once, settings.scheduler_poll_s)
        self._cancel_sent: set[str] = set()
        self._releases: dict[str, threading.Thread] = {}  # job id -> its stop after a failure
        self.limits = admission.limits_from(settings)
        self._next_package_sweep = 0.0  # time.monotonic() of the next code-package sweep
        self._next_tensorboard_export = 0.0  # time.monotonic() of the next TensorBoard export
        self._next_metric_sweep = 0.0  # time.monotonic() of the next raw metric sweep

    # ------------------------------------------------------------------ loop

    def run_once(self) -> None:
        """One pass, on the leader only (see [Note: replicas])."""
        if not self.lease.is_leader():
            return
        try:
            for job_id, ingest_token in self.claim():
                self.launch(job_id, ingest_token)
            self.reconcile()
            self.sweep_code_packages()
            self.export_tensorboard()
            self.drop_rolled_up_metrics()
        except LeadershipLost as lost:
            log.warning("scheduler pass abandoned: %s", lost)

    def export_tensorboard(self) -> None:
        """Every ``tensorboard_export_s``: write the jobs' new steps to their TensorBoard event
        files (``service.tensorboard``; a job whose export fails is retried next time)."""
        if time.monotonic() < self._next_tensorboard_export:
            return
        self._next_tensorboard_export = time.monotonic() + self.settings.tensorboard_export_s
        tensorboard.export_pending(self.make_session, self.settings.storage_uri)

    def drop_rolled_up_metrics(self) -> None:
        """With ``metrics_raw_retention_days`` set: delete the raw metric rows of jobs that ended
        that long ago (``service.metric_retention``), a bounded number per pass, fenced; when rows
        remain the next pass goes on, else the next look is ``SWEEP_S`` later."""
        days = self.settings.metrics_raw_retention_days
        if days is None or time.monotonic() < self._next_metric_sweep:
            return
        sweep = metric_retention.drop_rolled_up(self.make_session, self.lease, timedelta(days=days))
        self._next_metric_sweep = 0.0 if sweep.more else time.monotonic() + metric_retention.SWEEP_S

    def sweep_code_packages(self) -> None:
        """Every ``code_package_sweep_s``: delete the code packages nothing needs any more
        (``service.code_package_retention``); a storage error is logged and retried next time."""
        if time.monotonic() < self._next_package_sweep:
            return
        self._next_package_sweep = time.monotonic() + self.settings.code_package_sweep_s
        try:
            with self.make_session() as session:
                delete_unused_packages(session, self.settings.storage_uri, timedelta(days=self.settings.code_package_retention_days))
                session.commit()
        except Exception:  # noqa: BLE001 - storage down: the packages wait for the next sweep
            log.exception("deleting unused code packages failed")

    def run_forever(self) -> None:
        self._loop.run_forever()

    def wake(self) -> None:
        self._loop.wake()

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._loop.stop(timeout)
        for release in list(self._releases.values()):
            release.join(timeout)

    # ------------------------------------------------------------------ claim and launch

    def claim(self) -> list[tuple[str, str]]:
        """Move the QUEUED jobs admission lets start (at most ``claim_batch``) to STARTING;
        return their ids and ingest tokens. The others get a notice saying why they wait.

        [Note: one admitter at a time] On PostgreSQL the decision is taken under a
        transaction-scoped advisory lock, so two control planes cannot both admit into the
        same free capacity; the QUEUED rows are still locked with SKIP LOCKED against
        cancels. SQLite has one writer anyway.
        """
        claimed: list[tuple[str, str]] = []
        with self.make_session() as session:
            self.lease.begin(session)
            if session.get_bind().dialect.name == "postgresql":
                session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADMISSION_LOCK_KEY})
            queued = session.execute(
                select(Job).where(Job.state == S.QUEUED.value).order_by(Job.priority.desc(), Job.pk)
                .limit(ADMISSION_SCAN).with_for_update(skip_locked=True)
            ).scalars().all()
            self._withdraw(session)
            if not queued:
                self.lease.commit(session)
                return claimed
            running = session.execute(
                select(Job.id, Job.owner, Job.spec, Job.state, Job.priority, Job.pk, Job.preempt_for,
                       Job.preempt_requested_at, Job.preempt_shrink_to)
                .where(Job.state.in_([state.value for state in HOLDING_STATES]))
            ).all()
            capacity = admission.cluster_capacity(self.launcher, self.settings)
            runners = [_runner(row) for row in running]
            team_quotas = quotas.load(session)
            ordered, guaranteed = quotas.guaranteed_first(
                [(admission.stored_candidate(job.id, job.owner, job.spec), job.priority) for job in queued],
                runners, team_quotas, capacity)
            decision = admission.decide([job for job, _ in ordered], [runner.candidate for runner in runners],
                                        capacity, self.limits, team_quotas)
            self._preempt(session, ordered, runners, decision, capacity,
                          lambda head, priority: quotas.reclaim_for(head, priority, guaranteed, runners,
                                                                    team_quotas, capacity))
            for job in queued:
                waiting = decision.waiting.get(job.id)
                if waiting is not None:
                    note_waiting(session, job, waiting.reason, waiting.message)
            for job_id in decision.start[:self.claim_batch]:
                token = new_token(INGEST_TOKEN_PREFIX)
                try:
                    transition(session, job_id, S.STARTING, reason=Reason.CLAIMED,
                               message=f"claimed by {self.identity}", expected={S.QUEUED},
                               values={"ingest_token_hash": hash_token(token), "claimed_by": self.identity})
                except IllegalTransition:
                    continue  # cancelled or claimed elsewhere meanwhile
                claimed.append((job_id, token))
            if claimed:
                self._withdraw(session)  # the jobs admitted now wait no longer
            self.lease.commit(session)
        return claimed

    def _withdraw(self, session: Session) -> None:
        """Withdraw the requests to make room for jobs that no longer wait ([Note: withdrawing a
        request] in ``service.preemption``)."""
        for job_id in preemption.withdraw_stale(session):
            log.info("job %s is no longer asked to make room", job_id)

    def _preempt(self, session: Session, queued: list[tuple[admission.Candidate, int]],
                 runners: list[preemption.Runner], decision: admission.Decision, capacity: admission.Capacity,
                 reclaim: Callable[[admission.Candidate, int], preemption.Reclaim | None]) -> None:
        """Ask lower-priority running jobs to make room for the head of the queue when it does
        not fit (``service.preemption``), and, for a head within its team's guaranteed share,
        jobs of equal priority of teams above theirs (``reclaim``: ``service.quotas``); the jobs
        admitted in this pass count as used. The head's wait then names the jobs asked for it."""
        head = preemption.blocked_head(queued, decision)
        if head is None:
            return
        starting = set(decision.start[:self.claim_batch])
        used = sum((runner.candidate.demand for runner in runners), admission.NOTHING)
        used = sum((job.demand for job, _ in queued if job.job_id in starting), used)
        asks = preemption.choose(head[0], head[1], runners, capacity, used, reclaim(*head))
        asked = preemption.request(session, asks, head[0].job_id)
        for ask in asked:
            log.info("asked job %s to %s to make room for job %s", ask.job_id,
                     "stop" if ask.shrink_to is None else f"shrink to {ask.shrink_to} workers", head[0].job_id)
        # [Note: the head names its victims] asked in this pass or an earlier one (those count
        # as free, so choose asks nobody more): it waits with reason `preempting`
        asked += [preemption.Ask(runner.candidate.job_id, runner.shrink_to)
                  for runner in runners if runner.asked_for == head[0].job_id]
        if asked:
            shrinking = {ask.job_id: ask.shrink_to for ask in asked if ask.shrink_to is not None}
            decision.waiting[head[0].job_id] = admission.Waiting(
                Reason.PREEMPTING, preemption_notes.making_room([ask.job_id for ask in asked], shrinking))

    def launch(self, job_id: str, ingest_token: str) -> None:
        with self.make_session() as session:
            self.lease.begin(session)  # a replica that lost the lease since its claim launches nothing
            job = session.execute(select(Job).where(Job.id == job_id)).scalar_one()
        try:
            request = LaunchRequest(job_id=job.id, attempt=job.attempt, spec=job.job_spec,
                                    api_url=self.settings.api_url, ingest_token=ingest_token,
                                    storage_uri=self.settings.storage_uri,
                                    scoped_storage=self.settings.scoped_storage,
                                    storage_marker=shared_storage.write_marker(self.settings.storage_uri, job.id))
            handle = self.launcher.start(request)
        except Exception as error:
            log.exception("launcher failed to start %s", job_id)
            self._finish_failed_launch(job_id, f"{type(error).__name__}: {error}")
            return
        with self.make_session() as session:
            self.lease.begin(session)
            session.execute(Job.__table__.update().where(Job.__table__.c.id == job_id)
                            .values(launch_handle=handle.to_json()))
            self.lease.commit(session)

    def _finish_failed_launch(self, job_id: str, message: str) -> None:
        with self.make_session() as session:
            for target in (S.FAILED, S.CANCELLED):  # CANCELLED if the user cancelled meanwhile
                self.lease.begin(session)
                try:
                    transition(session, job_id, target, reason=Reason.LAUNCH_FAILED, message=message)
                    self.lease.commit(session)
                    return
                except IllegalTransition:
                    session.rollback()

    # ------------------------------------------------------------------ reconcile

    def reconcile(self) -> None:
        self._fail_abandoned_claims()
        with self.make_session() as session:
            jobs = session.execute(
                select(Job).where(Job.state.in_([s.value for s in RECONCILED_STATES]),
                                  Job.launch_handle.is_not(None)).order_by(Job.pk)
            ).scalars().all()
            session.expunge_all()
        for job in jobs:
            try:
                self._reconcile_job(job)
            except LeadershipLost:
                raise
            except Exception:
                log.exception("reconciling %s failed", job.id)

    def _fail_abandoned_claims(self) -> None:
        """A claim whose control plane died before storing a launch handle would wait forever."""
        cutoff = utcnow() - timedelta(seconds=self.settings.launch_timeout_s)
        with self.make_session() as session:
            self.lease.begin(session)
            abandoned = session.execute(
                select(Job.id, Job.state).where(Job.state.in_([S.STARTING.value, S.CANCELLING.value]),
                                                Job.launch_handle.is_(None), Job.updated_at < cutoff)
            ).all()
            for job_id, state in abandoned:
                target = S.CANCELLED if state == S.CANCELLING.value else S.FAILED
                try:
                    transition(session, job_id, target, reason=Reason.LAUNCH_FAILED, expected={S(state)},
                               message=f"not launched within {self.settings.launch_timeout_s:.0f} s of its claim")
                except IllegalTransition:
                    continue
            self.lease.commit(session)

    def _reconcile_job(self, job: Job) -> None:
        handle = LaunchHandle.from_json(job.launch_handle)
        state = JobState(job.state)
        if state is S.CANCELLING and job.id not in self._cancel_sent:
            self.launcher.cancel(handle)
            self._cancel_sent.add(job.id)
        status = self.launcher.status(handle)
        with self.make_session() as session:
            self.lease.begin(session)
            changed = self._apply(session, job, state, status)
            if changed:
                self.lease.commit(session)
        if state is S.CANCELLING and status.phase is not LaunchPhase.RUNNING:
            self._cancel_sent.discard(job.id)
        if changed and state is not S.CANCELLING and status.phase in LOST_PHASES:
            self._release(job.id, handle)

    def _release(self, job_id: str, handle: LaunchHandle) -> None:
        """Stop whatever a failed job's driver left running (see the note above), off the poll loop."""
        def stop() -> None:
            try:
                self.launcher.release(handle)
            except Exception:  # noqa: BLE001 - the job is already FAILED; this is clean-up only
                log.warning("stopping the remains of failed job %s failed", job_id, exc_info=True)
            finally:
                self._releases.pop(job_id, None)

        if job_id not in self._releases:
            self._releases[job_id] = thread = threading.Thread(target=stop, name=f"zerotrain-release-{job_id}",
                                                               daemon=True)
            thread.start()

    def _apply(self, session: Session, job: Job, state: JobState, status: LaunchStatus) -> bool:
        """Write what ``status`` implies for a job last seen in ``state``; True if anything changed."""
        phase = status.phase
        target: JobState | None = None
        reason, message = status.reason, status.message
        if state is S.CANCELLING:
            if phase is not LaunchPhase.RUNNING and phase is not LaunchPhase.PENDING:
                target, reason, message = S.CANCELLED, job.reason, job.message
        elif phase is LaunchPhase.PENDING:
            return bool(status.reason) and note_waiting(session, job, status.reason, status.message)
        elif phase is LaunchPhase.RUNNING:
            if job.reason == Reason.INSUFFICIENT_RESOURCES:  # the wait is over; say so once
                note_waiting(session, job, Reason.RESOURCES_ACQUIRED, None)
                return True
            return self._check_runtime(session, job, state)
        elif phase is LaunchPhase.SUCCEEDED:
            target, reason = S.SUCCEEDED, Reason.DRIVER_EXITED
        elif phase is LaunchPhase.FAILED:
            target = S.FAILED
            reason = reason or (Reason.WORKER_FAILED if state is S.RUNNING else Reason.DRIVER_LOST)
        else:  # STOPPED outside our control, or UNKNOWN: the driver is gone
            target, reason = S.FAILED, Reason.DRIVER_LOST
            message = f"launcher reports {phase.value}" + (f": {message}" if message else "")
        try:
            transition(session, job.id, target, reason=reason, message=message, expected={state})
        except IllegalTransition:
            return False  # the driver (or a user) moved the job first; their word stands
        return True

    def _check_runtime(self, session: Session, job: Job, state: JobState) -> bool:
        if job.started_at is None or state is not S.RUNNING:
            return False
        limit = job.job_spec.max_runtime_s
        if not limit:
            return False
        if utcnow() - job.started_at < timedelta(seconds=limit):
            return False
        try:
            transition(session, job.id, S.CANCELLING, reason=Reason.MAX_RUNTIME_EXCEEDED,
                       message=f"ran longer than max_runtime_s={limit}", expected={state})
        except IllegalTransition:
            return False
        return True


def replica_identity() -> str:
    """This process's name as a replica: the host, the process id and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _runner(row: Any) -> preemption.Runner:
    """A holding job as preemption sees it: only a RUNNING job with a ``preemptible`` spec may be
    asked; one that shrank for another counts as its cap and is not asked again while it stands
    ([Note: shrinking] in ``service.preemption``)."""
    candidate = admission.stored_candidate(row.id, row.owner, row.spec)
    preemptible = row.state == S.RUNNING.value and bool(row.spec.get("preemptible", True))
    pending = row.preempt_for is not None and row.preempt_requested_at is not None
    if not pending and row.preempt_shrink_to is not None:
        candidate = preemption.capped(candidate, row.preempt_shrink_to)
        preemptible = False
    return preemption.Runner(candidate, row.priority, row.pk, preemptible,
                             row.preempt_for if pending else None, row.preempt_shrink_to if pending else None)
