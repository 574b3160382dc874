"""The ``zerotrain`` command: the happy path against a live server, and user mistakes that
print exactly one line and exit non-zero, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from unittest.mock import ANY
from contextlib import contextmanager

import httpx
import pytest
import yaml

from service.cli import main
from service.schemas import TERMINAL_STATES, JobState

from tests.conftest import free_port
from tests.helpers.cli_tables import table_rows
from tests.helpers.service_specs import make_spec


@pytest.fixture
def cli_env(service, monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_URL", service.url)
    monkeypatch.setenv("ZEROTRAIN_TOKEN", service.admin_token)
    return service


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, stderr: str, *fragments: str) -> None:
    assert code == 2
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], stderr


def test_submit_follow_show_logs_and_jobs(cli_env, capsys, tmp_path):
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(make_spec()))
    code, stdout, _ = run(capsys, "submit", str(spec_file), "--follow")
    assert code == 0, stdout
    job_id = stdout.split()[1]
    assert f"{job_id} SUCCEEDED" in stdout
    assert cli_env.client().get(job_id).state is JobState.SUCCEEDED

    code, stdout, _ = run(capsys, "jobs", "--state", "succeeded")
    assert code == 0 and job_id in stdout
    code, stdout, _ = run(capsys, "show", job_id)
    assert code == 0 and "RUNNING" in stdout and "SUCCEEDED" in stdout
    code, stdout, _ = run(capsys, "logs", job_id)
    assert code == 0 and "fake driver done" in stdout


def test_every_read_command_prints_the_apis_objects_as_json(cli_env, capsys, tmp_path):
    """``-o json`` (Must show 3 of issue 33): what each command prints is one JSON document, the
    API's own objects, and ``--url``/``--token`` reach the service without the environment."""
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(make_spec()))
    code, stdout, _ = run(capsys, "submit", str(spec_file), "-o", "json")
    job = json.loads(stdout)
    api = httpx.Client(base_url=f"{cli_env.url}/api/v1", timeout=30,
                       headers={"Authorization": f"Bearer {cli_env.admin_token}"})
    cli_env.client().wait(job["id"], timeout=60)
    reads = {("jobs",): "/jobs", ("show", job["id"]): None, ("events", job["id"]): f"/jobs/{job['id']}/events",
             ("checkpoints", job["id"]): f"/jobs/{job['id']}/checkpoints", ("token", "list"): "/tokens"}
    for argv, path in reads.items():
        code, stdout, _ = run(capsys, *argv, "-o", "json")
        assert code == 0, argv
        printed = json.loads(stdout)  # one document, nothing else on stdout
        if path is not None:
            assert printed == api.get(path).json(), argv
    code, stdout, _ = run(capsys, "show", job["id"], "-o", "json")
    shown = json.loads(stdout)
    assert shown["job"] == api.get(f"/jobs/{job['id']}").json() and shown["events"] == \
        api.get(f"/jobs/{job['id']}/events").json()["items"]
    code, stdout, _ = run(capsys, "plan", "--preset", "gpt-nano", "--gpus", "2", "-o", "json")
    assert code == 0 and json.loads(stdout)["stage"] in (0, 1, 2, 3)
    # the flags instead of the environment
    for name in ("ZEROTRAIN_URL", "ZEROTRAIN_TOKEN"):
        os.environ.pop(name)
    code, stdout, _ = run(capsys, "jobs", "-o", "json", "--url", cli_env.url, "--token", cli_env.admin_token)
    assert code == 0 and [j["id"] for j in json.loads(stdout)["items"]] == [job["id"]]


