"""Keep credentials out of the control plane's logs.

The API refuses tokens in a query string, but uvicorn's access log writes the whole request
line before any handler runs, so ``GET /api/v1/jobs?token=zt_…`` put a working token into the
log for whoever reads it (log shippers, ``kubectl logs``). This filter rewrites every log
record of the server's loggers: values of query parameters whose name looks like a
credential, and anything shaped like one of our tokens, become ``[redacted]``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from service.auth import USER_TOKEN_PREFIX

# ?token=…, &api_key=…, &X-Amz-Signature=…: the value up to the next & or whitespace.
_SECRET_PARAMETER = re.compile(
    r"(?i)([?&][^=&\s]*(?:token|key|secret|password|passwd|auth|signature|credential)[^=&\s]*=)[^&\s\"]*")
_TOKEN = re.compile(re.escape(USER_TOKEN_PREFIX) + r"[A-Za-z0-9_\-]{8,}")
REDACTED = "[redacted]"
LOGGERS = ("uvicorn.access", "uvicorn.error", "uvicorn", "service")


def redact(text: str) -> str:
    return _TOKEN.sub(USER_TOKEN_PREFIX + REDACTED, _SECRET_PARAMETER.sub(r"\1" + REDACTED, text))


def _redact_value(value: Any) -> Any:
    return redact(value) if isinstance(value, str) else value


class RedactSecrets(logging.Filter):
    """Rewrites a record's message and arguments in place; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_redact_value(arg) for arg in record.args)
        elif isinstance(record.args, dict):
            record.args = {key: _redact_value(arg) for key, arg in record.args.items()}
        return True


_FILTER = RedactSecrets()


def install() -> None:
    """Attach the filter to the server's loggers (idempotent: a logger holds it once)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
