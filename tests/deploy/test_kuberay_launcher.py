"""The KubeRay launcher: its RayJob validates against KubeRay's CRD, its status mapping covers
every state KubeRay documents, and it talks to the API server as the Role allows."""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hypothesis import given, settings as hsettings, strategies as st

import deploy_schemas
from kube_fakes import FakeCoreV1Api, FakeCustomObjectsApi, api_error
from contract.reasons import Reason
from contract.spec import JobSpec
from service.launchers import kuberay
from service.launchers.base import Launcher, LaunchHandle, LaunchPhase, LaunchRequest

TOKEN = "zt_ingest_3f9c2a7b1e8d4c6f0a5b9e2d7c1f8a4b"
RECORDED = yaml.safe_load((Path(__file__).parent / "rayjob_statuses.yaml").read_text())
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")

SETTINGS = SimpleNamespace(kuberay_namespace="zerotrain", kuberay_image="registry.example.com/zerotrain:0.1.0",
                           kuberay_ttl_seconds=600, kuberay_storage_secret="zerotrain-storage",
                           api_url_for_workers="http://zerotrain:8000")


def request(job_id="0193a5c2-7d1e-7b9a-8c3f-2e4d6a8b0c1d", attempt=1, **resources) -> LaunchRequest:
    spec = JobSpec.model_validate({
        "name": "sample", "model": {"preset": "gpt-mini"}, "data": {"kind": "synthetic", "seq_len": 64},
        "train": {"steps": 10, "global_batch_size": 8, "micro_batch_size": 1},
        "resources": {"num_workers": 2, "gpus_per_worker": 0, "cpus_per_worker": 2, **resources}})
    return LaunchRequest(job_id=job_id, attempt=attempt, spec=spec, api_url="http://zerotrain:8000",
                         ingest_token=TOKEN, storage_uri="s3://zerotrain/checkpoints")


def gpu_request(max_runtime_s=7200) -> LaunchRequest:
    base = request(num_workers=4, gpus_per_worker=2, cpus_per_worker=8)
    spec = base.spec.model_copy(update={"max_runtime_s": max_runtime_s})
    return LaunchRequest(base.job_id, 3, spec, base.api_url, TOKEN, base.storage_uri)


def containers(rayjob: dict) -> list[dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"], rayjob["spec"]["submitterPodTemplate"]]
    templates += [g["template"] for g in cluster["workerGroupSpecs"]]
    return [c for t in templates for c in t["spec"]["containers"]]


@pytest.fixture
def cluster():
    calls: list[tuple] = []
    custom, core = FakeCustomObjectsApi(calls), FakeCoreV1Api(calls)
    launcher = kuberay.KubeRayLauncher(SETTINGS, custom_api=custom, core_api=core)
    return SimpleNamespace(launcher=launcher, custom=custom, core=core, calls=calls)


# --- Must show 2: the RayJob for a sample job validates against the CRD --------------------

@pytest.mark.parametrize("make", [request, gpu_request, lambda: request(job_id="Job_ÄÖ.weird id" * 5)])
def test_rayjob_validates_against_kuberay_crd(make, need_crds):
    deploy_schemas.validate_crd(kuberay.build_rayjob(make(), SETTINGS))


@pytest.mark.parametrize("make", [request, gpu_request])
def test_rayjob_pods_validate_as_kubernetes_pods(make):
    """The pod templates inside the RayJob are real pod specs (the CRD leaves metadata open)."""
    rayjob = kuberay.build_rayjob(make(), SETTINGS)
    cluster = rayjob["spec"]["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"], rayjob["spec"]["submitterPodTemplate"],
                 *(g["template"] for g in cluster["workerGroupSpecs"])]
    for template in templates:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **template["metadata"]},
               "spec": template["spec"]}
        deploy_schemas.validate_core(pod)


