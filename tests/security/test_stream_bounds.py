"""Open event streams are bounded per user and cannot slow other users' requests: 200 open
metric streams used to slow another user's ``GET /jobs`` to 15 s, and there was no bound."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import pytest

from tests.helpers.service_specs import make_spec

STREAMS = 300


@pytest.fixture
def two_users(make_live_service):
    service = make_live_service(scheduler_enabled=False, max_streams_per_user=STREAMS)
    admin = service.client()
    alice, bob = admin.create_token("alice").token, admin.create_token("bob").token
    job_id = httpx.post(f"{service.url}/api/v1/jobs", json=make_spec(),
                        headers={"Authorization": f"Bearer {alice}"}).raise_for_status().json()["id"]
    return service, alice, bob, job_id


async def _open(client: httpx.AsyncClient, path: str, opened: list) -> None:
    async with client.stream("GET", path) as response:
        opened.append(response.status_code)
        if response.status_code != 200:
            return
        async for _ in response.aiter_lines():  # held open until cancelled
            pass


def test_300_streams_of_one_user_leave_others_fast_and_the_301st_is_refused(two_users):
    service, alice, bob, job_id = two_users
    path = f"/api/v1/jobs/{job_id}/metrics/stream"

    async def scenario() -> tuple[list[float], int, list[int]]:
        limits = httpx.Limits(max_connections=STREAMS + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=service.url, headers={"Authorization": f"Bearer {alice}"},
                                     limits=limits, timeout=60) as streams, \
                httpx.AsyncClient(base_url=service.url, headers={"Authorization": f"Bearer {bob}"},
                                  timeout=30) as other:
            opened: list[int] = []
            tasks = []
            deadline = time.monotonic() + 180
            for wave in range(0, STREAMS, 25):  # as browsers open them: not 300 in the same instant
                tasks += [asyncio.create_task(_open(streams, path, opened)) for _ in range(wave, min(wave + 25, STREAMS))]
                while len(opened) < len(tasks) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            assert opened.count(200) == STREAMS, f"{len(opened)} opened: {set(opened)}"
            refused = (await streams.get(path)).status_code
            latencies = []
            for _ in range(10):
                started = time.perf_counter()
                (await other.get("/api/v1/jobs")).raise_for_status()
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(0.2)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return latencies, refused, opened

    # its own thread: an earlier test (Playwright's sync API) may leave an event loop running here
    with concurrent.futures.ThreadPoolExecutor(1) as runner:
        latencies, refused, _ = runner.submit(asyncio.run, scenario()).result()
    assert refused == 429
    assert max(latencies) < 0.5, [round(x, 3) for x in latencies]
    slots = service.app.state.stream_slots
    deadline = time.monotonic() + 30
    while slots.open_count("alice") and time.monotonic() < deadline:  # the server sees the disconnects
        time.sleep(0.1)
    assert slots.open_count("alice") == 0
