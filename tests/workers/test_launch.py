"""The driver without a cluster: a stand-in ``Runtime`` and control plane show what the driver
itself owns (validating the spec once, the loop's config, the final report and exit code), and
the Ray Train runtime's pure parts (reasons, per-worker resources) are checked directly."""

from __future__ import annotations

import signal
from typing import ClassVar

import pytest

from contract.reasons import Reason
from contract.spec import JobSpec
from workers import launch
from workers.loop_config import LoopConfig
from workers.runtime import ray_train

STORED_SPEC = {"name": "driver", "model": {"preset": "gpt-nano"}, "data": {"kind": "synthetic", "seq_len": 8},
               "train": {"steps": 1, "global_batch_size": 4, "micro_batch_size": 2},
               "resources": {"num_workers": 2}}


class FakeAPI:
    posts: list[tuple[str, str | None]] = []

    def __init__(self, api_url: str, job_id: str, token: str):
        self.job_id = job_id

    def get_spec(self) -> dict:
        return {"job_id": self.job_id, "attempt": 3, "state": "STARTING", "spec": STORED_SPEC,
                "storage_uri": "file:///tmp/zt-storage"}

    def post_state(self, state: str, *, reason: str | None = None, **kw) -> dict:
        FakeAPI.posts.append((state, reason))
        return {}


class RecordingRuntime:
    def __init__(self, error: Exception | None = None):
        self.error, self.calls = error, []

    def fit(self, spec: JobSpec, loop_config: LoopConfig) -> None:
        self.calls.append((spec, loop_config))
        if self.error is not None:
            raise self.error

    def failure_reason(self, error: BaseException) -> str:
        return Reason.WORKER_FAILED

    def failure_summary(self, error: BaseException) -> str:
        return f"summary of {type(error).__name__}"