def test_rayjob_is_sized_from_the_job_and_cleans_up_after_itself():
    rayjob = kuberay.build_rayjob(gpu_request(max_runtime_s=5400), SETTINGS)
    spec = rayjob["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] == 600
    assert spec["activeDeadlineSeconds"] == 5400
    assert spec["backoffLimit"] == 0
    assert spec["entrypoint"] == ("python -m workers.launch --job-id 0193a5c2-7d1e-7b9a-8c3f-2e4d6a8b0c1d "
                                  "--api http://zerotrain:8000")
    (group,) = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 4
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"] == worker["resources"]["requests"] == \
        {"cpu": "8", "memory": f"{8 * 4 + 2 * 16}Gi", "nvidia.com/gpu": "2"}
    assert group["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    head = spec["rayClusterSpec"]["headGroupSpec"]
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert rayjob["metadata"]["labels"][kuberay.LABEL_JOB_ID] == "0193a5c2-7d1e-7b9a-8c3f-2e4d6a8b0c1d"
    assert rayjob["metadata"]["labels"][kuberay.LABEL_ATTEMPT] == "3"
    assert all(c["image"] == SETTINGS.kuberay_image for c in containers(rayjob))


def test_an_elastic_job_asks_for_num_workers_pods_and_accepts_min_workers(need_crds):
    rayjob = kuberay.build_rayjob(request(num_workers=2, min_workers=1), SETTINGS)
    deploy_schemas.validate_crd(rayjob)
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 1, 2)


def test_fractional_resources_round_to_what_kubernetes_can_give(need_crds):
    rayjob = kuberay.build_rayjob(request(gpus_per_worker=0.5, cpus_per_worker=1.5), SETTINGS)
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "1.5", "memory": f"{int(1.5 * 4 + 16)}Gi", "nvidia.com/gpu": "1"}
    deploy_schemas.validate_crd(rayjob)


def test_user_code_travels_as_a_ray_runtime_env():
    base = request()
    spec = JobSpec.model_validate({**base.spec.model_dump(mode="json"),
                                   "runtime": {"working_dir": "s3://zerotrain/code/mypkg.zip"}})
    rayjob = kuberay.build_rayjob(LaunchRequest(base.job_id, 1, spec, base.api_url, TOKEN, base.storage_uri),
                                  SETTINGS)
    assert yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"]) == {"working_dir": "s3://zerotrain/code/mypkg.zip"}
    assert "runtimeEnvYAML" not in kuberay.build_rayjob(base, SETTINGS)["spec"]


def test_cpu_job_has_no_gpu_and_no_deadline():
    rayjob = kuberay.build_rayjob(request(), SETTINGS)
    assert "activeDeadlineSeconds" not in rayjob["spec"]
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert "nvidia.com/gpu" not in group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "tolerations" not in group["template"]["spec"]


def test_ingest_token_reaches_ray_containers_only_through_the_secret():
    req = request()
    rayjob = kuberay.build_rayjob(req, SETTINGS)
    assert TOKEN not in json.dumps(rayjob), "the token must not be in the RayJob"
    assert TOKEN not in rayjob["spec"]["entrypoint"]
    secret = kuberay.build_ingest_secret(req, rayjob)
    deploy_schemas.validate_core(secret)
    assert secret["stringData"] == {kuberay.TOKEN_KEY: TOKEN}
    for container in containers(rayjob):
        env = {e["name"]: e for e in container.get("env", [])}
        if container["name"] == "ray-job-submitter":
            assert "ZEROTRAIN_INGEST_TOKEN" not in env
            continue
        assert env["ZEROTRAIN_INGEST_TOKEN"] == {"name": "ZEROTRAIN_INGEST_TOKEN", "valueFrom": {
            "secretKeyRef": {"name": secret["metadata"]["name"], "key": kuberay.TOKEN_KEY}}}
        assert env["ZEROTRAIN_JOB_ID"]["value"] == req.job_id
        assert env["ZEROTRAIN_API_URL"]["value"] == req.api_url
        assert env["ZEROTRAIN_STORAGE_URI"]["value"] == req.storage_uri
        assert container["envFrom"] == [{"secretRef": {"name": "zerotrain-storage", "optional": True}}]


