"""One JSON shape for every error: ``{"detail": "...", "errors": [{"field", "message", "type"}]}``.

Validation errors name the field as a dotted path inside the body (``train.micro_batch_size``)
or as the query/header parameter; the database being down is a 503, not a traceback, and so
is a saturated connection pool (with ``Retry-After``). Also the OpenAPI ``responses`` entries
routes declare: these error bodies, and the 200s whose body is text.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.schemas import ErrorOut

log = logging.getLogger(__name__)
_LOCATION_PREFIXES = {"body", "query", "path", "header"}
POOL_RETRY_AFTER_S = 1  # Retry-After of the 503 for a saturated connection pool


ERROR_DESCRIPTIONS = {
    400: "the body could not be read (e.g. not UTF-8)",
    401: "missing, invalid or revoked bearer token",
    403: "not allowed for this caller (e.g. a non-admin asking for another user's token)",
    404: "no such job (or not yours)",
    409: "conflicts with the job's state or an earlier request",
    413: "request body too large",
    422: "invalid request; `errors` names each bad field",
    429: "a per-user limit is reached (queued jobs, open event streams); with Retry-After",
    502: "a service the control plane relies on (the storage server's STS) refused or failed",
    503: "database unavailable, or busy (then with Retry-After)",
}
COMMON_ERRORS = (400, 401, 404, 413, 422, 503)


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these status codes, all in the ``ErrorOut`` shape."""
    return {code: {"model": ErrorOut, "description": ERROR_DESCRIPTIONS[code]} for code in codes}


def text_response(media_type: str, description: str) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` entry of a 200 whose body is text (logs, SSE, Prometheus).

    [Note: text bodies carry a schema] A content type with no ``schema`` reads as "no body" to
    client generators: openapi-python-client then returns ``None`` for the route instead of the
    text. ``{"type": "string"}`` makes it hand back ``response.text``; the bytes are unchanged.
    """
    return {200: {"content": {media_type: {"schema": {"type": "string"}}}, "description": description}}


def field_name(error: dict[str, Any]) -> str | None:
    named = (error.get("ctx") or {}).get("field")
    if named:
        return str(named)
    loc = [str(part) for part in error.get("loc", ())]
    if loc and loc[0] in _LOCATION_PREFIXES:
        loc = loc[1:]
    return ".".join(loc) or None


def field_error(field: str, message: str, error_type: str) -> RequestValidationError:
    """A 422 for a rule the schema cannot express (it needs the caller or the database),
    answered in the same shape as every other validation error; ``field`` is dotted."""
    return RequestValidationError([{"loc": ("body", *field.split(".")), "msg": message, "type": error_type}])


def error_body(detail: str, errors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"detail": detail, "errors": errors or []}


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [
        {"field": field_name(error), "message": error.get("msg", "invalid"), "type": error.get("type")}
        for error in exc.errors()
    ]
    summary = "; ".join(f"{e['field']}: {e['message']}" if e["field"] else e["message"] for e in errors)
    return JSONResponse(error_body(f"invalid request: {summary}", errors), status_code=422)


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _database_error(_request: Request, exc: DBAPIError) -> JSONResponse:
    log.error("database error: %s", exc.orig if exc.orig is not None else exc)
    return JSONResponse(error_body("database unavailable; try again shortly"), status_code=503)


async def _pool_exhausted(_request: Request, exc: PoolTimeout) -> JSONResponse:
    """Every pooled connection stayed busy for ``db_pool_timeout_s``: the server is saturated, so it
    sheds this request at once and says when to come back rather than queueing it longer."""
    log.error("no database connection free: %s", exc)
    return JSONResponse(error_body("database busy; try again shortly"), status_code=503,
                        headers={"Retry-After": str(POOL_RETRY_AFTER_S)})


async def _data_error(_request: Request, exc: DataError) -> JSONResponse:
    """The database refused a value (an integer past its column, a NUL byte in text): the
    request's fault, not an outage, so a 422 rather than the 503 of other database errors."""
    log.warning("database refused a value: %s", exc.orig if exc.orig is not None else exc)
    return JSONResponse(error_body("a value in the request cannot be stored (out of range or a NUL "
                                   "character)"), status_code=422)


async def _unexpected_error(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body("internal server error"), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(DataError, _data_error)
    app.add_exception_handler(PoolTimeout, _pool_exhausted)
    app.add_exception_handler(OperationalError, _database_error)
    app.add_exception_handler(DBAPIError, _database_error)
    app.add_exception_handler(Exception, _unexpected_error)
