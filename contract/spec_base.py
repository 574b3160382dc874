"""What every block of the job spec shares: the strict base model, the limits, the field checks.

``SpecModel`` is strict and forbids unknown fields, so a typo in a spec is a 422 that names
the field. The limits keep a stored spec within what the database columns and the workers'
readers take. The blocks live in ``contract.spec_model`` (``model``), ``contract.spec_data``
(``data``, ``eval``) and ``contract.spec`` (the rest and ``JobSpec``, which re-exports all).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

SLUG_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
FACTORY_PATTERN = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$"
STORAGE_SCHEMES = ("file://", "s3://")
BACKSLASH_OR_CONTROL = re.compile(r"[\\\x00-\x1f\x7f]")  # refused in globs and name patterns
MAX_INT32 = 2**31 - 1  # integers are stored in 32-bit columns (and read by torch/numpy seeds)
MAX_INT64 = 2**63 - 1
MAX_JSON_DEPTH = 32  # dicts/lists inside one another in a free-form block (kwargs)
MAX_JSON_VALUES = 10_000  # values (containers and scalars) in one free-form block


def bounded_json(value: dict[str, Any]) -> dict[str, Any]:
    """Free-form JSON (a factory's ``kwargs``) that can be stored and served back.

    [Note: why bound it at validation] Whatever is accepted here is stored and later serialized
    into every list page that shows the job; pydantic refuses to serialize deeper than ~255
    levels, PostgreSQL refuses NaN/Infinity in JSON, and a huge block costs every reader. A
    value refused now is one 422 naming the field; a value refused later is a page that 500s
    for everyone who can see the job. Checked iteratively: a hostile depth cannot exhaust the
    Python stack here.
    """
    pending: list[tuple[Any, int]] = [(value, 1)]
    seen = 0
    while pending:
        node, depth = pending.pop()
        seen += 1
        if seen > MAX_JSON_VALUES:
            raise PydanticCustomError("json_too_large", "holds more than {limit} values", {"limit": MAX_JSON_VALUES})
        if isinstance(node, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise PydanticCustomError(
                    "json_too_deep", "is nested deeper than {limit} levels", {"limit": MAX_JSON_DEPTH})
            children = node.values() if isinstance(node, dict) else node
            pending.extend((child, depth + 1) for child in children)
        elif isinstance(node, float) and not math.isfinite(node):
            raise PydanticCustomError(
                "json_not_finite", "holds a non-finite number ({value}); JSON has none", {"value": repr(node)})
        elif not isinstance(node, (str, int, float, bool, type(None))):
            raise PydanticCustomError(
                "json_value", "holds a {kind}, which is not a JSON value", {"kind": type(node).__name__})
    return value


BoundedJson = Annotated[dict[str, Any], AfterValidator(bounded_json)]
"""A factory's keyword arguments: any JSON object within ``MAX_JSON_DEPTH`` / ``MAX_JSON_VALUES``."""


class SpecModel(BaseModel):
    """Base of every input model: strict types, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", strict=True)


def check_storage_uri(value: str) -> str:
    if not value.startswith(STORAGE_SCHEMES):
        raise PydanticCustomError(
            "uri_scheme", "must start with file:// or s3:// (got '{value}')", {"value": value}
        )
    return value


def check_factory_path(value: str) -> str:
    if not re.match(FACTORY_PATTERN, value):
        raise PydanticCustomError(
            "factory_path", "must look like 'package.module:function' (got '{value}')", {"value": value}
        )
    return value


MAX_URI_CHARS = 2048


def check_model_dir_uri(value: str) -> str:
    """A directory the workers read: ``file://``/``s3://``, or a plain absolute path (made ``file://``)."""
    if value.startswith("/"):
        value = f"file://{value}"
    if not value.startswith(STORAGE_SCHEMES):
        raise PydanticCustomError(
            "uri_scheme", "must be an absolute path or start with file:// or s3:// (got '{value}')", {"value": value})
    return value.rstrip("/")

