"""Keep-alive on idle event streams: how long an idle stream goes without a byte.

Starts ``zerotrain serve`` as a subprocess on embedded defaults (SQLite, scheduler off, a fresh
home folder), submits a job that is never claimed (it stays QUEUED, so its streams are idle),
opens its metric and event streams side by side for ``--seconds``, and records when each
``:`` comment arrives. The table gives, per stream, the wait from the open (or the last event)
to the first comment and the longest gap between comments: what a proxy with an idle timeout
sees. Everything it creates is removed at the end.

    python -m benchmarks.stream_keepalive --seconds 45 --json bench-results/stream_keepalive.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROUTES = ("metrics/stream", "events/stream")
SPEC = {"name": "idle", "model": {"preset": "gpt-nano"}, "data": {"kind": "synthetic", "seq_len": 64},
        "train": {"steps": 10, "global_batch_size": 4, "micro_batch_size": 2}, "resources": {"num_workers": 2}}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def watch(url: str, token: str, job_id: str, route: str, seconds: float) -> dict:
    """Times (s after the open) of the stream's last event line and of each comment line."""
    last_event_s, comments = 0.0, []
    with httpx.stream("GET", f"{url}/api/v1/jobs/{job_id}/{route}", headers={"Authorization": f"Bearer {token}"},
                      timeout=httpx.Timeout(10, read=seconds + 30)) as response:
        response.raise_for_status()
        opened = time.monotonic()
        for line in response.iter_lines():
            now = time.monotonic() - opened
            if line.startswith(":"):
                comments.append((round(now, 2), line))
            elif line.startswith(("id:", "data:", "event:")):
                last_event_s = round(now, 2)
            if now > seconds:
                break
    times = [last_event_s] + [t for t, _ in comments]
    return {"route": route, "last_event_s": last_event_s, "comments": comments,
            "first_comment_after_s": round(times[1] - times[0], 2) if len(times) > 1 else None,
            "longest_silence_s": round(max(b - a for a, b in zip(times, times[1:])), 2) if len(times) > 1 else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zt-keepalive-") as home:
        port = _free_port()
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("ZEROTRAIN_")},
               "ZEROTRAIN_HOME": home, "ZEROTRAIN_LAUNCHER": "local", "ZEROTRAIN_SCHEDULER_ENABLED": "false"}
        server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            while not server.stdout.readline().startswith("dashboard:"):
                if server.poll() is not None:
                    raise SystemExit("zerotrain serve ended before it listened")
            url, token = f"http://127.0.0.1:{port}", (Path(home) / "token").read_text().strip()
            job = httpx.post(f"{url}/api/v1/jobs", json=SPEC, headers={"Authorization": f"Bearer {token}"}, timeout=120)
            job.raise_for_status()
            with ThreadPoolExecutor(len(ROUTES)) as pool:
                rows = list(pool.map(lambda r: watch(url, token, job.json()["id"], r, args.seconds), ROUTES))
        finally:
            server.kill()
            server.wait()
    print(f"{'stream':<16}{'comments':>9}{'first after (s)':>17}{'longest silence (s)':>21}  comment")
    for row in rows:
        print(f"{row['route']:<16}{len(row['comments']):>9}{row['first_comment_after_s']!s:>17}"
              f"{row['longest_silence_s']!s:>21}  {row['comments'][0][1] if row['comments'] else '-'}")
    result = {"seconds": args.seconds, "load_average": os.getloadavg(), "streams": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
