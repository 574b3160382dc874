"""The SDK's exceptions: every HTTP error becomes one of these, carrying the server's message.

``error_from_response`` picks the class from the status; ``service.client`` re-exports them all.
"""

from __future__ import annotations

import httpx


class ZerotrainError(Exception):
    """Base of every SDK error; ``status`` is the HTTP status (None if there was no answer)."""

    def __init__(self, message: str, status: int | None = None, errors: list[dict] | None = None):
        super().__init__(message)
        self.message, self.status, self.errors = message, status, errors or []


class Unauthorized(ZerotrainError):
    pass


class NotFound(ZerotrainError):
    pass


class Conflict(ZerotrainError):
    pass


class ValidationFailed(ZerotrainError):
    """422: ``errors`` lists ``{"field", "message", "type"}`` for each bad field."""

    @property
    def fields(self) -> list[str]:
        return [error.get("field") or "" for error in self.errors]


class PayloadTooLarge(ZerotrainError):
    pass


class ServerError(ZerotrainError):
    pass


class ServiceUnavailable(ZerotrainError):
    pass


class WaitTimeout(ZerotrainError):
    pass


_ERRORS_BY_STATUS: dict[int, type[ZerotrainError]] = {
    401: Unauthorized, 403: Unauthorized, 404: NotFound, 409: Conflict, 413: PayloadTooLarge,
    422: ValidationFailed, 503: ServiceUnavailable,
}


def error_from_response(response: httpx.Response) -> ZerotrainError:
    try:
        body = response.json()
        message, errors = str(body.get("detail", response.text)), body.get("errors") or []
    except (ValueError, AttributeError):
        message, errors = response.text or response.reason_phrase, []
    kind = _ERRORS_BY_STATUS.get(response.status_code)
    if kind is None:
        kind = ServerError if response.status_code >= 500 else ZerotrainError
    return kind(message, response.status_code, errors)
