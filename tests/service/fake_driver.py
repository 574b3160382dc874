"""A stand-in for ``workers.launch`` that speaks the real worker protocol over HTTP.

Run by path by the local launcher in tests. Behaviour comes from ``spec.model.kwargs``:
``fail`` (report FAILED), ``hang_s`` (sleep after RUNNING, to test cancel), ``exit_code``
(exit without reporting a final state), ``ranks`` (metric records per step, default 2),
``log_lines`` (print that many numbered lines after RUNNING, one every ``line_interval_s``),
``worker_lines`` (``[pid, text]`` pairs printed after those as Ray's driver prints a worker's
line: ``(RayTrainWorker pid=…) text``, prefix coloured, one every ``line_interval_s``),
``fail_details`` (with ``fail``: print it and report it as the failure's details, as the real
driver logs and reports a traceback), ``call_factory`` (import ``model.factory`` and print what it returns and the working directory,
as the real driver would find a ``runtime.working_dir`` package), ``starts_file`` (append the
job id to that file when it starts: a count of launches). ``--api`` may list several replicas
(comma-separated): this stand-in talks to the first only.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import httpx


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--api", required=True)
    args = parser.parse_args()
    token = os.environ["ZEROTRAIN_INGEST_TOKEN"]
    assert token not in " ".join(sys.argv), "the ingest token must not be on the command line"
    assert os.environ["ZEROTRAIN_JOB_ID"] == args.job_id
    api = args.api.split(",")[0].rstrip("/")
    http = httpx.Client(base_url=f"{api}/api/v1/jobs/{args.job_id}",
                        headers={"Authorization": f"Bearer {token}"}, timeout=10)

    worker = http.get("/worker/spec").raise_for_status().json()
    spec, attempt = worker["spec"], worker["attempt"]
    options = spec["model"].get("kwargs") or {}
    if options.get("starts_file"):
        with open(options["starts_file"], "a") as starts:
            starts.write(f"{args.job_id}\n")
    print(f"fake driver for {args.job_id}: {spec['train']['steps']} steps", flush=True)
    http.post("/worker/state", json={"state": "RUNNING"}).raise_for_status()

    for number in range(options.get("log_lines", 0)):
        print(f"log line {number}", flush=True)
        time.sleep(options.get("line_interval_s", 0.1))
    for pid, text in options.get("worker_lines", []):
        print(f"\x1b[36m(RayTrainWorker pid={pid})\x1b[0m {text}", flush=True)
        time.sleep(options.get("line_interval_s", 0.1))
    if options.get("hang_s"):
        time.sleep(options["hang_s"])
    if options.get("call_factory"):
        module, _, name = spec["model"]["factory"].partition(":")
        print(f"factory says {getattr(importlib.import_module(module), name)()!r} in {os.getcwd()}", flush=True)
    if "exit_code" in options:
        return int(options["exit_code"])

    records = [{"attempt": attempt, "rank": rank, "step": step, "loss": 5.0 / (step + 1),
                "tokens_per_s": 1000.0 + step, "time": time.time()}
               for step in range(spec["train"]["steps"]) for rank in range(options.get("ranks", 2))]
    half = len(records) // 2
    first = http.post("/metrics", json={"records": records[:half]}).raise_for_status().json()
    assert first == {"accepted": half, "duplicates": 0}, first
    again = http.post("/metrics", json={"records": records}).raise_for_status().json()  # a resend
    assert again == {"accepted": len(records) - half, "duplicates": half}, again

    if options.get("fail"):
        details = options.get("fail_details")
        if details:
            print(details, flush=True)
        http.post("/worker/state", json={"state": "FAILED", "reason": "user_code_error",
                                         "message": "ValueError: boom", "details": details}).raise_for_status()
        return 1
    http.post("/worker/state", json={"state": "SUCCEEDED"}).raise_for_status()
    print("fake driver done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