def test_team_commands_print_a_table_or_the_apis_objects(cli_env, capsys):
    """``team create|add|list|members|remove``: a sentence or a table for people, and with
    ``-o json`` exactly what the API answers."""
    api = httpx.Client(base_url=f"{cli_env.url}/api/v1", timeout=30,
                       headers={"Authorization": f"Bearer {cli_env.admin_token}"})
    cli_env.create_user("bob")
    code, stdout, _ = run(capsys, "team", "create", "red")
    assert code == 0 and "team red created" in stdout
    code, stdout, _ = run(capsys, "team", "add", "red", "bob", "--role", "viewer", "-o", "json")
    assert code == 0 and json.loads(stdout) == api.get("/teams/red/members").json()["items"][0]
    admin = cli_env.client().teams()[0].created_by
    code, stdout, _ = run(capsys, "team", "list")
    assert code == 0 and table_rows(stdout)[:2] == [["team", "your role", "created by", "created"],
                                                    ["red", "maintainer", admin, ANY]], stdout
    code, stdout, _ = run(capsys, "team", "members", "red")
    assert code == 0 and table_rows(stdout) == [["user", "role", "added by", "added"], ["bob", "viewer", admin, ANY]]
    for argv, path in {("team", "list"): "/teams", ("team", "members", "red"): "/teams/red/members"}.items():
        code, stdout, _ = run(capsys, *argv, "-o", "json")
        assert code == 0 and json.loads(stdout) == api.get(path).json(), argv
    assert run(capsys, "team", "remove", "red", "bob")[:2] == (0, "bob removed from team red\n")


def test_submit_with_a_deepspeed_config(cli_env, capsys, tmp_path):
    """``zerotrain submit JOB.yaml --deepspeed ds_config.json``: the stored spec holds what the
    config became; what it leaves aside is said on stderr; a key it cannot take is one line."""
    spec = make_spec()
    spec["zero"] = {"stage": "auto"}
    spec_file, ds_file = tmp_path / "job.yaml", tmp_path / "ds_config.json"
    spec_file.write_text(yaml.safe_dump(spec))
    ds_file.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}, "bf16": {"enabled": True}}))
    code, stdout, stderr = run(capsys, "submit", str(spec_file), "--deepspeed", str(ds_file))
    assert code == 0, stdout + stderr
    stored = cli_env.client().get(stdout.split()[1]).spec
    assert (stored["zero"]["stage"], stored["zero"]["precision"]) == (2, "bf16")
    assert "ignored: deepspeed.zero_optimization.overlap_comm" in stderr
    ds_file.write_text(json.dumps({"zero_optimization": {"mics_shard_size": 4}}))
    code, _, stderr = run(capsys, "submit", str(spec_file), "--deepspeed", str(ds_file))
    assert_one_line_error(code, stderr, "deepspeed.zero_optimization.mics_shard_size", "not built")


