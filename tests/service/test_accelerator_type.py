"""``resources.accelerator_type``: a GPU type in Ray's names, checked at submit, the planner's
memory budget unless ``gpu_memory_gb`` is given, and asked of Ray by the worker group
(contract/accelerators.py; the KubeRay side: tests/deploy/test_kuberay_accelerator.py)."""

from __future__ import annotations

import httpx
import pytest

from contract.accelerators import ACCELERATOR_MEMORY_GB
from contract.spec import JobSpec
from workers.runtime import ray_train


def medium_spec(**resources) -> dict:
    """gpt-medium on 8 GPUs: stage 0 needs several GB per rank, so small GPUs change the plan."""
    return {
        "name": "accelerator",
        "model": {"preset": "gpt-medium"},
        "data": {"kind": "synthetic", "vocab_size": 256, "seq_len": 256},
        "train": {"steps": 10, "global_batch_size": 16, "micro_batch_size": 1},
        "zero": {"stage": "auto", "precision": "bf16"},
        "resources": {"num_workers": 8, "gpus_per_worker": 1, **resources},
    }


@pytest.fixture
def quiet_service(make_live_service):
    return make_live_service(scheduler_enabled=False)


def submit(service, spec) -> httpx.Response:
    return httpx.post(f"{service.url}/api/v1/jobs", json=spec, timeout=120,
                      headers={"Authorization": f"Bearer {service.admin_token}"})


@pytest.mark.parametrize("gpu", ["P4", "T4", "H100"])
def test_the_plan_takes_the_gpus_memory_from_the_table_as_if_gpu_memory_gb_said_it(quiet_service, gpu):
    typed = submit(quiet_service, medium_spec(accelerator_type=gpu.lower()))
    assert typed.status_code == 201, typed.text
    by_hand = submit(quiet_service, medium_spec(gpu_memory_gb=ACCELERATOR_MEMORY_GB[gpu]))
    assert by_hand.status_code == 201, by_hand.text
    typed, by_hand = typed.json(), by_hand.json()
    assert typed["spec"]["resources"]["accelerator_type"] == gpu  # stored in the table's spelling
    assert typed["prediction"]["budget_bytes"] == ACCELERATOR_MEMORY_GB[gpu] * 1e9
    assert typed["spec"]["zero"] == by_hand["spec"]["zero"]
    assert typed["prediction"]["chosen"] == by_hand["prediction"]["chosen"]


def test_the_small_gpu_gets_a_higher_stage_than_the_large_one(quiet_service):
    """gpt-1b's stage-0 model states alone (16 bytes a parameter) are over an 8 GB P4, far under an H100."""
    def one_b(gpu: str) -> dict:
        return {**medium_spec(accelerator_type=gpu), "model": {"preset": "gpt-1b"}}

    small = submit(quiet_service, one_b("P4")).json()
    large = submit(quiet_service, one_b("H100")).json()
    assert large["spec"]["zero"]["stage"] == 0, large["prediction"]["reason"]
    assert small["spec"]["zero"]["stage"] > 0, small["prediction"]["reason"]


def test_gpu_memory_gb_overrides_the_table(quiet_service):
    job = submit(quiet_service, medium_spec(accelerator_type="H100", gpu_memory_gb=94)).json()
    assert job["prediction"]["budget_bytes"] == 94e9 and job["spec"]["resources"]["accelerator_type"] == "H100"


@pytest.mark.parametrize("resources, message", [
    ({"accelerator_type": "H1000"}, "unknown GPU type 'H1000'; known: K80, "),
    ({"accelerator_type": "H100", "gpus_per_worker": 0}, "needs resources.gpus_per_worker > 0"),
], ids=["unknown-type", "no-gpus"])
def test_a_bad_accelerator_type_is_a_422_naming_the_field(quiet_service, resources, message):
    response = submit(quiet_service, medium_spec(**resources))
    assert response.status_code == 422, response.text
    (error,) = response.json()["errors"]
    assert error["field"] == "resources.accelerator_type", error
    assert message in error["message"], error
    if "unknown" in message:
        assert all(name in error["message"] for name in ACCELERATOR_MEMORY_GB)
    assert quiet_service.client().list().items == []


def test_ray_train_asks_for_the_gpu_type_in_the_scaling_config_and_the_wait_for_resources():
    spec = JobSpec.model_validate(medium_spec(accelerator_type="A100-80G", num_workers=2))
    config = ray_train.scaling_config(spec)
    assert config.accelerator_type == "A100-80G" and config.use_gpu
    wanted = {"CPU": 1.0, "GPU": 1.0, "accelerator_type:A100-80G": 0.001}
    assert ray_train.resources_per_worker(spec) == wanted  # what the placement-group wait asks for
    assert config.as_placement_group_factory().bundles == [wanted, wanted]  # what Ray Train asks for
    plain = ray_train.scaling_config(JobSpec.model_validate(medium_spec(num_workers=2)))
    assert plain.accelerator_type is None
    assert plain.as_placement_group_factory().bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2


@pytest.mark.slow
def test_a_real_ray_node_holds_the_worker_group_only_on_its_own_gpu_type():
    """A one-node Ray cluster that says it has one T4 (Ray's resource for a node's GPU type,
    declared here as Ray would detect it): the wait for a T4 job's worker group is granted at
    once, an H100 job's stays pending."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    def gate(gpu: str):
        spec = JobSpec.model_validate(medium_spec(accelerator_type=gpu, num_workers=1, cpus_per_worker=1))
        return placement_group([ray_train.resources_per_worker(spec)], strategy="PACK")

    ray.init(num_cpus=2, num_gpus=1, resources={"accelerator_type:T4": 1}, include_dashboard=False,
             log_to_driver=False)
    try:
        t4, h100 = gate("T4"), gate("H100")
        ready, _ = ray.wait([t4.ready()], timeout=120)
        assert ready, "the T4 worker group was not placed on the T4 node"
        # the same node, free again for an H100 job, still does not take it
        remove_placement_group(t4)
        ready, _ = ray.wait([h100.ready()], timeout=5)
        assert not ready
    finally:
        ray.shutdown()
