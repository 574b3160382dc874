"""The dashboard's HTML shell and static assets, served by the control plane itself.

The dashboard is a single page with path routes (``/`` for the jobs list, ``/jobs/compare?ids=A,B``
for runs side by side, ``/jobs/{id}`` for a job); all return the same shell and the browser renders the route. Assets are served by a
plain route rather than a ``StaticFiles`` mount so that the whole dashboard is one
``APIRouter`` the app can ``include_router`` (mounts are not carried by ``include_router``).
Everything is vendored: the page makes no request outside its own origin.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse, HTMLResponse

STATIC_DIR = Path(__file__).parent / "static"
_MEDIA_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".html": "text/html; charset=utf-8",
}

router = APIRouter(include_in_schema=False)


def _shell() -> HTMLResponse:
    # No caching of the shell so that a new deployment's asset list is picked up at once.
    html = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    return HTMLResponse(html, headers={"Cache-Control": "no-cache"})


@router.get("/", response_class=HTMLResponse)
def jobs_page() -> HTMLResponse:
    return _shell()


@router.get("/jobs/compare", response_class=HTMLResponse)
def compare_page() -> HTMLResponse:
    return _shell()


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(job_id: str) -> HTMLResponse:  # noqa: ARG001 - the browser reads the id from the URL
    return _shell()


@router.get("/static/{asset_path:path}")
def static_asset(asset_path: str) -> FileResponse:
    path = (STATIC_DIR / asset_path).resolve()
    if STATIC_DIR.resolve() not in path.parents or not path.is_file():
        raise HTTPException(status_code=404, detail="no such asset")
    media_type = _MEDIA_TYPES.get(path.suffix)
    return FileResponse(path, media_type=media_type, headers={"Cache-Control": "no-cache"})
