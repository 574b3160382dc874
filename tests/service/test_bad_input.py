"""Must-show 4: a wrong value in any spec field is a 422 that names the field; oversized bodies
are refused; a refused request writes nothing."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from service.models import Job, JobEvent, Metric
from service.schemas import JobSpec

from tests.helpers.service_specs import VALID_SPEC

MAX_BODY = 1024 * 1024


def with_value(path: str, value: Any, base: dict | None = None) -> dict:
    spec = copy.deepcopy(base or VALID_SPEC)
    *parents, leaf = path.split(".")
    node = spec
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return spec


PRESET = with_value("model", {"preset": "gpt-mini"})
TEXT = with_value("data", {"kind": "text", "uri": "file:///data", "seq_len": 64})
TOKENS = with_value("data", {"kind": "tokens", "uri": "file:///data", "seq_len": 64, "format": "bin"})
SFT = with_value("data", {"kind": "sft", "uri": "file:///data", "seq_len": 64, "format": "jsonl",
                          "tokenizer": "file:///tok"})

# (field that must be named, spec with a wrong value there)
BAD_SPECS: list[tuple[str, dict]] = [
    ("name", with_value("name", "has spaces!")),
    ("name", with_value("name", 7)),
    ("model", with_value("model", {})),
    ("model.preset", with_value("model", {"preset": "gpt-huge"})),
    ("model.factory", with_value("model.factory", "not a factory")),
    ("model.kwargs", with_value("model.kwargs", ["a"])),
    ("model.color", with_value("model.color", "red")),
    ("model.hf", with_value("model", {"hf": "https://example.com/models/tiny"})),
    ("model.hf", with_value("model", {"hf": "relative/models/tiny"})),
    ("model.hf", with_value("model", {"hf": "s3://models/" + "x" * 3000})),
    ("model.init_from", with_value("model.init_from", "https://example.com/model.safetensors", PRESET)),
    ("model.init_from", with_value("model.init_from", "s3://weights/" + "x" * 3000, PRESET)),
    ("data.kind", with_value("data.kind", "video")),
    ("data.uri", with_value("data.uri", "http://example.com/corpus", TEXT)),
    ("data.uri", with_value("data", {"kind": "text", "seq_len": 64})),
    ("data.glob", with_value("data.glob", 5, TEXT)),
    ("data.seq_len", with_value("data.seq_len", 0)),
    ("data.seq_len", with_value("data.seq_len", 4096, PRESET)),
    ("data.vocab_size", with_value("data.vocab_size", 1)),
    ("data.factory", with_value("data", {"factory": "no colon"})),
    ("data.kwargs", with_value("data.kwargs", "x")),
    ("data.format", with_value("data.format", "csv", TOKENS)),  # not a format of the kind
    ("data.format", with_value("data.format", "jsonl", TEXT)),  # text without a tokenizer is bytes
    ("data.format", with_value("data.format", None, SFT)),
    ("data.field", with_value("data.field", "body", TOKENS)),  # a field of another kind
    ("data.field", with_value("data.field", "", with_value("data.format", "jsonl", with_value(
        "data.tokenizer", "file:///tok", TEXT)))),
    ("data.tokenizer", with_value("data.tokenizer", "http://example.com/tok", SFT)),
    ("data.tokenizer", with_value("data.tokenizer", None, SFT)),  # sft needs one
    ("data.tokenizer", with_value("data.tokenizer", "model", SFT)),  # model.hf absent
    ("data.dtype", with_value("data.dtype", "int8", TOKENS)),
    ("data.dtype", with_value("data.dtype", "uint32", with_value("data.format", "parquet", TOKENS))),
    ("data.column", with_value("data.column", "ids", TOKENS)),  # read for parquet only
    ("data.prompt_field", with_value("data.prompt_field", 3, SFT)),
    ("data.completion_field", with_value("data.completion_field", "answer", TEXT)),
    ("data.shuffle", with_value("data.shuffle", "yes", TOKENS)),
    ("train", with_value("train", None)),
    ("train.steps", with_value("train.steps", 0)),
    ("train.warmup_type", with_value("train.warmup_type", "cosine")),
    ("train.min_lr_ratio", with_value("train.min_lr_ratio", 1.5)),
    ("deepspeed.zero_optimization.stage", with_value("deepspeed", {"zero_optimization": {"stage": 7}})),
    ("deepspeed", with_value("deepspeed", ["not", "an", "object"])),
    ("train.steps", with_value("train.steps", "10")),
    ("train.global_batch_size", with_value("train.global_batch_size", 0)),
    ("train.global_batch_size", with_value("train.global_batch_size", 10)),
    ("train.micro_batch_size", with_value("train.micro_batch_size", 0)),
    ("train.lr", with_value("train.lr", 0)),
    ("train.warmup_steps", with_value("train.warmup_steps", -1)),
    ("train.weight_decay", with_value("train.weight_decay", -0.1)),
    ("train.grad_clip", with_value("train.grad_clip", 0)),
    ("train.grad_clip", with_value("train.grad_clip", float("inf"))),  # the engine clips to a finite norm
    ("train.seed", with_value("train.seed", -1)),
    ("train.optimizer", with_value("train.optimizer", "muon")),
    ("train.betas", with_value("train.betas", [0.9, 1.5])),
    ("train.eps", with_value("train.eps", -1e-8)),
    ("train.momentum", with_value("train.momentum", 0.9)),  # adamw has no momentum
    ("train.nesterov", with_value("train.nesterov", "on")),
    ("train.no_decay", with_value("train.no_decay", ["ok.*", ""])),
    ("train.no_decay_1d", with_value("train.no_decay_1d", 0)),
    ("train.schedule", with_value("train.schedule", "exponential")),
    ("zero.stage", with_value("zero.stage", 4)),
    ("zero.stage", with_value("zero.stage", True)),  # a literal matches by equality: True == 1
    ("zero.stage", with_value("zero.stage", 1.0)),
    ("zero.offload_optimizer", with_value("zero.offload_optimizer", 1)),
    ("zero.precision", with_value("zero.precision", "fp8")),
    ("zero.offload_optimizer", with_value("zero.offload_optimizer", "yes")),
    ("zero.bucket_mb", with_value("zero.bucket_mb", 0)),
    ("zero.prefetch", with_value("zero.prefetch", -1)),
    ("zero.activation_checkpointing", with_value("zero.activation_checkpointing", "no")),
    ("zero.reshard_after_forward", with_value("zero.reshard_after_forward", 1)),
    ("zero.reshard_after_forward", with_value("zero.reshard_after_forward", "all")),
    ("zero.bucket_mb", with_value("zero.bucket_mb", float("inf"))),  # the engine needs a finite bucket
    ("zero.keep_gathered_bytes", with_value("zero.keep_gathered_bytes", -1)),
    ("zero.keep_gathered_bytes", with_value("zero.keep_gathered_bytes", 1.5)),
    ("zero.broadcast_buffers", with_value("zero.broadcast_buffers", "sometimes")),
    ("zero.sync_batchnorm", with_value("zero.sync_batchnorm", 2)),
    ("zero.shard_group_size", with_value("zero.shard_group_size", 0)),
    ("zero.shard_group_size", with_value("zero.shard_group_size", 3)),  # does not divide num_workers (2)
    # the cross-field rules of contract/zero_rules.py, one case each (the engine's ZeroConfig checks the same)
    ("zero.offload_optimizer", with_value("zero", {"stage": 0, "offload_optimizer": True})),
    ("zero.keep_gathered_bytes", with_value("zero", {"stage": 2, "keep_gathered_bytes": 1024})),
    # NVMe offload: the swap folder is needed, absolute, and read with "nvme" only; stage 0 refused
    ("zero.nvme_path", with_value("zero", {"stage": 2, "offload_optimizer": "nvme"})),
    ("zero.nvme_path", with_value("zero", {"stage": 2, "offload_optimizer": "nvme", "nvme_path": "swap"})),
    ("zero.nvme_path", with_value("zero", {"stage": 2, "nvme_path": "/mnt/nvme"})),
    ("zero.offload_optimizer", with_value("zero", {"stage": 0, "offload_optimizer": "nvme", "nvme_path": "/x"})),
    # parameter offload: stage 3 only, a known place, and "nvme" needs the swap folder
    ("zero.offload_params", with_value("zero", {"stage": 2, "offload_params": "cpu"})),
    ("zero.offload_params", with_value("zero", {"stage": 3, "offload_params": "disk"})),
    ("zero.offload_params", with_value("zero", {"stage": 3, "offload_params": "nvme"})),
    ("zero.offload_optimizer", with_value("zero.offload_optimizer", "disk")),
    # ZeRO++: the quantized collectives and hpZ are stage 3's; hpZ's groups split the world and
    # the shard group
    ("zero.quantized_weights", with_value("zero", {"stage": 2, "quantized_weights": True})),
    ("zero.quantized_gradients", with_value("zero", {"stage": 1, "quantized_gradients": True})),
    ("zero.quantized_gradients", with_value("zero", {"stage": 3, "quantized_gradients": "int4"})),
    ("zero.quantized_weights", with_value("zero", {"stage": 3, "quantized_weights": "int8"})),
    ("zero.hpz_partition_size", with_value("zero", {"stage": 2, "hpz_partition_size": 2})),
    ("zero.hpz_partition_size", with_value("zero", {"stage": 3, "hpz_partition_size": 0})),
    ("zero.hpz_partition_size", with_value("zero", {"stage": 3, "hpz_partition_size": True})),
    ("zero.hpz_partition_size", with_value("zero", {"stage": 3, "hpz_partition_size": 4})),  # > num_workers (2)
    ("zero.hpz_partition_size", with_value("resources.num_workers", 3, with_value(  # 3 is no whole number of 2s
        "zero", {"stage": 3, "hpz_partition_size": 2}, with_value("train.global_batch_size", 12)))),
    ("zero.hpz_partition_size", with_value("resources.num_workers", 4, with_value(  # 4 is no multiple of 3
        "zero", {"stage": 3, "hpz_partition_size": 3, "shard_group_size": 4}))),
    # the engine's ZeroConfig refuses a boolean where it counts (bytes, units, ranks): so does submit
    ("zero.prefetch", with_value("zero.prefetch", True)),
    ("zero.keep_gathered_bytes", with_value("zero", {"stage": 3, "keep_gathered_bytes": True})),
    ("zero.shard_group_size", with_value("zero.shard_group_size", True)),
    ("zero.bucket_mb", with_value("zero.bucket_mb", -25)),
    ("zero.bucket_mb", with_value("zero.bucket_mb", float("nan"))),
    ("zero.prefetch", with_value("zero.prefetch", 1.5)),
    ("resources.num_workers", with_value("resources.num_workers", 0)),
    ("resources.min_workers", with_value("resources.min_workers", 0)),
    ("resources.min_workers", with_value("resources.min_workers", 3)),  # more than num_workers (2)
    ("resources.min_workers", with_value("resources", {"num_workers": 4, "min_workers": 3})),  # 8 % (2 × 3)
    ("resources.gpus_per_worker", with_value("resources.gpus_per_worker", -1)),
    ("resources.cpus_per_worker", with_value("resources.cpus_per_worker", 0)),
    ("resources.gpu_memory_gb", with_value("resources.gpu_memory_gb", 0)),
    ("resources.accelerator_type", with_value("resources", {"gpus_per_worker": 1, "accelerator_type": "H1000"})),
    ("resources.accelerator_type", with_value("resources.accelerator_type", "H100")),  # gpus_per_worker is 0
    ("checkpoint.every_steps", with_value("checkpoint.every_steps", 0)),
    ("checkpoint.keep_last", with_value("checkpoint.keep_last", 0)),
    ("checkpoint.uri", with_value("checkpoint.uri", "ftp://host/ckpt")),
    ("max_failures", with_value("max_failures", -1)),
    ("priority", with_value("priority", 1001)),
    ("priority", with_value("priority", "high")),
    ("team", with_value("team", "no spaces allowed")),
    ("team", with_value("team", 7)),
    ("preemptible", with_value("preemptible", "no")),
    ("resume_from.job_id", with_value("resume_from", {"job_id": "no such/id"})),
    ("resume_from.step", with_value("resume_from", {"job_id": "job-1", "step": -3})),
    ("max_runtime_s", with_value("max_runtime_s", 0)),
    ("runtime.working_dir", with_value("runtime", {"working_dir": "/etc"})),
    ("eval", with_value("eval", {"every_steps": 5})),
    ("eval.every_steps", with_value("eval", {"every_steps": 0, "data": {"kind": "synthetic", "seq_len": 8}})),
    ("eval.batches", with_value("eval", {"every_steps": 5, "batches": 10_001,
                                         "data": {"kind": "synthetic", "seq_len": 8}})),
    ("eval.data.kind", with_value("eval", {"every_steps": 5, "data": {"kind": "video"}})),
    ("eval.data.uri", with_value("eval", {"every_steps": 5, "data": {"kind": "text", "seq_len": 64}})),
    ("eval.data.uri", with_value("eval", {"every_steps": 5, "data": {"kind": "text", "seq_len": 64,
                                                                     "uri": "http://example.com/corpus"}})),
    ("eval.data.glob", with_value("eval", {"every_steps": 5, "data": {**TEXT["data"], "glob": "../up"}})),
    ("eval.data.seq_len", with_value("eval", {"every_steps": 5, "data": {"kind": "synthetic", "seq_len": 0}})),
    ("eval.data.seq_len", with_value("eval", {"every_steps": 5, "data": {"kind": "synthetic", "seq_len": 4096}},
                                     PRESET)),
    ("eval.data.vocab_size", with_value("eval", {"every_steps": 5, "data": {"kind": "synthetic", "seq_len": 8,
                                                                            "vocab_size": 1}})),
    ("eval.data.factory", with_value("eval", {"every_steps": 5, "data": {"factory": "no colon"}})),
    ("eval.data.factory", with_value("eval", {"every_steps": 5, "data": {"kind": "synthetic", "seq_len": 8,
                                                                         "factory": "pkg.mod:fn"}})),
    ("eval.data.kwargs", with_value("eval", {"every_steps": 5, "data": {"factory": "pkg.mod:fn", "kwargs": "x"}})),
    ("eval.data.format", with_value("eval", {"every_steps": 5, "data": {**TOKENS["data"], "format": "txt"}})),
    ("eval.data.field", with_value("eval", {"every_steps": 5, "data": {**SFT["data"], "field": "x"}})),
    ("eval.data.tokenizer", with_value("eval", {"every_steps": 5, "data": {**SFT["data"], "tokenizer": "model"}})),
    ("eval.data.dtype", with_value("eval", {"every_steps": 5, "data": {**TOKENS["data"], "dtype": "float32"}})),
    ("eval.data.column", with_value("eval", {"every_steps": 5, "data": {**TOKENS["data"], "column": ""}})),
    ("eval.data.prompt_field", with_value("eval", {"every_steps": 5, "data": {**SFT["data"], "prompt_field": ""}})),
    ("eval.data.completion_field", with_value("eval", {"every_steps": 5, "data": {**TOKENS["data"],
                                                                                  "completion_field": "c"}})),
    ("eval.data.shuffle", with_value("eval", {"every_steps": 5, "data": {"kind": "synthetic", "seq_len": 8,
                                                                         "shuffle": False}})),
    ("nmae", with_value("nmae", "typo")),
]


def test_every_spec_field_is_covered():
    """Adding a field to JobSpec without a bad-value case here fails this test."""
    def paths(model, prefix=""):
        for name, info in model.model_fields.items():
            sub = getattr(info.annotation, "model_fields", None)
            if sub is None:  # Optional[Model]
                sub_model = next((a for a in getattr(info.annotation, "__args__", ())
                                  if hasattr(a, "model_fields")), None)
            else:
                sub_model = info.annotation
            if sub_model is not None:
                yield from paths(sub_model, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}"
    assert set(paths(JobSpec)) <= {field for field, _ in BAD_SPECS}


@pytest.fixture
def service(make_live_service):
    return make_live_service(scheduler_enabled=False, max_body_bytes=MAX_BODY)


def counts(service) -> tuple[int, int, int]:
    with service.app.state.sessionmaker() as session:
        return tuple(session.execute(select(func.count()).select_from(table)).scalar_one()
                     for table in (Job, JobEvent, Metric))


def test_each_wrong_value_is_a_422_naming_the_field_and_nothing_is_written(service):
    http = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.admin_token}"})
    for field, spec in BAD_SPECS:  # json.dumps writes Infinity, as a client may (httpx's json= refuses it)
        response = http.post("/api/v1/jobs", content=json.dumps(spec), headers={"content-type": "application/json"})
        assert response.status_code == 422, (field, response.text)
        body = response.json()
        named = [error["field"] for error in body["errors"]]
        assert any(name == field or name.startswith(field + ".") for name in named), (field, body)
        assert field in body["detail"], (field, body["detail"])
    assert counts(service) == (0, 0, 0)


def test_batch_arithmetic_error_names_the_numbers(service):
    response = httpx.post(f"{service.url}/api/v1/jobs", json=with_value("train.global_batch_size", 10),
                          headers={"Authorization": f"Bearer {service.admin_token}"})
    message = response.json()["errors"][0]["message"]
    assert "(10)" in message and "micro_batch_size (2)" in message and "num_workers (2)" in message


def test_an_elastic_range_that_breaks_the_global_batch_is_refused_with_the_sizes(service):
    # 16 samples in micro-batches of 2: whole per rank at 1, 2 and 4 ranks, not at 3
    spec = with_value("train.global_batch_size", 16, with_value("resources", {"num_workers": 4, "min_workers": 1}))
    response = httpx.post(f"{service.url}/api/v1/jobs", json=spec,
                          headers={"Authorization": f"Bearer {service.admin_token}"})
    assert response.status_code == 422
    (error,) = response.json()["errors"]
    assert error["field"] == "resources.min_workers" and error["type"] == "elastic_batch_arithmetic"
    assert "world size 3 does not (these do: 1, 2, 4)" in error["message"]
    assert "DeepSpeed" in error["message"] and "global_batch_size (16)" in error["message"]
    assert counts(service) == (0, 0, 0)


def test_a_shard_group_size_that_does_not_split_an_elastic_range_is_refused_with_the_sizes(service):
    # 24 samples split into whole micro-batches of 2 at 2, 3 and 4 ranks; 3 ranks are no whole groups of 2
    spec = with_value("zero.shard_group_size", 2, with_value(
        "train.global_batch_size", 24, with_value("resources", {"num_workers": 4, "min_workers": 2})))
    response = httpx.post(f"{service.url}/api/v1/jobs", json=spec,
                          headers={"Authorization": f"Bearer {service.admin_token}"})
    assert response.status_code == 422
    (error,) = response.json()["errors"]
    assert error["field"] == "zero.shard_group_size" and error["type"] == "shard_group_size"
    assert "must divide resources.num_workers (4)" in error["message"]
    assert "world size 3 does not" in error["message"]
    assert counts(service) == (0, 0, 0)


def test_an_hpz_partition_size_that_does_not_split_an_elastic_range_is_refused_with_the_sizes(service):
    # 24 samples split into whole micro-batches of 2 at 2, 3 and 4 ranks; 3 ranks are no whole hpZ groups of 2
    spec = with_value("zero", {"stage": 3, "hpz_partition_size": 2}, with_value(
        "train.global_batch_size", 24, with_value("resources", {"num_workers": 4, "min_workers": 2})))
    response = httpx.post(f"{service.url}/api/v1/jobs", json=spec,
                          headers={"Authorization": f"Bearer {service.admin_token}"})
    assert response.status_code == 422
    (error,) = response.json()["errors"]
    assert error["field"] == "zero.hpz_partition_size" and error["type"] == "hpz_partition_size"
    assert "must divide resources.num_workers (4)" in error["message"]
    assert "world size 3 does not" in error["message"]
    assert counts(service) == (0, 0, 0)


def test_stage_0_with_optimizer_offload_is_a_422_naming_the_field(service):
    """A rule the engine enforces is refused at submit, with the engine's sentence, and nothing is written."""
    response = httpx.post(f"{service.url}/api/v1/jobs", json=with_value("zero", {"stage": 0, "offload_optimizer": True}),
                          headers={"Authorization": f"Bearer {service.admin_token}"})
    assert response.status_code == 422
    (error,) = response.json()["errors"]
    assert error["field"] == "zero.offload_optimizer" and error["type"] == "zero_rule"
    assert "offload_optimizer needs stage 1, 2 or 3" in error["message"]
    assert counts(service) == (0, 0, 0)


