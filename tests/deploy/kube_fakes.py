"""In-memory stand-ins for the two Kubernetes API classes the KubeRay launcher calls.

Only the API server is faked (nothing real can run here): each fake keeps objects the way
the server would, raises the client's own ``ApiException`` with the server's status codes,
records every call in order, and returns pods as the real client's model objects.
"""

from __future__ import annotations

import copy
import json
import uuid

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException


def api_error(status: int, reason: str) -> ApiException:
    return ApiException(status=status, reason=reason)


class FakeCustomObjectsApi:
    def __init__(self, calls: list[tuple]) -> None:
        self.calls = calls
        self.objects: dict[tuple[str, str], dict] = {}
        self.refuse_create: ApiException | None = None

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **_):
        self.calls.append(("create", body["kind"], namespace, body["metadata"]["name"]))
        if self.refuse_create is not None:
            raise self.refuse_create
        key = (namespace, body["metadata"]["name"])
        if key in self.objects:
            raise api_error(409, "AlreadyExists")
        stored = copy.deepcopy(body)
        stored["metadata"]["uid"] = str(uuid.uuid4())
        self.objects[key] = stored
        return copy.deepcopy(stored)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **_):
        self.calls.append(("get", "RayJob", namespace, name))
        if (namespace, name) not in self.objects:
            raise api_error(404, "NotFound")
        return copy.deepcopy(self.objects[(namespace, name)])

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **kwargs):
        self.calls.append(("delete", "RayJob", namespace, name))
        if self.objects.pop((namespace, name), None) is None:
            raise api_error(404, "NotFound")
        return {"kind": "Status", "status": "Success"}


class FakeCoreV1Api:
    def __init__(self, calls: list[tuple]) -> None:
        self.calls = calls
        self.secrets: dict[tuple[str, str], dict] = {}
        self.pods: list[dict] = []
        self.pod_logs: dict[str, str] = {}

    def create_namespaced_secret(self, namespace, body, **_):
        self.calls.append(("create", "Secret", namespace, body["metadata"]["name"]))
        key = (namespace, body["metadata"]["name"])
        if key in self.secrets:
            raise api_error(409, "AlreadyExists")
        self.secrets[key] = copy.deepcopy(body)

    def patch_namespaced_secret(self, name, namespace, body, **_):
        self.calls.append(("patch", "Secret", namespace, name))
        if (namespace, name) not in self.secrets:
            raise api_error(404, "NotFound")
        secret = self.secrets[(namespace, name)]
        secret.setdefault("stringData", {}).update(body.get("stringData", {}))
        secret["metadata"].update(body.get("metadata", {}))

    def delete_namespaced_secret(self, name, namespace, **_):
        self.calls.append(("delete", "Secret", namespace, name))
        if self.secrets.pop((namespace, name), None) is None:
            raise api_error(404, "NotFound")

    def list_namespaced_pod(self, namespace, label_selector="", **_):
        self.calls.append(("list", "Pod", namespace, label_selector))
        wanted = dict(part.split("=", 1) for part in label_selector.split(",") if part)
        items = [p for p in self.pods
                 if p["metadata"].get("namespace", namespace) == namespace
                 and wanted.items() <= p["metadata"].get("labels", {}).items()]
        data = {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
        return ApiClient().deserialize(json.dumps(data), "V1PodList", "application/json")

    def read_namespaced_pod_log(self, name, namespace, container=None, **_):
        self.calls.append(("log", "Pod", namespace, name if container is None else f"{name}/{container}"))
        if name not in self.pod_logs:
            raise api_error(404, "NotFound")
        return self.pod_logs[name]