def test_ray_pods_are_unprivileged_and_have_no_api_token():
    rayjob = kuberay.build_rayjob(gpu_request(), SETTINGS)
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"}
    templates = [cluster["headGroupSpec"]["template"], rayjob["spec"]["submitterPodTemplate"],
                 *(g["template"] for g in cluster["workerGroupSpecs"])]
    for template in templates:
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["serviceAccountName"] == "zerotrain-ray"
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in spec["containers"]:
            ctx = container["securityContext"]
            assert ctx["runAsUser"] == 1000 and ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"] == {"drop": ["ALL"]}


@hsettings(max_examples=200, deadline=None)
@given(job_id=st.text(min_size=1, max_size=120), attempt=st.integers(min_value=1, max_value=10_000))
def test_names_and_labels_are_valid_for_any_job_id(job_id, attempt):
    name = kuberay.rayjob_name(job_id, attempt)
    assert len(name) <= kuberay.MAX_NAME_LEN and DNS1123_LABEL.match(name), name
    assert len(kuberay.secret_name(name)) <= 63
    value = kuberay.label_value(job_id)
    assert len(value) <= 63 and LABEL_VALUE.match(value), value


def test_distinct_job_ids_get_distinct_names():
    ids = ["Job.1", "job-1", "job_1", "JOB-1", "x" * 80 + "a", "x" * 80 + "b"]
    names = {kuberay.rayjob_name(i, 1) for i in ids}
    assert len(names) == len(ids)
    assert kuberay.rayjob_name("job-1", 1) != kuberay.rayjob_name("job-1", 2)


# --- Must show 2: status mapping from recorded RayJob status objects ------------------------

@pytest.mark.parametrize("case", RECORDED, ids=[c["case"] for c in RECORDED])
def test_status_mapping(case):
    now = datetime.fromisoformat(case["now"].replace("Z", "+00:00")) if "now" in case else None
    got = kuberay.map_status(case["status"], now=now, pending_timeout_s=300)
    expect = case["expect"]
    assert got.phase == LaunchPhase[expect["phase"]]
    assert got.reason == expect["reason"]
    if "message_contains" in expect:
        assert expect["message_contains"] in (got.message or "")


@pytest.mark.parametrize("case", RECORDED, ids=[c["case"] for c in RECORDED])
def test_recorded_statuses_are_valid_rayjob_statuses(case, need_crds):
    rayjob = kuberay.build_rayjob(request(), SETTINGS)
    rayjob["status"] = case["status"]
    deploy_schemas.validate_crd(rayjob)


def test_recorded_statuses_cover_every_documented_state():
    deployment = {c["status"].get("jobDeploymentStatus", "") for c in RECORDED}
    assert {"", "Initializing", "Running", "Complete", "Failed", "ValidationFailed", "Suspending",
            "Suspended", "Retrying", "Waiting"} <= deployment
    reasons = {c["status"].get("reason") for c in RECORDED}
    assert {"DeadlineExceeded", "SubmissionFailed", "AppFailed", "ValidationFailed",
            "JobDeploymentStatusTransitionGracePeriodExceeded", "PreRunningDeadlineExceeded"} <= reasons


def test_every_ray_job_status_is_mapped():
    """Each JobStatus of the installed Ray (KubeRay copies it into .status.jobStatus)."""
    from ray.job_submission import JobStatus

    for status in JobStatus:
        got = kuberay.map_status({"jobDeploymentStatus": "Running", "jobStatus": status.value})
        terminal = got.phase in (LaunchPhase.SUCCEEDED, LaunchPhase.FAILED, LaunchPhase.STOPPED)
        assert terminal == status.is_terminal(), status
        assert got.phase != LaunchPhase.UNKNOWN


# --- the launcher against a fake API server ------------------------------------------------

def test_launcher_satisfies_the_protocol(cluster):
    assert isinstance(cluster.launcher, Launcher)
    assert cluster.launcher.name == "kuberay"