def test_malformed_json_and_bad_parameters_are_422(service):
    http = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.admin_token}"})
    response = http.post("/api/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422 and "JSON" in response.json()["detail"]
    response = http.post("/api/v1/jobs", json=VALID_SPEC, headers={"Idempotency-Key": "k" * 201})
    assert response.status_code == 422 and response.json()["errors"][0]["field"] == "Idempotency-Key"
    for params, field in (({"state": "SLEEPING"}, "state"), ({"limit": 0}, "limit"), ({"cursor": "abc"}, "cursor")):
        response = http.get("/api/v1/jobs", params=params)
        assert response.status_code == 422 and response.json()["errors"][0]["field"] == field
    assert counts(service) == (0, 0, 0)


def test_oversized_bodies_are_refused_with_413(service):
    http = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.admin_token}"})
    huge = with_value("model.kwargs", {"blob": "x" * (MAX_BODY + 1)})
    response = http.post("/api/v1/jobs", json=huge)
    assert response.status_code == 413 and str(MAX_BODY) in response.json()["detail"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(MAX_BODY // 65536 + 2):
            yield b" " * 65536
    response = http.post("/api/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert counts(service) == (0, 0, 0)


def test_metric_batches_over_the_record_limit_are_refused(service):
    job_id = service.client().submit(VALID_SPEC).id
    (claimed_id, ingest), = service.app.state.scheduler.claim()
    assert claimed_id == job_id
    records = [{"attempt": 0, "rank": 0, "step": step} for step in range(10_001)]
    response = httpx.post(f"{service.url}/api/v1/jobs/{job_id}/metrics", json={"records": records},
                          headers={"Authorization": f"Bearer {ingest}"})
    assert response.status_code == 422 and response.json()["errors"][0]["field"] == "records"
    bad_record = [{"attempt": 0, "rank": -1, "step": 0}]
    response = httpx.post(f"{service.url}/api/v1/jobs/{job_id}/metrics", json={"records": bad_record},
                          headers={"Authorization": f"Bearer {ingest}"})
    assert response.status_code == 422 and response.json()["errors"][0]["field"] == "records.0.rank"
    assert counts(service)[2] == 0
