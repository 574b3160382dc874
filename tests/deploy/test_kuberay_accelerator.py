"""The KubeRay launcher ties the worker pods of a job with ``resources.accelerator_type`` to
nodes with that GPU, in a RayJob that still validates against KubeRay's CRD and Kubernetes."""

from __future__ import annotations

from contract.accelerators import ACCELERATOR_NODE_LABEL
from service.launchers import kuberay_rayjob as kuberay

from tests.deploy import deploy_schemas
from tests.deploy.test_kuberay_launcher import SETTINGS, request


def test_worker_pods_select_nodes_with_the_gpu_type_and_validate(need_crds):
    rayjob = kuberay.build_rayjob(request(gpus_per_worker=2, accelerator_type="H100"), SETTINGS)
    deploy_schemas.validate_crd(rayjob)
    cluster = rayjob["spec"]["rayClusterSpec"]
    (group,) = cluster["workerGroupSpecs"]
    spec = group["template"]["spec"]
    assert spec["nodeSelector"] == {ACCELERATOR_NODE_LABEL: "H100"}
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "nodeSelector" not in cluster["headGroupSpec"]["template"]["spec"]  # the head needs no GPU
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **group["template"]["metadata"]},
           "spec": spec}
    deploy_schemas.validate_core(pod)


def test_without_a_gpu_type_no_node_is_singled_out():
    rayjob = kuberay.build_rayjob(request(gpus_per_worker=1), SETTINGS)
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert "nodeSelector" not in group["template"]["spec"]
