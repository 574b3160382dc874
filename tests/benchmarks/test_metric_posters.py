"""The ingest benchmarks' load generator: ``MetricBodies`` builds valid batches of the steps asked
for, and ``Posters`` posts them to a real uvicorn server over kept-alive connections, reading
each answer whole, sends a request again on a new connection when a kept-alive one was closed
while idle, and raises ``ConnectionError`` when the server is gone."""

from __future__ import annotations

import asyncio
import json

import uvicorn
from fastapi import FastAPI, Request

from benchmarks.ingest_load import MetricBodies, Posters
from service.launchers.ports import free_port
from service.schemas import MetricBatch
from tests.benchmarks.test_service_bench import run_alone


def test_bodies_are_valid_batches_of_the_steps_asked_for():
    bodies = MetricBodies()
    for rank, first, size in ((3, 0, 2), (3, 10, 2), (3, 500, 5), (7, 0, 1)):
        batch = MetricBatch.model_validate_json(bodies.body(rank, first, size))
        assert [(r.rank, r.step) for r in batch.records] == [(rank, step) for step in range(first, first + size)]


def test_posters_keep_connections_read_whole_answers_and_resend_on_one_closed_while_idle():
    app = FastAPI()
    seen: list[tuple[str, str, int]] = []

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        body = await request.body()
        seen.append((request.headers["authorization"], request.headers["content-type"], len(body)))
        return {"length": len(body), "pad": "x" * 100_000}

    async def scenario() -> None:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=1))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        posters = Posters(f"http://127.0.0.1:{port}", "secret")
        try:
            answers = [await posters.post("/echo", b"{}" * n) for n in (1, 1000, 3)]
            assert [(status, json.loads(content)["length"]) for status, content in answers] == [
                (200, 2), (200, 2000), (200, 6)]
            assert len(posters.idle) == 1  # one connection, kept alive throughout
            assert seen == [("Bearer secret", "application/json", n) for n in (2, 2000, 6)]
            assert await posters.idle[0][0].read() == b""  # the server closed it, idle past its keep-alive
            assert (await posters.post("/echo", b"{}"))[0] == 200  # sent again on a new connection
            assert len(seen) == 4 and len(posters.idle) == 1
            server.should_exit = True
            await serving
            posters.close()
            try:
                await posters.post("/echo", b"{}")
            except ConnectionError:
                pass
            else:
                raise AssertionError("a server that is gone was not reported")
        finally:
            posters.close()
            server.should_exit = True
            await serving

    run_alone(scenario())
