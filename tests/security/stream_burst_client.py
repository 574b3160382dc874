"""A user opening many event streams in the same instant, as a process of its own (so that its
client work does not share the test's interpreter with the server it measures).

    python stream_burst_client.py URL TOKEN PATH COUNT

Reads one line from stdin (the go), opens COUNT streams of PATH at once, prints ``<status>
<seconds since the go>`` as each answers, and holds the open ones until stdin closes.
"""

from __future__ import annotations

import asyncio
import sys
import time

import httpx


async def _open(client: httpx.AsyncClient, path: str, start: float) -> None:
    async with client.stream("GET", path) as response:
        print(response.status_code, round(time.perf_counter() - start, 4), flush=True)
        if response.status_code == 200:
            async for _ in response.aiter_lines():  # held open until cancelled
                pass


async def burst(url: str, token: str, path: str, count: int) -> None:
    limits = httpx.Limits(max_connections=count + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"},
                                 limits=limits, timeout=120) as client:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)
        start = time.perf_counter()
        tasks = [asyncio.create_task(_open(client, path, start)) for _ in range(count)]
        await loop.run_in_executor(None, sys.stdin.read)  # until the test closes stdin
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(burst(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
