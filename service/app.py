"""The FastAPI application factory: ``create_app(settings)``.

Start-up migrates the database (see ``service.migrate`` for why the service migrates itself),
creates the local admin token when the embedded default is used, builds the launcher and
starts the scheduler thread; shutdown stops them in reverse order.
"""

from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.routing import APIRoute

from service import dashboard, log_redaction, migrate, prediction
from service.api import (
    checkpoints,
    code_packages,
    health,
    jobs,
    memory_check,
    metrics,
    plan,
    step_time,
    teams,
    tensorboard,
    tokens,
    webhooks,
    workers,
)
from service.api.deps import current_user
from service.api.errors import COMMON_ERRORS, error_responses, install_error_handlers
from service.auth import ensure_local_admin_token, register_admin_token
from service.db import make_engine, make_sessionmaker
from service.launchers import make_launcher
from service.leadership import SOLE_LEADER, Lease, make_lease
from service.limits import BodySizeLimit
from service.observability import RequestMetrics, RouteTemplates, ServiceMetrics
from service.scheduler import Scheduler, replica_identity
from service.settings import Settings
from service.stream_slots import make_stream_slots
from service.webhooks import WebhookSender

log = logging.getLogger(__name__)
API_PREFIX = "/api/v1"
WARM_UP_JOIN_S = 60.0  # longest shutdown waits for the planner warm-up


def _operation_id(route: APIRoute) -> str:
    return route.name


def _wake_all(*loops):
    """On gaining the lease: the duties' next passes now, not after their poll interval."""
    return lambda: [loop.wake() for loop in loops]


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    log_redaction.install()
    engine = make_engine(settings.database_url, settings)
    make_session = make_sessionmaker(engine)
    service_metrics = ServiceMetrics(make_session)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        migrate.upgrade(settings.database_url)
        if settings.bootstrap_admin:
            ensure_local_admin_token(make_session, settings.token_file)
        if settings.bootstrap_admin_token is not None:
            register_admin_token(make_session, settings.bootstrap_admin_token.get_secret_value())
        # [Note: the warm-up is joined] It imports torch and traces a model (seconds). A daemon
        # thread still inside torch when the interpreter exits kills the process with SIGABRT
        # ("terminate called without an active exception"), so shutdown waits for it.
        warm_up = threading.Thread(target=prediction.warm_up, name="planner-warm-up", daemon=True)
        warm_up.start()
        app.state.planner_warm_up = warm_up
        launcher = make_launcher(settings)
        # [Note: replicas] the scheduler and the webhook sender act only while this replica
        # holds the leader lease (service.leadership); with the scheduler disabled (a scheduler
        # driven by hand, or another process's) the loops are not started and nothing is fenced.
        identity = replica_identity()
        lease = make_lease(make_session, identity, settings) if settings.scheduler_enabled else SOLE_LEADER
        scheduler = Scheduler(make_session, launcher, settings, identity=identity, lease=lease)
        webhook_sender = WebhookSender(make_session, settings, lease=lease)
        if isinstance(lease, Lease):
            lease.on_gain = _wake_all(scheduler, webhook_sender)
        app.state.launcher = launcher
        app.state.scheduler = scheduler
        app.state.lease = lease
        if settings.scheduler_enabled:
            lease.start()
            scheduler.start()
            app.state.wake_scheduler = scheduler.wake
            webhook_sender.start()
        try:
            yield
        finally:
            scheduler.stop()
            webhook_sender.stop()
            lease.stop()  # after the duties: hands the lease over at once
            launcher.close()
            app.state.stream_slots.close()
            engine.dispose()
            warm_up.join(WARM_UP_JOIN_S)

    app = FastAPI(title="zerotrain", version="0.1.0", lifespan=lifespan,
                  generate_unique_id_function=_operation_id,
                  description="Self-hostable training service: jobs, metrics, checkpoints.")
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessionmaker = make_session
    app.state.service_metrics = service_metrics
    app.state.wake_scheduler = None
    app.state.stopping = threading.Event()  # set on SIGTERM/SIGINT (``zerotrain serve``): streams end
    app.state.stream_slots = make_stream_slots(engine, settings.max_streams_per_user, settings.stream_poll_threads)

    install_error_handlers(app)
    for router in (jobs.router, metrics.router, workers.router, memory_check.router, step_time.router,
                   checkpoints.router, tokens.router, code_packages.router, webhooks.router, tensorboard.router,
                   teams.router):
        app.include_router(router, prefix=API_PREFIX, responses=error_responses(*COMMON_ERRORS))
    # the plan router declares no auth of its own (it is the planner over HTTP): it is added here
    app.include_router(plan.router, prefix=API_PREFIX, dependencies=[Depends(current_user)],
                       responses=error_responses(400, 401, 413, 422, 503))
    app.include_router(health.router, responses=error_responses(503))
    app.include_router(dashboard.router)  # no prefix: the dashboard's router carries its own paths
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes,
                       limits={API_PREFIX + code_packages.PATH: settings.max_code_package_bytes})
    app.add_middleware(RequestMetrics, metrics=service_metrics, templates=RouteTemplates(app))
    return app
