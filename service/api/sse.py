"""Server-sent event streams of stored rows (metric records, job events) that survive drops.

Every event's ``id:`` is its row's place in the order the stream sends rows in: a job event's
id (a job's events become visible in id order: service.states), a metric record's position in
commit order (service.stream_cursor). So a client that reconnects with ``Last-Event-ID``
(browsers' ``EventSource`` does by itself, so does the SDK) resumes right after the last event
it received: no duplicate, no gap. FastAPI's ``EventSourceResponse`` writes
the wire format; an idle stream (a QUEUED job, a quiet one) sends a ``: keep-alive`` comment every
``SSE_KEEPALIVE_S`` seconds. A stream ends with an ``end`` event once its job is terminal and
every row has been sent.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import anyio
from fastapi import Depends, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent

from service.api.deps import JOB_ID_PATH, bearer_token, current_user, visible_job
from service.models import Job
from service.schemas import SSE_KEEPALIVE_S

IDLE_POLL_S = 2.0  # longest wait between polls of a stream that receives nothing
STREAM_BATCH = 1000  # rows read per poll
RETRY_MS = 1000  # the reconnection delay the stream asks clients for

#: Rows after a cursor as (their cursor, JSON text), at most STREAM_BATCH, and whether the job
#: had ended before they were read. A cursor is an int or a ``stream_cursor.Position``; its
#: ``str`` is the event's ``id:``. Runs in a worker thread with a session of its own.
Fetch = Callable[[Any], tuple[list[tuple[Any, str]], bool]]


class EventStream(EventSourceResponse):
    """The streams' ``response_class``. [Note: errors are JSON] FastAPI files a route's other
    answers (401, 404, 429, ...) in the OpenAPI document under its response class's media type;
    with none here they read as ``application/json``, which they are. The stream itself is still
    ``text/event-stream``: FastAPI's streaming response for an ``EventSourceResponse`` route
    sets that type itself."""

    media_type = None


def resume_after(after_id: int, last_event_id: str | None) -> int:
    """The cursor to start from: ``after_id`` or the ``Last-Event-ID`` header, the later one.
    A header that is not an id this service sent (ASCII digits within BIGINT) is ignored."""
    if last_event_id and re.fullmatch(r"[0-9]{1,18}", last_event_id):
        return max(after_id, int(last_event_id))
    return after_id


def _admit(request: Request, job_id: str) -> tuple[Job, Callable[[], None]]:
    """The stream's job and one of its user's slots (the release): the token checked, the job
    visible to its user (404 otherwise), then the slot (429 past the bound), in that order."""
    with request.app.state.sessionmaker() as session:
        user = current_user(request, session)
        job = visible_job(session, user, job_id)
    return job, request.app.state.stream_slots.take(user.name)


async def _stream_job(request: Request, job_id: str = JOB_ID_PATH) -> AsyncIterator[Job]:
    """Open a stream: its job, with one of its user's stream slots held for as long as the
    response lasts (service.stream_slots).

    [Note: a burst of opens stays among the streams]
    Opened through FastAPI's sync dependencies (session, user, job, slot), each open would take
    several turns of the default thread pool and hold a pooled connection from the first to the
    handler: under a burst, requests holding connections wait for threads while threads wait for
    connections (``db_pool_timeout_s``), and everyone's other requests stall or answer 503. So an
    open is one short turn in the streams' own ``CapacityLimiter``, with a session of its own
    closed before the stream starts: a burst queues behind ``stream_poll_threads`` threads and
    connections, and everyone else's requests keep the default pool and the rest of the
    connections (docs/design.md, "Measurements")."""
    bearer_token(request)  # a missing token is a 401 before any thread or connection is taken
    slots = request.app.state.stream_slots
    job, release = await anyio.to_thread.run_sync(_admit, request, job_id, limiter=slots.limiter)
    try:
        yield job
    finally:  # a database round trip on PostgreSQL: in a thread, and done even when cancelled
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(release, limiter=slots.limiter)


StreamJob = Annotated[Job, Depends(_stream_job)]


async def poll_rows(request: Request, job_id: str, event: str, fetch: Fetch,
                    cursor: Any) -> AsyncIterator[ServerSentEvent]:
    """The events of a stream: ``retry:`` first, then one ``event`` per row after ``cursor``.

    [Note: a stopping server ends its streams] uvicorn stops by waiting for every open
    connection to finish, and a stream never does: a replica told to stop (a rolling restart)
    would sit there until killed, and only then hand the leader lease over. So once the server
    is stopping (``app.state.stopping``) each stream returns at its next poll, without ``end``:
    clients reconnect with ``Last-Event-ID``, to another replica."""
    poll_s = request.app.state.settings.sse_poll_s
    limiter = request.app.state.stream_slots.limiter
    stopping = request.app.state.stopping
    yield ServerSentEvent(retry=RETRY_MS)
    last_sent, wait = time.monotonic(), poll_s
    while not stopping.is_set() and not await request.is_disconnected():
        rows, ended = await anyio.to_thread.run_sync(fetch, cursor, limiter=limiter)
        for row_id, data in rows:
            cursor = row_id
            yield ServerSentEvent(id=str(row_id), event=event, raw_data=data)
        if ended and len(rows) < STREAM_BATCH:
            yield ServerSentEvent(event="end", raw_data=json.dumps({"job_id": job_id}))
            return
        if rows:
            last_sent, wait = time.monotonic(), poll_s
            continue
        if time.monotonic() - last_sent >= SSE_KEEPALIVE_S:
            yield ServerSentEvent(comment="keep-alive")
            last_sent = time.monotonic()
        # [Note: idle streams poll less] A stream with nothing new backs off (×2 up to
        # IDLE_POLL_S) and returns to poll_s as soon as rows arrive: hundreds of idle
        # streams must not turn into thousands of queries a second.
        wait = min(wait * 2, max(poll_s, IDLE_POLL_S))
        await asyncio.sleep(wait)
