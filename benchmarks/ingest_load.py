"""The ingest benchmarks' load generator (``benchmarks.service``, ``benchmarks.ingest_replicas``):
metric records as a CPU rank sends them, their POST bodies, and the connections that post them.
On these 2 cores the generator shares the CPU with the servers and PostgreSQL it measures, so
each part is cheap: a body is one string format, a request a few lines of asyncio streams."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse


def metric_record(rank: int, step: int) -> dict:
    """The fields ``workers.reporting.StepMeter.record`` fills on a CPU rank."""
    return {"attempt": 0, "rank": rank, "step": step, "time": time.time(), "loss": 2.5, "lr": 3e-4,
            "grad_norm": 0.9, "step_time_s": 0.21, "tokens_per_s": 2400.0, "samples_per_s": 37.5, "tflops": 0.009,
            "mfu": None, "mem_params_bytes": 4.1e6, "mem_grads_bytes": 2.0e6, "mem_optimizer_bytes": 1.2e7,
            "mem_buffers_bytes": 3.1e6, "mem_peak_bytes": 2.4e8, "comm_bytes": 8.2e6, "comm_exposed_s": 0.03,
            "checkpoint_blocked_s": 0.0}


class MetricBodies:
    """POST bodies of ``metric_record``s, ``batch`` steps of one rank from step ``first`` on: one
    string format per body, its steps the only values left to write (the rest of each rank's
    body is written once per batch size), so that the load generator takes little of the CPU
    the servers and the database share with it (``json.dumps`` of dicts costs many times more)."""

    def __init__(self) -> None:
        record = {**metric_record(0, 0), "rank": -1111, "step": -2222}
        self.record = json.dumps(record, separators=(",", ":")).replace("%", "%%").replace("-2222", "%d")
        self.templates: dict[int, tuple[int, str]] = {}  # per rank: its latest batch size and body

    def body(self, rank: int, first: int, batch: int) -> bytes:
        size, template = self.templates.get(rank, (None, ""))
        if size != batch:
            template = '{"records":[' + ",".join([self.record.replace("-1111", str(rank))] * batch) + "]}"
            self.templates[rank] = (batch, template)
        return (template % tuple(range(first, first + batch))).encode()


class Posters:
    """Keep-alive HTTP/1.1 connections to one server for POSTing bodies, a few lines of asyncio
    streams: httpx's own work per request (about 2 ms for a 500-record body on these cores)
    would be a large share of the CPU the servers and the database share with the load
    generator. A connection is taken per request and given back after its answer; one the server
    closed is dropped, and the request raises ``ConnectionError`` (resend it: ingest is
    idempotent)."""

    def __init__(self, base: str, token: str) -> None:
        url = urllib.parse.urlsplit(base)
        self.host, self.port = url.hostname, url.port
        self.head = (f"Host: {self.host}:{self.port}\r\nAuthorization: Bearer {token}\r\n"
                     "Content-Type: application/json\r\n")
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """The answer's status and body. A kept-alive connection the server closed while it was
        idle (uvicorn closes one idle for 5 s: between the ramp's steps) fails on its next use
        before any answer; the request is then sent once more on a fresh connection, as httpx and
        urllib3 do. A fresh connection's failure raises."""
        if self.idle:
            try:
                return await self._post(self.idle.pop(), path, body)
            except ConnectionError:
                pass  # closed while idle
        return await self._post(await asyncio.open_connection(self.host, self.port), path, body)

    async def _post(self, connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], path: str,
                    body: bytes) -> tuple[int, bytes]:
        reader, writer = connection
        try:
            writer.writelines([f"POST {path} HTTP/1.1\r\n{self.head}Content-Length: {len(body)}\r\n\r\n".encode(),
                               body])
            await writer.drain()
            lines = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
            fields = dict(line.lower().split(b":", 1) for line in lines[1:] if b":" in line)
            content = await reader.readexactly(int(fields[b"content-length"]))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as error:
            writer.close()
            raise ConnectionError(f"{self.host}:{self.port}: {error!r}") from error
        if fields.get(b"connection", b"").strip() == b"close":
            writer.close()
        else:
            self.idle.append((reader, writer))
        return int(lines[0].split()[1]), content

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()
