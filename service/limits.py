"""Refuse request bodies over ``max_body_bytes`` before any handler sees them (413).

A declared ``Content-Length`` is checked up front; a chunked body is counted as it arrives and
cut off at the limit, so a client cannot stream an unbounded body into memory. A path in
``limits`` has its own limit instead (the upload of a code package is larger than any JSON body).

[Note: not the framework's limit] FastAPI's ``max_body_size`` (Starlette's
``RequestBodyLimitMiddleware``) counts chunked bodies too, but a declared ``Content-Length`` past
the limit gets a fixed ``text/plain`` "Content Too Large" in place of whatever the app answers, past
the app's error handlers: no JSON error body, and the limit is not named.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    """Raised from ``receive``: FastAPI re-raises HTTPExceptions met while reading a body."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body too large: the limit is {max_bytes} bytes")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, limits: dict[str, int] | None = None):
        self.app, self.default_max_bytes, self.limits = app, max_bytes, dict(limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.limits.get(scope.get("path", ""), self.default_max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await self._refuse(send, max_bytes)
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    raise BodyTooLarge(max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send, max_bytes)

    @staticmethod
    async def _refuse(send: Send, max_bytes: int) -> None:
        body = json.dumps({"detail": BodyTooLarge(max_bytes).detail, "errors": []}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
