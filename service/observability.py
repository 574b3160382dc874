"""Prometheus metrics of the control plane, one registry per app (tests run several apps).

``zerotrain_jobs`` (by state) is read from the database at scrape time, so every replica
reports the same truth; request and ingest counters are per process.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.models import Job
from service.schemas import JobState


class JobsByState(Collector):
    def __init__(self, make_session: sessionmaker[Session]):
        self.make_session = make_session

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("zerotrain_jobs", "Jobs by state", labels=["state"])
        counts = {state.value: 0 for state in JobState}
        with self.make_session() as session:
            for state, count in session.execute(select(Job.state, func.count()).group_by(Job.state)):
                counts[state] = count
        for state, count in counts.items():
            family.add_metric([state], count)
        yield family


class ServiceMetrics:
    def __init__(self, make_session: sessionmaker[Session]):
        self.registry = CollectorRegistry()
        self.requests = Counter("zerotrain_http_requests", "HTTP requests",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("zerotrain_http_request_seconds", "HTTP request latency",
                                 ["method", "route"], registry=self.registry)
        self.metric_points = Counter("zerotrain_metric_points_ingested",
                                     "Metric records stored (duplicates excluded)", registry=self.registry)
        self.registry.register(JobsByState(make_session))


class RouteTemplates:
    """Maps a request path to its OpenAPI path template, keeping label cardinality bounded."""

    def __init__(self, app: FastAPI):
        self.app = app
        self._patterns: list[tuple[re.Pattern[str], str]] | None = None

    def __call__(self, path: str) -> str:
        if self._patterns is None:
            self._patterns = [(compile_path(template)[0], template) for template in self.app.openapi()["paths"]]
        return next((template for pattern, template in self._patterns if pattern.match(path)), "unmatched")


class RequestMetrics:
    """ASGI middleware counting requests by route template (not raw path) and status."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, templates: RouteTemplates):
        self.app, self.metrics, self.templates = app, metrics, templates

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = self.templates(scope["path"])
            self.metrics.requests.labels(scope["method"], route, str(status)).inc()
            self.metrics.latency.labels(scope["method"], route).observe(time.perf_counter() - started)
