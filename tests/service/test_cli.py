"""The ``zerotrain`` command: the happy path against a live server, and user mistakes that
print exactly one line and exit non-zero, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from service.cli import main
from service.schemas import JobState

from tests.service.conftest import make_spec


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