@pytest.fixture
def driver(monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_INGEST_TOKEN", "token")
    monkeypatch.delenv("ZEROTRAIN_STORAGE_URI", raising=False)
    monkeypatch.setattr(launch, "WorkerAPI", FakeAPI)
    FakeAPI.posts = []
    previous = signal.getsignal(signal.SIGTERM)  # the driver installs its cancel handler
    yield launch
    signal.signal(signal.SIGTERM, previous)


def test_the_driver_validates_the_spec_once_and_hands_the_runtime_both_forms(driver):
    runtime = RecordingRuntime()
    assert driver.run("job-1", "http://127.0.0.1:1", runtime) == 0
    (spec, loop_config), = runtime.calls
    assert isinstance(spec, JobSpec) and spec.max_failures == JobSpec.model_fields["max_failures"].default
    assert loop_config == LoopConfig(spec=spec.model_dump(mode="json"), job_id="job-1", api_url="http://127.0.0.1:1",
                                     storage_uri="file:///tmp/zt-storage", attempt_base=3)
    assert JobSpec.model_validate(loop_config.spec) == spec  # what each rank validates again
    assert FakeAPI.posts == [("SUCCEEDED", None)]


def test_a_failed_run_is_reported_with_the_runtimes_reason(driver):
    assert driver.run("job-1", "http://127.0.0.1:1", RecordingRuntime(RuntimeError("boom"))) == 1
    assert FakeAPI.posts == [("FAILED", Reason.WORKER_FAILED)]


def test_without_the_ingest_token_the_driver_stops_before_anything(driver, monkeypatch):
    monkeypatch.delenv("ZEROTRAIN_INGEST_TOKEN")
    runtime = RecordingRuntime()
    assert driver.run("job-1", "http://127.0.0.1:1", runtime) == 2
    assert runtime.calls == [] and FakeAPI.posts == []


def _named(name: str, base: type = Exception) -> type:
    return type(name, (base,), {})


def test_ray_train_reads_what_fit_raised_as_a_reason():
    assert ray_train.failure_reason(ValueError("user bug")) == Reason.USER_CODE_ERROR
    wrapped = RuntimeError("fit failed")
    wrapped.__cause__ = _named("InsufficientClusterResourcesError")("no room")
    assert ray_train.failure_reason(wrapped) == Reason.INSUFFICIENT_RESOURCES

    def group_error(*errors: Exception) -> Exception:
        error = _named("WorkerGroupError")("a worker group failed")
        error.worker_failures = dict(enumerate(errors))
        return error

    lost = _named("ActorDiedError")
    assert ray_train.failure_reason(group_error(lost(), lost())) == Reason.WORKER_FAILED
    assert ray_train.failure_reason(group_error(lost(), KeyError("x"))) == Reason.USER_CODE_ERROR
    assert ray_train.failure_reason(_named("ControllerError")()) == Reason.WORKER_FAILED
    from workers.zero.swap_io import OffloadDiskFull

    full = OffloadDiskFull("/nvme/job/1", 3 << 30, 1 << 20)
    assert ray_train.failure_reason(group_error(lost(), full)) == Reason.OFFLOAD_DISK_FULL
    assert "offload_disk_full: /nvme/job/1 needs 3,221,225,472 bytes" in ray_train.failure_summary(group_error(full))
    assert ray_train.user_code_failed({0: full, 1: KeyError("peer")})  # not restarted: it needs the same bytes
    assert not ray_train.user_code_failed({0: full, 1: lost()})


def test_ray_train_asks_for_gpus_only_when_the_spec_has_them():
    cpu_only = JobSpec.model_validate(STORED_SPEC)
    assert ray_train.resources_per_worker(cpu_only) == {"CPU": cpu_only.resources.cpus_per_worker}
    gpus = JobSpec.model_validate({**STORED_SPEC, "resources": {"num_workers": 2, "gpus_per_worker": 1,
                                                                "cpus_per_worker": 4}})
    assert ray_train.resources_per_worker(gpus) == {"CPU": 4.0, "GPU": 1.0}


OOM_TEXT = ("Task was killed due to the node running low on memory.\nMemory on the node (IP: 127.0.0.1, ID: ab12) "
            "where the task (actor ID: cd34, name=RayTrainWorker.__init__, pid=4242, memory used=3.10GB) was "
            "running was 22.45GB / 23.43GB (0.958173), which exceeds the memory usage threshold of 0.95. Ray killed "
            "this worker (ID: ef56) because it was the most recently scheduled task.\nTop 10 memory users:\n"
            "PID\tMEM(GB)\tCOMMAND\n4242\t3.10\tray::RayTrainWorker\n777\t2.00\tpython other_users_secret_job.py")


def test_a_memory_monitor_kill_is_one_line_without_other_processes():
    from ray.exceptions import OutOfMemoryError
    from ray.train import WorkerGroupError

    error = WorkerGroupError("Training failed", {1: OutOfMemoryError(OOM_TEXT), 0: ValueError("unrelated")})
    summary = ray_train.failure_summary(error)
    assert "\n" not in summary and "memory monitor: the node was at 96% of 23.4 GB" in summary
    assert "other_users_secret_job" not in summary and "4242" not in summary


def test_a_user_error_is_summarized_as_its_innermost_type_and_first_line():
    from ray.train import WorkerGroupError

    try:
        try:
            raise KeyError("no column 'text' in the dataset")
        except KeyError as inner:
            raise RuntimeError("data factory failed\n  at line 3") from inner
    except RuntimeError as outer:
        error = WorkerGroupError("Training failed\nlong remote traceback ...", {0: outer})
    assert ray_train.failure_summary(error) == "KeyError: \"no column 'text' in the dataset\""
    assert ray_train.failure_summary(ValueError("x" * 1000)).endswith("…")


def test_the_driver_reports_the_runtimes_summary_not_the_traceback(driver):
    messages = []

    class Recording(FakeAPI):
        def post_state(self, state: str, *, reason: str | None = None, message: str | None = None, **kw) -> dict:
            messages.append(message)
            return {}

    driver.WorkerAPI = Recording
    assert driver.run("job-1", "http://127.0.0.1:1", RecordingRuntime(MemoryError("boom"))) == 1
    assert messages == ["summary of MemoryError"]


def test_an_elastic_job_asks_ray_train_for_a_range_of_workers_and_waits_for_its_minimum():
    fixed = JobSpec.model_validate(STORED_SPEC)
    assert ray_train.scaling_config(fixed).num_workers == 2
    elastic = JobSpec.model_validate({**STORED_SPEC, "resources": {"num_workers": 2, "min_workers": 1}})
    config = ray_train.scaling_config(elastic)
    assert config.num_workers == (1, 2) and config.elasticity_enabled
    assert (config.min_workers, config.max_workers) == (1, 2)


def test_an_elastic_job_gives_up_on_a_group_that_does_not_fit_sooner_unless_the_deployment_says():
    elastic = JobSpec.model_validate({**STORED_SPEC, "resources": {"num_workers": 2, "min_workers": 1}})
    environ: dict[str, str] = {}
    ray_train.shorten_elastic_start_timeout(JobSpec.model_validate(STORED_SPEC), environ)
    assert environ == {}  # a fixed-size job waits as long as Ray says
    ray_train.shorten_elastic_start_timeout(elastic, environ)
    assert environ == {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20"}
    environ = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300"}
    ray_train.shorten_elastic_start_timeout(elastic, environ)
    assert environ == {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300"}
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE

    assert ray_train.START_TIMEOUT_ENV in ENV_VARS_TO_PROPAGATE  # what hands it to the controller


class ResizeAPI:
    posts: ClassVar[list[tuple]] = []

    def __init__(self, api_url: str, job_id: str, token: str):
        pass

    def post_state(self, state: str, **kw) -> dict:
        ResizeAPI.posts.append((state, kw["reason"], kw["attempt"]))
        return {}

    def post_resized(self, from_workers: int, to_workers: int, **kw) -> None:
        ResizeAPI.posts.append(("resized", from_workers, to_workers))

    def close(self) -> None:
        pass


def test_the_resize_reporter_records_each_new_size_and_the_restart_of_a_healthy_group(monkeypatch):
    from types import SimpleNamespace

    from ray.train.v2._internal.execution.callback import ControllerCallback
    from ray.train.v2._internal.execution.controller.state import (
        ResizingState,
        RestartingState,
        RunningState,
    )
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision

    monkeypatch.setenv("ZEROTRAIN_INGEST_TOKEN", "token")
    monkeypatch.setattr(ray_train, "WorkerAPI", ResizeAPI)
    groups = SimpleNamespace(count=1)
    counter = SimpleNamespace(current=SimpleNamespace(remote=lambda: groups.count))
    monkeypatch.setattr(ray_train, "ray", SimpleNamespace(get=lambda ref: ref, get_actor=lambda name: counter))
    ResizeAPI.posts = []
    reporter = ray_train._resize_reporter("http://127.0.0.1:1", "job", attempt_base=0)
    assert isinstance(reporter, ControllerCallback)  # RunConfig hands it to the controller itself

    def start(workers: int) -> None:
        reporter.before_controller_execute_resize_decision(ResizeDecision(workers, {"CPU": 1.0}))

    start(2)  # the first group: nothing to say
    reporter.after_controller_state_update(RunningState(), RestartingState(training_failed_error=None))
    start(1)  # after a node was lost (RestartReporter reported RESTARTING): the resize alone
    groups.count = 2
    reporter.after_controller_state_update(RunningState(), ResizingState(ResizeDecision(2, {"CPU": 1.0})))
    start(2)  # capacity returned: Ray replaces the healthy group, which raises nothing
    start(2)  # a restart at the same size is no resize
    assert ResizeAPI.posts == [("resized", 2, 1), ("RESTARTING", Reason.WORKERS_RESIZED, 3), ("resized", 1, 2)]
