"""The spec model on its own (no server): defaults, derived numbers, and lists kept in sync."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.models import Metric
from contract.presets import PRESETS
from service.schemas import METRIC_FIELDS, JobSpec, MetricRecord

from tests.helpers.service_specs import VALID_SPEC


def test_accumulation_steps_and_tokens_per_step():
    spec = JobSpec.model_validate({**VALID_SPEC, "train": {**VALID_SPEC["train"], "global_batch_size": 16}})
    assert spec.accumulation_steps == 16 // (2 * 2)
    assert spec.tokens_per_step == 64 * 16


def test_data_factory_implies_its_kind_and_round_trips():
    spec = JobSpec.model_validate({**VALID_SPEC, "data": {"factory": "mypkg.data:build", "kwargs": {"n": 1}}})
    assert spec.data.kind == "factory"
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec


def test_later_issue_fields_have_safe_defaults():
    spec = JobSpec.model_validate(VALID_SPEC)
    assert (spec.zero.activation_checkpointing, spec.zero.reshard_after_forward) == (False, True)
    assert (spec.resume_from, spec.max_runtime_s) == (None, None)
    resumed = JobSpec.model_validate({**VALID_SPEC, "resume_from": {"job_id": "job-abc"}})
    assert resumed.resume_from.step == "latest"


def test_min_workers_defaults_to_num_workers_and_bounds_the_elastic_range():
    fixed = JobSpec.model_validate(VALID_SPEC).resources
    assert (fixed.min_workers, fixed.elastic, list(fixed.world_sizes)) == (2, False, [2])
    elastic = JobSpec.model_validate({**VALID_SPEC, "resources": {"num_workers": 2, "min_workers": 1}})
    assert elastic.resources.elastic and list(elastic.resources.world_sizes) == [1, 2]
    with pytest.raises(ValidationError, match=r"resources.min_workers \(3\) must be at most resources.num_workers \(2\)"):
        JobSpec.model_validate({**VALID_SPEC, "resources": {"num_workers": 2, "min_workers": 3}})
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        JobSpec.model_validate({**VALID_SPEC, "resources": {"num_workers": 2, "min_workers": 0}})
    assert JobSpec.model_validate(elastic.model_dump(mode="json")) == elastic


def test_every_elastic_world_size_must_keep_whole_micro_batches_per_rank():
    def spec(gbs: int, least: int, most: int) -> dict:
        return {**VALID_SPEC, "train": {**VALID_SPEC["train"], "global_batch_size": gbs},
                "resources": {"num_workers": most, "min_workers": least}}

    ok = JobSpec.model_validate(spec(24, 1, 4))  # 24 = 2 × 12: whole at 1, 2, 3 and 4 ranks of 2
    assert ok.accumulation_steps == 3  # at the full size; a world of 1 accumulates 12
    with pytest.raises(ValidationError) as refused:
        JobSpec.model_validate(spec(16, 1, 4))
    (error,) = refused.value.errors()
    assert error["type"] == "elastic_batch_arithmetic" and error["ctx"]["field"] == "resources.min_workers"
    assert error["ctx"]["incompatible"] == [3]
    assert "world size 3 does not (these do: 1, 2, 4)" in error["msg"]
    # 48 samples of 2: whole at 3 and 4 ranks, not at 5, 7; the full size (8) is checked as always
    with pytest.raises(ValidationError, match=r"world sizes 5, 7 do not \(these do: 3, 4, 6, 8\)"):
        JobSpec.model_validate(spec(48, 3, 8))
    with pytest.raises(ValidationError, match="resources.num_workers \\(3\\) for a whole"):
        JobSpec.model_validate(spec(16, 1, 3))  # the full size first, with its own message


def test_strict_types_refuse_coercion():
    with pytest.raises(ValidationError, match="train.steps"):
        JobSpec.model_validate({**VALID_SPEC, "train": {**VALID_SPEC["train"], "steps": True}})


def test_preset_parameter_counts_are_those_of_the_built_models():
    """contract.presets computes Φ by arithmetic; the real GPT built on the meta device agrees."""
    import torch

    from workers import models

    for name, cfg in PRESETS.items():
        for variant in (cfg, models.preset_config(name, bias=False)):
            with torch.device("meta"):
                assert models.num_parameters(models.GPT(variant)) == variant.parameters, (name, variant)


def test_metric_columns_match_the_metric_record():
    assert set(METRIC_FIELDS) | {"attempt", "rank", "step", "time", "world_size", "user"} == set(MetricRecord.model_fields)
    # the user's scalars are rows of their own table (service.user_metrics); xid is the writing
    # transaction, filled by the database (service.stream_cursor)
    assert set(Metric.__table__.columns.keys()) == set(MetricRecord.model_fields) - {"user"} | {"id", "job_id", "xid"}


def test_the_charts_combine_ranks_as_before_the_table():
    """Means over ranks, and the job's total (mean × world) for what each rank reports its own of."""
    from contract.metrics import aggregation, chart_list
    from service.dashboard.schemas import ChartSeries

    assert aggregation() == {"loss": "mean", "eval_loss": "mean", "step_time_s": "mean", "tokens_per_s": "total",
                             "tflops": "total", "mfu": "mean", "comm_bytes": "mean", "comm_exposed_s": "mean",
                             "io_wait_s": "mean"}
    assert set(ChartSeries.model_fields) == {"step", *aggregation()}
    charts = chart_list()
    assert [chart["id"] for chart in charts] == ["loss", "throughput", "compute", "exposed"]
    assert {key for chart in charts for key in (s["key"] for s in chart["series"])} <= set(aggregation())
    exposed = next(chart for chart in charts if chart["id"] == "exposed")
    assert [s["key"] for s in exposed["series"]] == ["comm_exposed_s", "step_time_s", "io_wait_s"]


@pytest.mark.parametrize("uri", ["s3://bucket/code/pkg.zip", "https://example.org/pkg.zip", "gs://b/p.zip"])
def test_user_code_ships_as_a_remote_zip(uri):
    spec = JobSpec.model_validate({**VALID_SPEC, "runtime": {"working_dir": uri}})
    assert spec.model_dump(mode="json")["runtime"] == {"working_dir": uri}


@pytest.mark.parametrize("uri", ["/etc", "file:///home/me/code", "s3://bucket/code/", "../x.zip"])
def test_a_directory_of_the_control_plane_is_never_shipped(uri):
    with pytest.raises(ValidationError, match="working_dir"):
        JobSpec.model_validate({**VALID_SPEC, "runtime": {"working_dir": uri}})
