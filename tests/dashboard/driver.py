"""A driver the browser tests steer: the real worker protocol, with the test as the workers.

The local launcher runs it for every job of a dashboard test server. It reports RUNNING,
prints a few log lines (the job page's log tail), hands its ingest token to the test through
``$ZT_DASHBOARD_TEST_DIR/{job_id}.token`` — the test then posts metrics and checkpoints with it
exactly as the workers would — and waits, printing what the test writes to ``{job_id}.say``
(the test waits for it to be taken before writing more). When ``{job_id}.finish`` appears it reports the state
written there and exits; SIGTERM (cancel) ends it at once. It gives up after ten minutes so
that a failed test never leaves it behind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx

GIVE_UP_S = 600


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--api", required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    token = os.environ["ZEROTRAIN_INGEST_TOKEN"]
    handoff = Path(os.environ["ZT_DASHBOARD_TEST_DIR"])
    http = httpx.Client(base_url=f"{args.api}/api/v1/jobs/{args.job_id}",
                        headers={"Authorization": f"Bearer {token}"}, timeout=10)
    worker = http.get("/worker/spec").raise_for_status().json()
    spec = worker["spec"]
    print(f"driver for {args.job_id}: {spec['resources']['num_workers']} workers, "
          f"{spec['train']['steps']} steps, ZeRO stage {spec['zero']['stage']}", flush=True)
    http.post("/worker/state", json={"state": "RUNNING"}).raise_for_status()
    print("worker group started; training", flush=True)
    partial = handoff / f"{args.job_id}.token.part"
    partial.write_text(token)
    partial.rename(handoff / f"{args.job_id}.token")  # atomic: the test never reads half a token

    finish = handoff / f"{args.job_id}.finish"
    deadline = time.monotonic() + GIVE_UP_S
    say = handoff / f"{args.job_id}.say"
    while not finish.exists():
        if time.monotonic() > deadline:
            print("driver: nobody finished this job; giving up", flush=True)
            return 3
        if say.exists():  # the test's lines for the job's log, printed as a rank would
            sys.stdout.write(say.read_text())
            sys.stdout.flush()
            say.unlink()
        time.sleep(0.05)
    final = json.loads(finish.read_text())
    print(f"training finished: {final['state']}", flush=True)
    http.post("/worker/state", json=final).raise_for_status()
    return 0 if final["state"] == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
