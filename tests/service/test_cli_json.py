"""Issue 33, Must show 3, as a script runs it: ``zerotrain jobs -o json | python -c 'import json,sys;
json.load(sys.stdin)'``, and the same for every read command. The commands come from the CLI's
argparse tree, so a new command with ``-o`` that no list below names fails the test."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from service.cli.main import build_parser
from tests.helpers.service_specs import FAKE_DRIVER, make_spec

LOAD = "python -c 'import json,sys; json.load(sys.stdin)'"
# commands with -o that change something (their JSON is tested with them) or print text
WRITES = {("submit",), ("cancel",), ("team", "create"), ("team", "add"), ("team", "remove"),
          ("webhook", "create"), ("webhook", "delete"), ("token", "revoke")}
TEXT = {("logs",)}  # the log as the API answers it: text, and `-o json` is refused in one line
ELSEWHERE = {("ckpt", "list"): "tests/workers/checkpoint/test_verify_cli.py (a committed checkpoint on disk)"}


def commands_with_output(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every leaf command of the tree that takes ``-o/--output``."""
    found: set[tuple[str, ...]] = set()
    subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in subcommands:
        for name, sub in action.choices.items():
            found |= commands_with_output(sub, path + (name,))
    if not subcommands and any(a.dest == "output" for a in parser._actions):
        found.add(path)
    return found


def shell(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, env=env,
                          timeout=120)


def test_every_read_command_pipes_into_json_load(make_live_service):
    service = make_live_service(local_entrypoint=FAKE_DRIVER, webhook_allowed_hosts="127.0.0.1")
    client = service.client()
    job = client.submit(make_spec())
    client.wait(job.id, timeout=120)
    bin_dir = Path(sys.executable).parent  # the venv's `zerotrain` and `python`
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ZEROTRAIN_URL": service.url,
           "ZEROTRAIN_TOKEN": service.admin_token, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    assert shell("zerotrain team create readers -o json", env).returncode == 0
    made = shell("zerotrain webhook create http://127.0.0.1:9/hook -o json", env)
    assert made.returncode == 0, made.stderr
    hook = json.loads(made.stdout)["id"]

    reads = {("jobs",): "jobs", ("show",): f"show {job.id}", ("events",): f"events {job.id}",
             ("checkpoints",): f"checkpoints {job.id}", ("tensorboard",): f"tensorboard {job.id}",
             ("token", "list"): "token list", ("team", "list"): "team list", ("team", "members"): "team members readers",
             ("team", "quota"): "team quota readers",
             ("webhook", "list"): "webhook list", ("webhook", "deliveries"): f"webhook deliveries {hook}",
             ("plan",): "plan --preset gpt-nano --gpus 2"}
    assert set(reads) | set(ELSEWHERE) | WRITES | TEXT == commands_with_output(build_parser())
    for argv in reads.values():
        piped = shell(f"zerotrain {argv} -o json | {LOAD}", env)
        assert piped.returncode == 0, (argv, piped.stderr)

    refused = shell(f"zerotrain logs {job.id} -o json", env)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        "error: logs prints the job's log as text, as the API answers it; -o json is for commands that print "
        "tables or records"], refused.stderr
