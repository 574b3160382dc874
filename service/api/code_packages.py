"""Packages of the user's code: upload a zip once, find it again by its sha256 (service/code_packages.py).

The body is the zip itself (``application/octet-stream`` or ``application/zip``), at most
``Settings.max_code_package_bytes`` (the body-size middleware applies that limit to this path
instead of ``max_body_bytes``). Packages are kept per user, so one user never learns whether
another uploaded the same bytes.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request, Response
from fastapi.concurrency import run_in_threadpool

from service.api.deps import CurrentUser, SettingsDep
from service.api.errors import error_responses, field_error
from service.api.links import links_for
from service.code_packages import BadPackage, check_package, find_package, megabytes, store_package
from service.schemas import CodePackageOut
from service.storage_policy import UnsafeUri

router = APIRouter(prefix="/code-packages", tags=["code"])
PATH = "/code-packages"  # the body-size middleware's exception (service.app)

_ZIP_BODY = {"requestBody": {"required": True, "description": "the zip of the code (what `zerotrain submit` builds "
                             "from a local runtime.working_dir)",
                             "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


@router.post("", status_code=201, response_model=CodePackageOut, name="upload_code_package",
             openapi_extra=_ZIP_BODY,
             responses={200: {"model": CodePackageOut, "description": "already uploaded: the same package"},
                        **error_responses(403), **links_for("upload_code_package", 201)},
             description="Keep a zip of the caller's code under its sha256 and answer the URI for "
                         "`runtime.working_dir`. The zip must unpack safely (relative paths, bounded size) "
                         "and must not hold a lone top-level directory (its contents are the working directory).")
async def upload_code_package(request: Request, response: Response, user: CurrentUser,
                              settings: SettingsDep) -> CodePackageOut:
    if not settings.allow_user_code and not user.is_admin:
        raise HTTPException(403, "user code is disabled on this service")
    data = await request.body()  # bounded by the middleware
    if len(data) > settings.max_code_package_bytes:  # a body without Content-Length is cut there, too
        raise HTTPException(413, f"the package is {megabytes(len(data))}, more than this service's "
                                 f"{megabytes(settings.max_code_package_bytes)} limit")
    try:
        check_package(data)
    except BadPackage as refused:
        raise field_error("body", str(refused), "bad_package") from None
    try:
        stored, created = await run_in_threadpool(store_package, settings.storage_uri, user.name, data)
    except UnsafeUri as refused:  # a user whose name is not a path segment has no storage area
        raise HTTPException(403, str(refused)) from None
    response.status_code = 201 if created else 200
    return CodePackageOut(sha256=stored.sha256, uri=stored.uri, size_bytes=stored.size_bytes)


@router.get("/{sha256}", response_model=CodePackageOut, name="get_code_package",
            description="The caller's package with this sha256 (404 when they have not uploaded it).")
def get_code_package(sha256: Annotated[str, Path(pattern=r"^[0-9a-f]{64}$")], user: CurrentUser,
                     settings: SettingsDep) -> CodePackageOut:
    try:
        stored = find_package(settings.storage_uri, user.name, sha256)
    except UnsafeUri:
        stored = None
    if stored is None:
        raise HTTPException(404, f"no package {sha256} of yours")
    return CodePackageOut(sha256=stored.sha256, uri=stored.uri, size_bytes=stored.size_bytes)
