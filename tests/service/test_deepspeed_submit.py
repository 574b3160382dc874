"""Issue 33, Must show 1: a DeepSpeed config submits through REST as the fields written by hand.

DeepSpeed's own examples (ZeRO-2 + CPU offload, ZeRO-3 with the optimizer on NVMe, ZeRO-Infinity's
ZeRO-3 with the optimizer and the parameters on NVMe, bf16, Adam + WarmupLR, HF Trainer's "auto"
ZeRO-2 config) each give a stored spec equal to the hand-written equivalent's; wrong configs are each
a 422 naming ``deepspeed.<path>``, and nothing is stored for them.
"""

from __future__ import annotations

import copy

import httpx
import pytest
from sqlalchemy import func, select

from service.models import Job
from tests.contract.test_deepspeed_config import (BF16, HF_TRAINER_AUTO, WARMUP_LR, WRONG, ZERO2_CPU_OFFLOAD,
                                                  ZERO3_NVME_BOTH, ZERO3_NVME_OPTIMIZER)

BASE = {"name": "ds", "model": {"preset": "gpt-nano"}, "data": {"kind": "synthetic", "seq_len": 64},
        "train": {"steps": 100, "global_batch_size": 16, "micro_batch_size": 2},
        "zero": {"stage": 1}, "resources": {"num_workers": 2}}
BY_HAND = [
    (ZERO2_CPU_OFFLOAD, {"zero": {"stage": 2, "offload_optimizer": "cpu"}}),
    (ZERO3_NVME_OPTIMIZER, {"zero": {"stage": 3, "offload_optimizer": "nvme", "nvme_path": "/local_nvme"}}),
    (ZERO3_NVME_BOTH, {"zero": {"stage": 3, "offload_optimizer": "nvme", "nvme_path": "/local_nvme",
                                "offload_params": "nvme"}}),
    (BF16, {"zero": {"precision": "bf16"}}),
    (WARMUP_LR, {"train": {"optimizer": "adamw", "lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                           "weight_decay": 3e-7, "warmup_steps": 1000, "warmup_type": "log", "schedule": "constant"}}),
    (HF_TRAINER_AUTO, {"train": {"optimizer": "adamw"}, "zero": {"stage": 2, "offload_optimizer": "cpu"}}),
]


def _ignored_keys(ds: dict):
    from contract.deepspeed import translate

    return translate(ds, {}).notes


def _with(base: dict, fields: dict) -> dict:
    spec = copy.deepcopy(base)
    for section, values in fields.items():
        spec[section] = {**spec.get(section, {}), **values}
    return spec


def _post(service, token: str, spec: dict) -> httpx.Response:
    return httpx.post(f"{service.url}/api/v1/jobs", json=spec, headers={"Authorization": f"Bearer {token}"},
                      timeout=120)  # the first submit imports the planner


def test_deepspeed_configs_store_what_the_hand_written_spec_stores(make_live_service):
    service = make_live_service(scheduler_enabled=False)
    token = service.create_user("alice")
    for ds, fields in BY_HAND:
        base = {**BASE, "zero": {}} if "stage" in fields.get("zero", {}) else BASE  # the stage from one place
        from_ds = _post(service, token, {**base, "deepspeed": ds})
        by_hand = _post(service, token, _with(base, fields))
        assert from_ds.status_code == by_hand.status_code == 201, (from_ds.text, by_hand.text)
        assert from_ds.json()["spec"] == by_hand.json()["spec"]
        assert from_ds.json()["spec"]["deepspeed"] is None  # what it became is in the fields
        # what it left aside is in the job's events, as notices
        events = [e for e in service.client(token).events(from_ds.json()["id"]) if e.reason == "deepspeed_config"]
        notices = [e.message for e in events]
        assert all(e.from_state == e.to_state for e in events)
        assert sorted(notices) == sorted(_ignored_keys(ds)), notices
        assert all(n.startswith(("ignored: deepspeed.", "not honoured: deepspeed.")) for n in notices)


@pytest.mark.parametrize("ds, path, words", [w for w in WRONG if w[1] != "deepspeed.train_micro_batch_size_per_gpu"]
                         + [({"train_micro_batch_size_per_gpu": 8}, "deepspeed.train_micro_batch_size_per_gpu",
                             "the spec sets it to 2")])
def test_a_wrong_deepspeed_config_is_a_422_naming_its_path(make_live_service, ds, path, words):
    service = make_live_service(scheduler_enabled=False)
    response = _post(service, service.create_user("alice"), {**BASE, "deepspeed": ds})
    assert response.status_code == 422, response.text
    errors = response.json()["errors"]
    assert [e["field"] for e in errors] == [path] and words in errors[0]["message"], errors
    with service.app.state.sessionmaker() as session:
        assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0
