"""A Kubernetes API server for exactly the routes the KubeRay launcher uses, over real HTTP.

Why: the official client's serialisation (paths, query strings, patch content types, error
bodies) is part of what can break, and no cluster runs here. This server keeps objects like
the real one, answers with the real status codes and ``Status`` bodies, authorises every
request against the Role in deploy/components/kuberay-launcher/rbac.yaml (403 otherwise),
and refuses bodies the real server would refuse: RayJobs that do not match KubeRay's CRD
(when ``KUBERAY_CRD_DIR`` is set), Secrets that do not match the Secret schema, and patches
whose body does not fit their content type.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

import deploy_schemas

PATCH_TYPES = ("application/merge-patch+json", "application/strategic-merge-patch+json",
               "application/json-patch+json")


def status_body(code: int, reason: str, message: str) -> JSONResponse:
    return JSONResponse({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                         "message": message, "reason": reason, "code": code}, status_code=code)


def _qualified(group: str, resource: str) -> str:
    """How the API server names a resource in messages: ``rayjobs.ray.io``, or ``secrets`` (core group)."""
    return f"{resource}.{group}" if group else resource


class Refused(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.response = status_body(code, reason, message)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class FakeApiServer:
    def __init__(self, role_rules: list[dict[str, Any]]) -> None:
        self.rules = role_rules
        self.rayjobs: dict[tuple[str, str], dict] = {}
        self.secrets: dict[tuple[str, str], dict] = {}
        self.pods: list[dict] = []
        self.pod_logs: dict[str, str] = {}
        self.requests: list[tuple[str, str, str, str]] = []  # (verb, group/resource, namespace, name)
        self.patch_content_types: list[str] = []
        self.app = self._build_app()

    # -- authorisation and validation --

    def _authorize(self, verb: str, group: str, resource: str, namespace: str, name: str = "") -> None:
        self.requests.append((verb, f"{group}/{resource}" if group else resource, namespace, name))
        for rule in self.rules:
            if group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]:
                return
        raise Refused(403, "Forbidden", f'cannot {verb} resource "{resource}" in API group "{group}"')

    @staticmethod
    def _valid(obj: dict[str, Any], crd: bool) -> None:
        try:
            if crd:
                if deploy_schemas.crd_dir() is not None:
                    deploy_schemas.validate_crd(obj)
            else:
                deploy_schemas.validate_core(obj)
        except Exception as exc:  # the API server answers 422 Invalid
            raise Refused(422, "Invalid", str(exc)) from exc

    # -- routes --

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.exception_handler(Refused)
        async def refused(_request: Request, exc: Refused) -> JSONResponse:
            return exc.response

        rayjobs = "/apis/ray.io/v1/namespaces/{ns}/rayjobs"

        @app.post(rayjobs, status_code=201)
        async def create_rayjob(ns: str, request: Request) -> dict:
            body, key = await self._new(request, ns, self.rayjobs, "ray.io", "rayjobs", crd=True)
            stored = copy.deepcopy(body)
            stored["metadata"].update(namespace=ns, uid=str(uuid.uuid4()),
                                      creationTimestamp=datetime.now(timezone.utc).isoformat())
            self.rayjobs[key] = stored
            return stored

        @app.get(rayjobs + "/{name}")
        async def get_rayjob(ns: str, name: str) -> dict:
            self._authorize("get", "ray.io", "rayjobs", ns, name)
            return self._existing(self.rayjobs, ns, name, "rayjobs.ray.io")

        @app.delete(rayjobs + "/{name}")
        async def delete_rayjob(ns: str, name: str) -> dict:
            deleted = self._delete(ns, name, self.rayjobs, "ray.io", "rayjobs")
            self._collect_garbage(ns)
            return deleted

        secrets = "/api/v1/namespaces/{ns}/secrets"

        @app.post(secrets, status_code=201)
        async def create_secret(ns: str, request: Request) -> dict:
            body, key = await self._new(request, ns, self.secrets, "", "secrets", crd=False)
            self.secrets[key] = copy.deepcopy(body)
            return self._redacted(body)

        @app.patch(secrets + "/{name}")
        async def patch_secret(ns: str, name: str, request: Request) -> dict:
            self._authorize("patch", "", "secrets", ns, name)
            content_type = request.headers.get("content-type", "").split(";")[0]
            self.patch_content_types.append(content_type)
            body = json.loads(await request.body())
            if content_type not in PATCH_TYPES:
                raise Refused(415, "UnsupportedMediaType", f"unsupported patch type {content_type}")
            if content_type == "application/json-patch+json" and not isinstance(body, list):
                raise Refused(400, "BadRequest", "json: cannot unmarshal object into Go value of type jsonpatch.Patch")
            if content_type == "application/json-patch+json":
                raise Refused(400, "BadRequest", "this fake applies merge patches only")
            patched = merge_patch(self._existing(self.secrets, ns, name, "secrets"), body)
            self._valid(patched, crd=False)
            self.secrets[(ns, name)] = patched
            return self._redacted(patched)

        @app.delete(secrets + "/{name}")
        async def delete_secret(ns: str, name: str) -> dict:
            return self._delete(ns, name, self.secrets, "", "secrets")

        @app.get("/api/v1/namespaces/{ns}/pods")
        async def list_pods(ns: str, labelSelector: str = "") -> dict:  # noqa: N803 - the API's name
            self._authorize("list", "", "pods", ns)
            wanted = dict(part.split("=", 1) for part in labelSelector.split(",") if part)
            items = [p for p in self.pods if wanted.items() <= p["metadata"].get("labels", {}).items()]
            return {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}

        @app.get("/api/v1/namespaces/{ns}/pods/{name}/log")
        async def pod_log(ns: str, name: str, container: str | None = None) -> PlainTextResponse:
            self._authorize("get", "", "pods/log", ns, name)
            if name not in self.pod_logs:
                raise Refused(404, "NotFound", f'pods "{name}" not found')
            return PlainTextResponse(self.pod_logs[name])

        return app

    # -- what every create and delete does, in the real server's order --

    async def _new(self, request: Request, ns: str, store: dict, group: str, resource: str,
                   crd: bool) -> tuple[dict, tuple[str, str]]:
        """A create's body and key once it is authorised, valid and its name is free (409 otherwise)."""
        body = await request.json()
        self._authorize("create", group, resource, ns, body["metadata"]["name"])
        self._valid(body, crd=crd)
        key = (ns, body["metadata"]["name"])
        if key in store:
            raise Refused(409, "AlreadyExists", f'{_qualified(group, resource)} "{key[1]}" already exists')
        return body, key

    def _delete(self, ns: str, name: str, store: dict, group: str, resource: str) -> dict:
        self._authorize("delete", group, resource, ns, name)
        self._existing(store, ns, name, _qualified(group, resource))
        del store[(ns, name)]
        return {"kind": "Status", "apiVersion": "v1", "status": "Success"}

    @staticmethod
    def _existing(store: dict, ns: str, name: str, what: str) -> dict:
        if (ns, name) not in store:
            raise Refused(404, "NotFound", f'{what} "{name}" not found')
        return copy.deepcopy(store[(ns, name)])

    @staticmethod
    def _redacted(secret: dict) -> dict:
        """What the server answers: stringData folded into data; never echoed in clear."""
        out = {k: v for k, v in secret.items() if k != "stringData"}
        out["data"] = {k: "<redacted>" for k in {**secret.get("data", {}), **secret.get("stringData", {})}}
        return out

    def _collect_garbage(self, ns: str) -> None:
        """Kubernetes' garbage collector: Secrets owned by a deleted RayJob go too."""
        live = {o["metadata"]["uid"] for o in self.rayjobs.values()}
        for key, secret in list(self.secrets.items()):
            owners = secret["metadata"].get("ownerReferences") or []
            if owners and not any(o["uid"] in live for o in owners):
                del self.secrets[key]


class ServerThread:
    """Serve an ASGI app on a free loopback port in a thread (stopped by ``stop``)."""

    def __init__(self, app: Any) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="fake-apiserver", daemon=True)

    def start(self, timeout: float = 20.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the fake API server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