def test_start_creates_the_secret_then_the_rayjob_that_owns_it(cluster):
    handle = cluster.launcher.start(request())
    name = handle.external_id
    assert [c[:2] for c in cluster.calls] == [("create", "Secret"), ("create", "RayJob"), ("patch", "Secret")]
    assert handle.extra == {"namespace": "zerotrain", "secret": f"{name}-ingest"}
    rayjob = cluster.custom.objects[("zerotrain", name)]
    secret = cluster.core.secrets[("zerotrain", f"{name}-ingest")]
    assert secret["stringData"][kuberay.TOKEN_KEY] == TOKEN
    assert secret["metadata"]["ownerReferences"] == [
        {"apiVersion": "ray.io/v1", "kind": "RayJob", "name": name, "uid": rayjob["metadata"]["uid"]}]
    deploy_schemas.validate_core(secret)
    if deploy_schemas.crd_dir() is not None:  # what was sent, as KubeRay's CRD sees it
        del rayjob["metadata"]["uid"]
        deploy_schemas.validate_crd(rayjob)
    assert LaunchHandle.from_json(json.loads(json.dumps(handle.to_json()))) == handle


def test_start_again_adopts_the_rayjob_and_refreshes_the_token(cluster):
    first = cluster.launcher.start(request())
    again = LaunchRequest(request().job_id, 1, request().spec, "http://zerotrain:8000",
                          "zt_ingest_new", "s3://zerotrain/checkpoints")
    second = cluster.launcher.start(again)
    assert second == first
    assert len(cluster.custom.objects) == 1
    assert cluster.core.secrets[("zerotrain", first.extra["secret"])]["stringData"][kuberay.TOKEN_KEY] == "zt_ingest_new"


def test_start_removes_the_secret_when_the_rayjob_is_refused(cluster):
    cluster.custom.refuse_create = api_error(422, "Invalid")
    with pytest.raises(kuberay.KubeRayError, match="RayJob"):
        cluster.launcher.start(request())
    assert cluster.core.secrets == {}
    assert cluster.calls[-1][:2] == ("delete", "Secret")


