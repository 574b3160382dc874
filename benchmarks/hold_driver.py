"""A stand-in driver for ``benchmarks.admission --teams``: it holds its job's resources for a set
time and speaks the real worker protocol, so the real scheduler and admitter decide everything.

Run by path by the local launcher (``ZEROTRAIN_LOCAL_ENTRYPOINT``). It reports RUNNING, then
"trains" ``train.steps`` steps of ``STEP_S`` seconds each (a sleep), asking after every step
whether the job is to make room (``GET /worker/preemption``); if so it reports ``POST
/worker/preempted`` at that step and exits, as the real ranks do at a checkpoint boundary. Its
progress is a file in the job's storage, so a preempted job resumes after its last step, not
from the start. At the end it reports SUCCEEDED.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx

STEP_S = 1.0  # one "step" of held resources


def progress_file(job_id: str) -> Path:
    storage = os.environ["ZEROTRAIN_STORAGE_URI"].removeprefix("file://")
    return Path(storage) / "hold-driver" / job_id


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--api", required=True)
    args = parser.parse_args()
    api = args.api.split(",")[0].rstrip("/")
    http = httpx.Client(base_url=f"{api}/api/v1/jobs/{args.job_id}/worker", timeout=30,
                        headers={"Authorization": f"Bearer {os.environ['ZEROTRAIN_INGEST_TOKEN']}"})
    spec = http.get("/spec").raise_for_status().json()["spec"]
    progress = progress_file(args.job_id)
    progress.parent.mkdir(parents=True, exist_ok=True)
    done = int(progress.read_text()) if progress.exists() else 0
    http.post("/state", json={"state": "RUNNING"}).raise_for_status()
    for step in range(done + 1, spec["train"]["steps"] + 1):
        time.sleep(STEP_S)
        progress.write_text(str(step))
        if step < spec["train"]["steps"] and http.get("/preemption").raise_for_status().json()["requested"]:
            http.post("/preempted", json={"step": step}).raise_for_status()
            return 0
    http.post("/state", json={"state": "SUCCEEDED"}).raise_for_status()
    return 0


if __name__ == "__main__":
    sys.exit(main())
