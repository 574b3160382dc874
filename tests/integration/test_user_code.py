"""Issue 17, Must-show 1: the example package (examples/my_project) submitted from its local
folder through the `zerotrain` command trains on a real Ray head; the same package with a
factory that raises ends `user_code_error` in its first attempt although `max_failures` is 2,
with a short message naming the exception and the whole traceback as the job's details."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.schemas import JobState
from tests.integration.test_ray_jobs import explain

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "my_project"
ZEROTRAIN = Path(sys.executable).with_name("zerotrain")  # the console script of this environment


def zerotrain(plane, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The `zerotrain` command as a user runs it, against ``plane``, importing this checkout."""
    token = Path(plane.settings.token_file).read_text().strip()
    env = {**os.environ, "ZEROTRAIN_URL": plane.url, "ZEROTRAIN_TOKEN": token,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([str(ZEROTRAIN), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def submitted_job_id(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("submitted job-"), result.stdout
    return result.stdout.split()[1]


def test_the_example_package_trains_from_its_folder_and_a_raising_factory_fails_at_once(make_control_plane, tmp_path):
    plane = make_control_plane()
    spec = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    assert spec["runtime"] == {"working_dir": "."} and spec["max_failures"] == 2

    # From the repository's root, as the example's comment says; the folder is found from the spec file.
    job_id = submitted_job_id(zerotrain(plane, "submit", "examples/my_project/job.yaml", cwd=REPO))
    with plane.client() as client:
        final = client.wait(job_id, timeout=300)
        assert final.state is JobState.SUCCEEDED, explain(client, job_id)
        assert final.spec["runtime"]["working_dir"].startswith(f"{plane.settings.storage_uri}/users/admin/code/")
        rows = client.metrics(job_id, rank=0)
    steps = spec["train"]["steps"]
    assert [row.step for row in rows] == list(range(1, steps + 1))
    first, last = rows[0].loss, rows[-1].loss
    assert last < 0.8 * first, (first, last)  # the example's rule is learnt
    assert all("accuracy" in (row.user or {}) for row in rows)  # the model's own metric

    # The same package, its factory given a value it refuses: an error of the user's code.
    project = tmp_path / "my_project"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("__pycache__"))
    spec["model"]["kwargs"]["layers"] = 0
    (project / "broken.yaml").write_text(yaml.safe_dump(spec))
    job_id = submitted_job_id(zerotrain(plane, "submit", str(project / "broken.yaml"), cwd=tmp_path))
    with plane.client() as client:
        final = client.wait(job_id, timeout=240)
        events = client.events(job_id)
        assert final.state is JobState.FAILED, explain(client, job_id)
    assert final.reason == "user_code_error"
    assert final.attempt == 1 and not any(e.to_state is JobState.RESTARTING for e in events), explain(client, job_id)
    assert "ValueError: layers must be at least 1, got 0" in final.message and len(final.message) < 2000, final.message
    assert 'my_project/model.py", line' in final.message  # the user's own frame
    assert final.details and "Traceback (most recent call last)" in final.details, final.details
    assert "layers must be at least 1, got 0" in final.details and "\x1b[" not in final.details
