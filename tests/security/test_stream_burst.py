"""A burst of stream opens must not starve other users (issue 36, "Bad and heavy input").

One user opens 150 metric streams in the same instant (not in waves: a script, or a dashboard
reloaded in many tabs); another user's ``GET /jobs``, sampled from the first moment of the burst
on until a second after the last stream opened, stays under 500 ms. The burst comes from a
process of its own, as another user's would; the timings are printed (``pytest -s``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.helpers.service_specs import make_spec

STREAMS = 150
BOUND_S = 0.5
CLIENT = Path(__file__).with_name("stream_burst_client.py")


def test_150_streams_opened_at_once_leave_another_users_requests_under_500_ms(make_live_service):
    service = make_live_service(scheduler_enabled=False)
    # The service's start-up warm-up (importing torch, planning a tiny job: service.prediction) holds
    # the interpreter for seconds; what is measured here is the burst, so it starts after that.
    service.app.state.planner_warm_up.join(120)
    assert not service.app.state.planner_warm_up.is_alive()
    admin = service.client()
    alice, bob = admin.create_token("alice").token, admin.create_token("bob").token
    job_id = httpx.post(f"{service.url}/api/v1/jobs", json=make_spec(),
                        headers={"Authorization": f"Bearer {alice}"}).raise_for_status().json()["id"]
    burst = subprocess.Popen([sys.executable, str(CLIENT), service.url, alice,
                              f"/api/v1/jobs/{job_id}/metrics/stream", str(STREAMS)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    opened: list[tuple[int, float]] = []  # (status, seconds from the go)
    reader = threading.Thread(target=lambda: opened.extend((int(a), float(b)) for a, b in
                                                           (line.split() for line in burst.stdout)), daemon=True)
    samples: list[tuple[float, float]] = []  # (sent at, took), seconds from the go
    try:
        reader.start()
        with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {bob}"}, timeout=30) as other:
            other.get("/api/v1/jobs").raise_for_status()  # bob's connection is open before the burst
            burst.stdin.write("go\n")
            burst.stdin.flush()
            start = time.perf_counter()
            deadline = start + 120
            while time.perf_counter() < deadline:
                sent = time.perf_counter()
                other.get("/api/v1/jobs").raise_for_status()
                samples.append((sent - start, time.perf_counter() - sent))
                done = list(opened)
                if len(done) == STREAMS and sent - start > max(t for _, t in done) + 1.0:
                    break
                time.sleep(0.05)
    finally:
        burst.stdin.close()
        burst.wait(30)
        reader.join(10)
    took = [t for _, t in samples]
    print(f"\n{STREAMS} streams opened at once: all answered after {max(t for _, t in opened):.2f} s; "
          f"the other user's GET /jobs: {len(took)} samples over {samples[-1][0]:.2f} s, max "
          f"{max(took) * 1000:.0f} ms, median {sorted(took)[len(took) // 2] * 1000:.0f} ms, first "
          f"{took[0] * 1000:.0f} ms")
    print("samples (sent at s, took ms):", [(round(s, 2), round(t * 1000)) for s, t in samples])
    assert [code for code, _ in opened].count(200) == STREAMS, sorted({code for code, _ in opened})
    assert max(took) < BOUND_S, [(round(s, 2), round(t, 3)) for s, t in samples if t >= BOUND_S]