def test_status_reads_the_rayjob(cluster):
    handle = cluster.launcher.start(request())
    assert cluster.launcher.status(handle).phase == LaunchPhase.PENDING
    cluster.custom.objects[("zerotrain", handle.external_id)]["status"] = {
        "jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "rayClusterName": "c1"}
    assert cluster.launcher.status(handle).phase == LaunchPhase.RUNNING
    assert cluster.core.secrets, "the token stays while the driver may still use it"
    cluster.custom.objects[("zerotrain", handle.external_id)]["status"] = {
        "jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}
    assert cluster.launcher.status(handle).phase == LaunchPhase.SUCCEEDED
    assert cluster.core.secrets == {}, "a finished job's token is deleted"
    assert cluster.launcher.status(handle).phase == LaunchPhase.SUCCEEDED  # and again: no error
    assert ("zerotrain", handle.external_id) in cluster.custom.objects, "the RayJob stays for its TTL"


def test_status_explains_unschedulable_pods_at_once(cluster):
    handle = cluster.launcher.start(gpu_request())
    cluster.custom.objects[("zerotrain", handle.external_id)]["status"] = {
        "jobDeploymentStatus": "Initializing", "rayClusterName": "zt-c1",
        "startTime": datetime.now().astimezone().isoformat()}
    why = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available."
    cluster.core.pods = [
        {"metadata": {"name": "zt-c1-head", "labels": {"ray.io/cluster": "zt-c1", "ray.io/node-type": "head"}},
         "status": {"phase": "Running"}},
        {"metadata": {"name": "zt-c1-workers-abcde", "labels": {"ray.io/cluster": "zt-c1"}},
         "status": {"phase": "Pending", "conditions": [
             {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}]}},
    ]
    got = cluster.launcher.status(handle)
    assert got.phase == LaunchPhase.PENDING
    assert got.reason == Reason.INSUFFICIENT_RESOURCES
    assert got.message == f"zt-c1-workers-abcde: {why}"


def test_status_of_a_vanished_rayjob_is_unknown(cluster):
    handle = cluster.launcher.start(request())
    del cluster.custom.objects[("zerotrain", handle.external_id)]
    got = cluster.launcher.status(handle)
    assert got.phase == LaunchPhase.UNKNOWN and handle.external_id in got.message


def test_cancel_deletes_the_rayjob_and_the_secret(cluster):
    handle = cluster.launcher.start(request())
    cluster.calls.clear()
    cluster.launcher.cancel(handle)
    assert cluster.calls == [("delete", "RayJob", "zerotrain", handle.external_id),
                             ("delete", "Secret", "zerotrain", handle.extra["secret"])]
    assert cluster.custom.objects == {} and cluster.core.secrets == {}
    cluster.launcher.cancel(handle)  # already gone: no error
    assert cluster.launcher.status(handle).phase == LaunchPhase.UNKNOWN


def test_logs_come_from_the_submitter_pod_then_the_head(cluster):
    handle = cluster.launcher.start(request())
    name = handle.external_id
    assert cluster.launcher.logs(handle) == ""
    cluster.custom.objects[("zerotrain", name)]["status"] = {"rayClusterName": "zt-c1"}
    cluster.core.pods = [{"metadata": {"name": "zt-c1-head-x", "creationTimestamp": "2026-11-29T10:00:00Z",
                                       "labels": {"ray.io/cluster": "zt-c1", "ray.io/node-type": "head"}}}]
    cluster.core.pod_logs["zt-c1-head-x"] = "head log\n"
    assert cluster.launcher.logs(handle) == "head log\n"
    assert cluster.calls[-1] == ("log", "Pod", "zerotrain", "zt-c1-head-x/ray-head")
    cluster.core.pods += [
        {"metadata": {"name": f"{name}-old", "creationTimestamp": "2026-11-29T10:01:00Z", "labels": {"job-name": name}}},
        {"metadata": {"name": f"{name}-new", "creationTimestamp": "2026-11-29T10:05:00Z", "labels": {"job-name": name}}},
    ]
    cluster.core.pod_logs[f"{name}-new"] = "step 1 loss 5.1\nstep 2 loss 4.8\n"
    assert cluster.launcher.logs(handle) == "step 1 loss 5.1\nstep 2 loss 4.8\n"
    assert cluster.launcher.logs(handle, tail_bytes=16) == "step 2 loss 4.8\n"
    assert cluster.launcher.logs(handle, tail_bytes=0) == ""


def test_options_come_from_settings_then_environment_then_defaults(monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_KUBERAY_IMAGE", "zerotrain:dev")
    monkeypatch.setenv("ZEROTRAIN_KUBERAY_TTL_SECONDS", "60")
    opts = kuberay.KubeRayOptions.from_settings(SimpleNamespace(kuberay_ttl_seconds=30))
    assert (opts.image, opts.ttl_seconds, opts.namespace) == ("zerotrain:dev", 30, "zerotrain")


def test_options_come_from_settings_with_defaults(monkeypatch):
    for name in [n for n in os.environ if n.startswith("ZEROTRAIN_")]:
        monkeypatch.delenv(name)
    opts = kuberay.KubeRayOptions.from_settings(SimpleNamespace(kuberay_ttl_seconds="120", kuberay_image=""))
    assert opts.ttl_seconds == 120 and opts.image == "zerotrain:latest" and opts.namespace == "zerotrain"
    assert kuberay.KubeRayOptions.from_settings(None) == kuberay.KubeRayOptions(ray_version=opts.ray_version)


def test_options_from_the_real_settings_class(monkeypatch, tmp_path):
    settings_module = pytest.importorskip("service.settings")
    monkeypatch.setenv("ZEROTRAIN_HOME", str(tmp_path))
    monkeypatch.setenv("ZEROTRAIN_STORAGE_URI", "s3://bucket/prefix")
    opts = kuberay.KubeRayOptions.from_settings(settings_module.Settings())
    assert opts.storage_uri == "s3://bucket/prefix"
    assert opts.api_url.startswith("http")
