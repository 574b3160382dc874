"""Two real ``zerotrain serve`` replica processes on one PostgreSQL database, for the replica
fault tests (tests/faults/test_replicas*.py).

``Replica``       one ``python -m service.cli serve`` process with its own data directory and
                  port, every replica's URL in its ``ZEROTRAIN_PUBLIC_URL`` (its own first), the
                  same bootstrap admin token, and a short leader lease.
                  ``restarted()`` replaces it with a new process (a rolling restart's step).
``leader_pid``    the process id in the lease row's holder (``service.scheduler.replica_identity``:
                  host, pid, random part), or None while no lease is held.
``MetricFollower`` the SDK's metric stream of a job, given every replica's URL, followed in a
                  thread until the job ends; ``finish`` checks that each record came once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from contract.environment import join_api_urls
from service.auth import new_token
from service.client import Client


def admin_token() -> str:
    return new_token()


class Replica:
    def __init__(self, name: str, home: Path, port: int, database_url: str, public_urls: list[str],
                 token: str, **settings: Any):
        self.name, self.home, self.port, self.token = name, home, port, token
        self.database_url, self.public_urls, self.settings = database_url, public_urls, settings
        self.url = f"http://127.0.0.1:{port}"
        env = {key: value for key, value in os.environ.items() if not key.startswith("ZEROTRAIN_")}
        env.update({"ZEROTRAIN_HOME": str(home), "ZEROTRAIN_DATABASE_URL": database_url,
                    "ZEROTRAIN_PUBLIC_URL": ",".join(public_urls), "ZEROTRAIN_BOOTSTRAP_ADMIN_TOKEN": token,
                    "ZEROTRAIN_BOOTSTRAP_ADMIN": "false"})
        env.update({f"ZEROTRAIN_{key.upper()}": str(value) for key, value in settings.items()})
        home.mkdir(parents=True, exist_ok=True)
        self.log_path = home / "serve.log"
        self._log = open(self.log_path, "a")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
                                        env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"replica {self.name} exited ({self.process.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"replica {self.name} did not start in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()[-6000:]

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.process.wait(30)

    def restarted(self) -> Replica:
        """Stop this replica cleanly (SIGTERM) and start a new process in its place: same port,
        data directory and settings (one step of a rolling restart)."""
        self.stop()
        return Replica(self.name, self.home, self.port, self.database_url, self.public_urls, self.token,
                       **self.settings)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


def leader_pid(database_url: str) -> int | None:
    """The pid of the replica holding an unexpired lease, by the lease row (None: nobody leads)."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            holder = connection.execute(text(
                "SELECT holder FROM leader_lease WHERE id = 1 AND expires_at > clock_timestamp()")).scalar()
    finally:
        engine.dispose()
    return int(holder.split(":")[1]) if holder else None


class MetricFollower(threading.Thread):
    """``Client.stream_metrics`` of ``job_id`` through ``urls`` (opened on the first), in a thread."""

    def __init__(self, urls: list[str], token: str, job_id: str, **stream: Any):
        super().__init__(name=f"follow-{job_id}", daemon=True)
        self.client = Client(join_api_urls(urls), token)
        self.job_id, self.stream = job_id, stream
        self.received: list[Any] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            for point in self.client.stream_metrics(self.job_id, **self.stream):
                self.received.append(point)
        except BaseException as error:  # noqa: BLE001 - finish() reports it
            self.failure = error

    def finish(self, timeout_s: float) -> list[tuple[int, int, int]]:
        """Once the job has ended: the streamed records' (attempt, rank, step), each checked to
        have come once (in commit order, not id order)."""
        self.join(timeout_s)
        self.client.close()
        assert not self.is_alive(), "the stream did not end with the job"
        assert self.failure is None, repr(self.failure)
        keys = [(point.attempt, point.rank, point.step) for point in self.received]
        repeated = [key for key, count in Counter(keys).items() if count > 1]
        assert not repeated, f"records streamed twice: {repeated[:10]}"
        ids = [point.id for point in self.received]  # commit order: ids of concurrent ingests interleave
        assert len(set(ids)) == len(ids)
        return keys
