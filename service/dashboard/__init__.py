"""The web dashboard: pages at ``/`` and ``/jobs/{id}``, assets at ``/static/``, and the two
REST endpoints the pages need beyond the control plane's (``api.py``).

Mount with ``app.include_router(service.dashboard.router)`` — no prefix: the router carries
its own paths (``/api/v1/...`` for its endpoints).
"""

from fastapi import APIRouter

from service.dashboard.api import router as api_router
from service.dashboard.pages import router as pages_router

router = APIRouter()
router.include_router(api_router)
router.include_router(pages_router)

__all__ = ["router"]
