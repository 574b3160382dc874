"""A driver, run by path by the local launcher, that uses storage the way the workers do.

It writes below its own checkpoint prefix through ``storage.storage`` (so with
scoped credentials botocore fetches them from the control plane), reads the object back, asks
the storage server's STS who it is, and prints what it found as one ``PROBE=`` JSON line: its
environment as it started, the caller's ARN, and what it read back.
"""

from __future__ import annotations

import json
import os
import sys

import httpx


def main() -> int:
    started_with = dict(os.environ)
    job_id, api = os.environ["ZEROTRAIN_JOB_ID"], os.environ["ZEROTRAIN_API_URL"]
    http = httpx.Client(base_url=f"{api}/api/v1/jobs/{job_id}",
                        headers={"Authorization": f"Bearer {os.environ['ZEROTRAIN_INGEST_TOKEN']}"}, timeout=30)
    storage_uri = http.get("/worker/spec").raise_for_status().json()["storage_uri"]
    http.post("/worker/state", json={"state": "RUNNING"}).raise_for_status()

    from storage.storage import Storage

    own = Storage.at(f"{storage_uri.rstrip('/')}/{job_id}/checkpoints")
    own.write_atomic("probe.bin", f"written by {job_id}".encode())
    read_back = own.read_bytes("probe.bin").decode()

    import botocore.session

    sts = botocore.session.get_session().create_client(
        "sts", endpoint_url=os.environ["ZEROTRAIN_S3_ENDPOINT_URL"], region_name="us-east-1")
    identity = sts.get_caller_identity()
    print("PROBE=" + json.dumps({"env": started_with, "arn": identity["Arn"], "read_back": read_back}), flush=True)
    http.post("/worker/state", json={"state": "SUCCEEDED"}).raise_for_status()
    return 0


if __name__ == "__main__":
    sys.exit(main())