def interruptible() -> None:
    """A child's Ctrl-C as at a terminal: the default SIGINT action, whatever the test runner
    inherited. A runner started in the background by a non-interactive shell ignores SIGINT,
    and its children would too, so no Ctrl-C test could pass there."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def logs_follow(service, job_id: str, limit_s: float = 60) -> Iterator[subprocess.Popen]:
    """``zerotrain logs JOB --follow`` as a user runs it: its own process, read line by line as
    it prints (killed after ``limit_s``, so a follower that never ends fails the test)."""
    env = {**os.environ, "ZEROTRAIN_URL": service.url, "ZEROTRAIN_TOKEN": service.admin_token}
    follower = subprocess.Popen([sys.executable, "-m", "service.cli", "logs", job_id, "--follow"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    timer = threading.Timer(limit_s, follower.kill)
    timer.start()
    try:
        yield follower
    finally:
        timer.cancel()
        follower.kill()
        follower.wait()


def read_until(stream, prefix: str) -> list[str]:
    """Lines of ``stream`` up to and including the first that starts with ``prefix``."""
    lines = [stream.readline()]
    while not lines[-1].startswith(prefix):
        assert lines[-1], f"the output ended before a line starting with {prefix!r}: {lines}"
        lines.append(stream.readline())
    return lines


def test_logs_follow_streams_a_running_job_until_it_ends(service):
    lines = 12
    job = service.client().submit(make_spec(log_lines=lines, line_interval_s=0.4))
    with logs_follow(service, job.id) as follower:
        printed = read_until(follower.stdout, "log line")
        assert service.client().get(job.id).state not in TERMINAL_STATES  # streamed while it ran
        printed += follower.stdout.readlines()  # to the end of its output
        stderr = follower.stderr.read()
        assert follower.wait() == 0, stderr
    shown = [line.rstrip("\n") for line in printed if line.startswith("log line")]
    assert shown == [f"log line {n}" for n in range(lines)]  # every line, once, in order
    assert "fake driver done\n" in printed
    assert stderr.startswith(f"{job.id} SUCCEEDED (")


def test_ctrl_c_ends_logs_follow_without_a_traceback(service):
    job = service.client().submit(make_spec(log_lines=1, hang_s=60))
    try:
        with logs_follow(service, job.id) as follower:
            read_until(follower.stdout, "log line")
            follower.send_signal(signal.SIGINT)
            stderr = follower.stderr.read()
            assert follower.wait() == 130
    finally:
        service.client().cancel(job.id)
    assert "Traceback" not in stderr and stderr.strip() == "interrupted"


def test_serve_says_where_the_dashboard_is_once_it_listens(tmp_path):
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ZEROTRAIN_")},
           "ZEROTRAIN_HOME": str(tmp_path), "ZEROTRAIN_LAUNCHER": "local"}
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=interruptible)
    timer = threading.Timer(60, server.kill)
    timer.start()
    try:
        line = read_until(server.stdout, "dashboard:")[-1]
        assert line.split() == ["dashboard:", f"http://127.0.0.1:{port}/", "API", "reference:",
                                f"http://127.0.0.1:{port}/docs"]
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)  # it listens when it says so
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        server.send_signal(signal.SIGINT)
        assert server.wait(30) == 130  # stopped by Ctrl-C, as every command is (run_command)
    finally:
        timer.cancel()
        server.kill()
        server.wait()


def test_follow_of_a_failing_job_exits_1(cli_env, capsys, tmp_path):
    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(make_spec(fail=True)))
    code, stdout, _ = run(capsys, "submit", str(spec_file), "-f")
    assert code == 1 and "FAILED (user_code_error: ValueError: boom)" in stdout


def test_cancel_and_events(make_live_service, capsys, monkeypatch):
    service = make_live_service(scheduler_enabled=False)
    monkeypatch.setenv("ZEROTRAIN_URL", service.url)
    monkeypatch.setenv("ZEROTRAIN_TOKEN", service.admin_token)
    job_id = service.client().submit(make_spec()).id
    assert run(capsys, "cancel", job_id)[:2] == (0, f"{job_id} CANCELLED\n")
    code, stdout, _ = run(capsys, "events", job_id)
    assert code == 0 and "cancelled_by_user" in stdout
    code, _, stderr = run(capsys, "cancel", job_id)
    assert_one_line_error(code, stderr, "already CANCELLED")


def test_user_mistakes_print_one_line(cli_env, capsys, tmp_path, monkeypatch):
    assert_one_line_error(*run(capsys, "submit", str(tmp_path / "missing.yaml"))[::2], "cannot read")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    assert_one_line_error(*run(capsys, "submit", str(broken))[::2], "not valid YAML")
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    assert_one_line_error(*run(capsys, "submit", str(listed))[::2], "job spec object")
    invalid = tmp_path / "invalid.json"
    invalid.write_text(json.dumps({**make_spec(), "train": {**make_spec()["train"], "steps": 0}}))
    assert_one_line_error(*run(capsys, "submit", str(invalid))[::2], "train.steps")
    assert_one_line_error(*run(capsys, "show", "job-nope")[::2], "job 'job-nope' not found")
    monkeypatch.setenv("ZEROTRAIN_TOKEN", "zt_wrong")
    assert_one_line_error(*run(capsys, "jobs")[::2], "invalid or revoked API token")
    monkeypatch.setenv("ZEROTRAIN_URL", "http://127.0.0.1:9")
    assert_one_line_error(*run(capsys, "jobs")[::2], "cannot reach zerotrain")


def test_bad_settings_and_unreachable_database_are_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ZEROTRAIN_HOME", str(tmp_path))
    monkeypatch.setenv("ZEROTRAIN_LAUNCHER", "teleport")
    assert_one_line_error(*run(capsys, "db", "upgrade")[::2], "ZEROTRAIN_LAUNCHER")
    monkeypatch.delenv("ZEROTRAIN_LAUNCHER")
    monkeypatch.setenv("ZEROTRAIN_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:9/nope")
    assert_one_line_error(*run(capsys, "token", "create", "ci")[::2], "cannot use the database")


def test_token_create_prints_a_working_token_once(postgres_url, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ZEROTRAIN_HOME", str(tmp_path))
    monkeypatch.setenv("ZEROTRAIN_DATABASE_URL", postgres_url)
    code, stdout, stderr = run(capsys, "token", "create", "carol", "--admin")
    assert code == 0 and "shown only once" in stderr
    token = stdout.strip()
    from service.auth import authenticate
    from service.db import make_engine, make_sessionmaker

    engine = make_engine(postgres_url)
    with make_sessionmaker(engine)() as session:
        assert authenticate(session, token).is_admin
    engine.dispose()


def test_console_script_exit_status(tmp_path):
    result = subprocess.run([sys.executable, "-m", "service.cli", "show", "job-x"], capture_output=True, text=True,
                            env={"ZEROTRAIN_URL": "http://127.0.0.1:9", "ZEROTRAIN_HOME": str(tmp_path),
                                 "PATH": "/usr/bin:/bin"}, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: cannot reach zerotrain")
    assert "Traceback" not in result.stderr


# Two ranks' processes as Ray's driver prints them; the group restarts and pid 12 comes back as rank 0.
WORKER_LINES = [
    [11, "zerotrain: this process is rank 0 of 2"], [12, "zerotrain: this process is rank 1 of 2"],
    [11, "step 1/5  loss 5.0000"], [12, "rank 1 has waited 30.0s on collective #5"],
    [12, "zerotrain: this process is rank 0 of 2"], [13, "zerotrain: this process is rank 1 of 2"],
    [12, "step 2/5  loss 4.0000"], [13, "rank 1 resumed from step 1"],
]


def test_logs_rank_shows_only_that_ranks_lines(cli_env, capsys):
    job = cli_env.client().submit(make_spec(worker_lines=WORKER_LINES, line_interval_s=0.0))
    cli_env.client().wait(job.id, timeout=60)
    code, stdout, _ = run(capsys, "logs", job.id, "--rank", "1")
    assert code == 0
    assert stdout.splitlines() == [
        "(RayTrainWorker pid=12) zerotrain: this process is rank 1 of 2",
        "(RayTrainWorker pid=12) rank 1 has waited 30.0s on collective #5",
        "(RayTrainWorker pid=13) zerotrain: this process is rank 1 of 2",
        "(RayTrainWorker pid=13) rank 1 resumed from step 1"]
    last = "(RayTrainWorker pid=12) step 2/5  loss 4.0000\n"
    code, stdout, _ = run(capsys, "logs", job.id, "--rank", "0", "--tail", str(len(last)))
    assert code == 0 and stdout == last  # the tail of rank 0's lines
    code, stdout, _ = run(capsys, "logs", job.id)
    assert "fake driver done" in stdout and "rank 1 resumed" in stdout  # without --rank: the whole log

    code, _, stderr = run(capsys, "logs", job.id, "--rank", "2")
    assert_one_line_error(code, stderr, "rank", "has 2 ranks", "no rank 2")


def test_logs_rank_follow_streams_that_ranks_lines_until_the_job_ends(service):
    job = service.client().submit(make_spec(worker_lines=WORKER_LINES, line_interval_s=0.4))
    env = {**os.environ, "ZEROTRAIN_URL": service.url, "ZEROTRAIN_TOKEN": service.admin_token}
    follower = subprocess.run([sys.executable, "-m", "service.cli", "logs", job.id, "--rank", "1", "--follow"],
                              env=env, capture_output=True, text=True, timeout=60)
    assert follower.returncode == 0, follower.stderr
    assert [line.split(") ", 1)[1] for line in follower.stdout.splitlines()] == [
        "zerotrain: this process is rank 1 of 2", "rank 1 has waited 30.0s on collective #5",
        "zerotrain: this process is rank 1 of 2", "rank 1 resumed from step 1"]
    assert follower.stderr.startswith(f"{job.id} SUCCEEDED")
