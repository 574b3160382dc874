"""A route class whose JSON body is parsed and validated in one pass by pydantic, for the routes
whose bodies are large (a worker's metric batch: up to ``MAX_METRIC_BATCH`` records).

FastAPI reads a JSON body with ``json.loads`` into dicts and lists, then validates those into
the body's model: two passes over every value, the first building Python objects only for the
second to read them again. Pydantic's own ``validate_json`` reads the bytes straight into the
model, several times faster for a body of many records.

[Note: FastAPI still answers every bad body]
The request's ``json()`` answers the validated model; FastAPI then validates the body as usual,
and pydantic passes an instance of the body's own model through unchanged (its default
``revalidate_instances='never'``), so that second validation costs nothing. A body that fails
the one-pass validation is answered from ``json.loads`` instead, as without this class: FastAPI
then validates the plain values and answers its 422 naming the field (or its JSON error), word
for word as for any other route. Only a valid body takes the fast path.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError


class _OnePassJsonRequest(Request):
    adapter: TypeAdapter  # set per route, on a subclass made for it

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = self.adapter.validate_json(await self.body())
            except ValidationError:  # [Note: FastAPI still answers every bad body]
                return await super().json()
        return self._json


class OnePassJsonRoute(APIRoute):
    """An ``APIRoute`` whose body, one pydantic model (not embedded), is read by ``validate_json``;
    pass it as ``route_class_override`` to ``APIRouter.add_api_route``. A route whose body is
    anything else is served as by ``APIRoute``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = self.body_field.field_info.annotation if self.body_field is not None else None
        embedded = getattr(self, "_embed_body_fields", True)  # a body {"name": model}: not this class's case
        if embedded or not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handler
        request_class = type("OnePassJsonRequest", (_OnePassJsonRequest,), {"adapter": TypeAdapter(model)})

        async def one_pass(request: Request) -> Response:
            return await handler(request_class(request.scope, request.receive))

        return one_pass
