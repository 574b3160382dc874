"""The KubeRay launcher through the official client over HTTP, against a fake API server
that enforces the shipped Role; then the whole control plane running jobs through it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml
from kubernetes.client import ApiClient, Configuration

from contract.spec import JobSpec
from deploy_render import DEPLOY
from fake_apiserver import FakeApiServer, ServerThread
from service.launchers import kuberay
from service.launchers.base import LaunchPhase, LaunchRequest
from service.launchers.driver import RAY_TRAIN_ENV
from tests.helpers.waiting import wait_for

TOKEN = "zt_ingest_9b1f3c5d7e2a4f6b8c0d1e3f5a7b9c2d"
SPEC = {"name": "k8s-smoke", "model": {"preset": "gpt-nano"},
        "data": {"kind": "synthetic", "vocab_size": 256, "seq_len": 64},
        "train": {"steps": 5, "global_batch_size": 4, "micro_batch_size": 2},
        "resources": {"num_workers": 2, "cpus_per_worker": 1, "gpus_per_worker": 0},
        "max_runtime_s": 600}


def role_rules() -> list[dict]:
    docs = yaml.safe_load_all((DEPLOY / "components" / "kuberay-launcher" / "rbac.yaml").read_text())
    (role,) = [d for d in docs if d and d["kind"] == "Role"]
    return role["rules"]


def granted(rules: list[dict]) -> set[tuple[str, str]]:
    return {(verb, f"{g}/{r}" if g else r) for rule in rules for g in rule["apiGroups"]
            for r in rule["resources"] for verb in rule["verbs"]}


@pytest.fixture
def start_apiserver():
    threads: list[ServerThread] = []

    def start(rules: list[dict] | None = None) -> tuple[FakeApiServer, str]:
        fake = FakeApiServer(role_rules() if rules is None else rules)
        threads.append(ServerThread(fake.app).start())
        return fake, threads[-1].url

    yield start
    for thread in threads:
        thread.stop()


def http_launcher(url: str) -> kuberay.KubeRayLauncher:
    config = Configuration(host=url)
    settings = SimpleNamespace(kuberay_namespace="zerotrain", kuberay_image="zerotrain:dev")
    return kuberay.KubeRayLauncher(settings, api_client=ApiClient(config))


def launch_request() -> LaunchRequest:
    return LaunchRequest("job-http-1", 1, JobSpec.model_validate(SPEC), "http://zerotrain:8000", TOKEN,
                         "s3://zerotrain/checkpoints")


def test_launcher_lifecycle_over_http_needs_exactly_the_role(start_apiserver):
    fake, url = start_apiserver()
    launcher = http_launcher(url)
    try:
        handle = launcher.start(launch_request())
        ns, name = "zerotrain", handle.external_id
        rayjob = fake.rayjobs[(ns, name)]
        secret = fake.secrets[(ns, handle.extra["secret"])]
        assert secret["stringData"] == {kuberay.TOKEN_KEY: TOKEN}
        assert secret["metadata"]["ownerReferences"][0]["uid"] == rayjob["metadata"]["uid"]
        assert set(fake.patch_content_types) == {"application/merge-patch+json"}
        assert TOKEN not in str(rayjob)

        assert launcher.status(handle).phase is LaunchPhase.PENDING
        rayjob["status"] = {"jobDeploymentStatus": "Initializing", "rayClusterName": f"{name}-x1",
                            "startTime": "2026-01-01T00:00:00Z"}
        fake.pods = [{"metadata": {"name": f"{name}-x1-workers-a", "labels": {"ray.io/cluster": f"{name}-x1"}},
                      "status": {"phase": "Pending", "conditions": [{
                          "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                          "message": "0/1 nodes are available: 1 Insufficient cpu."}]}}]
        waiting = launcher.status(handle)
        assert (waiting.phase, waiting.reason) == (LaunchPhase.PENDING, "insufficient_resources")

        rayjob["status"] = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "rayClusterName": f"{name}-x1"}
        assert launcher.status(handle).phase is LaunchPhase.RUNNING
        fake.pods.append({"metadata": {"name": f"{name}-sub", "labels": {"job-name": name}}})
        fake.pod_logs[f"{name}-sub"] = "step 1 loss 5.5\n"
        assert launcher.logs(handle) == "step 1 loss 5.5\n"

        launcher.cancel(handle)
        assert fake.rayjobs == {} and fake.secrets == {}
        assert launcher.status(handle).phase is LaunchPhase.UNKNOWN
    finally:
        launcher.close()
    used = {(verb, resource) for verb, resource, _, _ in fake.requests}
    assert used == granted(role_rules()), "every permission is used, and none is missing"


def test_finished_job_loses_its_token_and_garbage_collection_follows_the_owner(start_apiserver):
    fake, url = start_apiserver()
    launcher = http_launcher(url)
    handle = launcher.start(launch_request())
    rayjob = fake.rayjobs[("zerotrain", handle.external_id)]
    rayjob["status"] = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}
    assert launcher.status(handle).phase is LaunchPhase.SUCCEEDED
    assert fake.secrets == {}
    second = launcher.start(LaunchRequest("job-http-2", 1, JobSpec.model_validate(SPEC), "http://zerotrain:8000",
                                          TOKEN, "s3://z/c"))
    assert len(fake.secrets) == 1
    del fake.rayjobs[("zerotrain", second.external_id)]  # e.g. `kubectl delete rayjob`
    fake._collect_garbage("zerotrain")
    assert fake.secrets == {}
    launcher.close()


def test_without_the_role_the_launcher_fails_loudly(start_apiserver):
    rules = [r for r in role_rules() if "rayjobs" not in r["resources"]]
    fake, url = start_apiserver(rules)
    launcher = http_launcher(url)
    with pytest.raises(kuberay.KubeRayError, match="403|Forbidden"):
        launcher.start(launch_request())
    assert fake.secrets == {}, "the token Secret is rolled back"
    launcher.close()


# --- the control plane with ZEROTRAIN_LAUNCHER=kuberay -------------------------------------

@pytest.fixture
def kubeconfig(start_apiserver, tmp_path, monkeypatch):
    """A kubeconfig naming the fake API server, as `kubectl` users have (no in-cluster config)."""
    fake, url = start_apiserver()
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "fake", "user": {"token": "test"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "zerotrain"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("ZEROTRAIN_KUBERAY_IMAGE", "zerotrain:dev")
    saved = Configuration.get_default_copy()
    yield fake
    Configuration.set_default(saved)


def test_control_plane_runs_jobs_as_rayjobs(kubeconfig, make_live_service):
    fake = kubeconfig
    service = make_live_service(launcher="kuberay")
    client = service.client()

    job = client.submit(SPEC)
    rayjob = wait_for(lambda: next(iter(fake.rayjobs.values()), None), 20, "a RayJob on the API server")
    assert rayjob["metadata"]["labels"][kuberay.LABEL_JOB_ID] == kuberay.label_value(job.id)
    assert rayjob["spec"]["entrypoint"] == \
        f"python -m workers.launch --job-id {job.id} --api {service.settings.api_url}"
    assert rayjob["spec"]["activeDeadlineSeconds"] == 600
    (secret,) = fake.secrets.values()
    assert secret["stringData"][kuberay.TOKEN_KEY] not in str(rayjob)

    rayjob["status"] = {"jobDeploymentStatus": "Failed", "jobStatus": "RUNNING", "reason": "DeadlineExceeded",
                        "message": "The RayJob has passed the activeDeadlineSeconds."}
    failed = client.wait(job.id, timeout=20)
    assert failed.state.value == "FAILED"
    assert failed.reason == "max_runtime_exceeded"

    second = client.submit({**SPEC, "name": "k8s-cancel"})
    wait_for(lambda: len(fake.rayjobs) == 2, 20, "two RayJobs on the API server")
    client.cancel(second.id)
    assert client.wait(second.id, timeout=20).state.value == "CANCELLED"
    assert len(fake.rayjobs) == 1, "the cancelled job's RayJob is deleted"
    assert len(fake.secrets) == 0, "no token outlives its job"


def test_a_rayjob_carries_none_of_the_control_planes_secrets(kubeconfig, make_live_service, monkeypatch):
    """A control plane whose environment and settings hold its database URL, the bootstrap admin
    token, a Ray token and the object-store secret key: the RayJob and the token Secret it sends
    to the API server hold none of them. The Ray containers' env is the job's own variables;
    the object-store keys reach the pods only by reference (``envFrom`` the storage Secret)."""
    fake = kubeconfig
    secrets = {"ZEROTRAIN_DATABASE_URL": "postgresql+psycopg://zerotrain:db-pass-8e2a@db:5432/zerotrain",
               "RAY_AUTH_TOKEN": "ray-token-of-the-services-cluster-5c71",
               "AWS_SECRET_ACCESS_KEY": "storage-secret-key-0d93b4"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ZEROTRAIN_KUBERAY_STORAGE_SECRET", "zerotrain-storage")
    service = make_live_service(launcher="kuberay", bootstrap_admin_token="zt_bootstrap_admin_6f0e2c9a4b")
    secrets.update(settings_database_url=service.settings.database_url,
                   bootstrap_admin_token="zt_bootstrap_admin_6f0e2c9a4b", admin_token=service.admin_token)

    job = service.client().submit(SPEC)
    rayjob = wait_for(lambda: next(iter(fake.rayjobs.values()), None), 20, "a RayJob on the API server")
    (secret,) = fake.secrets.values()
    sent = json.dumps(rayjob) + json.dumps(secret)
    for name, value in secrets.items():
        assert value not in sent, f"the control plane's {name} was sent to the API server"
    cluster = rayjob["spec"]["rayClusterSpec"]
    for template in [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]:
        (container,) = template["spec"]["containers"]
        assert {e["name"] for e in container["env"]} == {
            "ZEROTRAIN_JOB_ID", "ZEROTRAIN_ATTEMPT", "ZEROTRAIN_API_URL", "ZEROTRAIN_INGEST_TOKEN",
            "ZEROTRAIN_STORAGE_URI", *RAY_TRAIN_ENV,
            "ZEROTRAIN_STORAGE_MARKER"}, container["name"]  # the service's storage is file:// here: checked
        assert container["envFrom"] == [{"secretRef": {"name": "zerotrain-storage", "optional": True}}]
    assert set(secret["stringData"]) == {kuberay.TOKEN_KEY}
    service.client().cancel(job.id)
