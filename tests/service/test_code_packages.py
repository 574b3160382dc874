"""The user's code from a local folder (issue 17, "user code from anywhere"): the CLI zips and
uploads it once, the service keeps it in its owner's area and lets only its owner name it,
both ends bound its size, and the local launcher runs the driver in the unpacked folder."""

from __future__ import annotations

import hashlib
import io
import os
import time
import zipfile
from pathlib import Path

import httpx
import pytest
import yaml

from service.cli import main
from service.client import Client
from service.code_packages import MANIFEST, BadPackage, build_package, check_package
from service.schemas import JobState

from tests.helpers.service_specs import FAKE_DRIVER, make_spec


def project(root: Path, message: str = "hello from mypkg") -> Path:
    """A user's folder: a package with a factory, next to what must not be shipped."""
    (root / "mypkg").mkdir(parents=True)
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "model.py").write_text(f"def build():\n    return {message!r}\n")
    for junk in (".git/objects/ab", "mypkg/__pycache__", ".venv/lib"):
        (root / junk).mkdir(parents=True)
        (root / junk / "blob").write_bytes(b"x" * 1000)
    (root / ".venv" / "pyvenv.cfg").write_text("home = /usr\n")
    return root


def zip_of(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_package_holds_the_folders_code_and_a_manifest_and_the_same_files_give_the_same_bytes(tmp_path):
    folder = project(tmp_path / "work")
    package = build_package(folder)
    names = zipfile.ZipFile(io.BytesIO(package.data)).namelist()
    assert sorted(names) == sorted([MANIFEST, "mypkg/__init__.py", "mypkg/model.py"])
    assert package.sha256 == hashlib.sha256(package.data).hexdigest()
    time.sleep(0.01)
    (folder / "mypkg" / "model.py").touch()  # a new mtime, the same content
    assert build_package(folder).data == package.data
    assert check_package(package.data) == 3


def test_a_package_over_the_limit_is_refused_naming_the_limit_and_its_size(tmp_path):
    folder = project(tmp_path / "big")
    (folder / "weights.bin").write_bytes(os.urandom(300_000))
    with pytest.raises(BadPackage) as refused:
        build_package(folder, max_bytes=200_000)
    assert "0.2 MB limit" in str(refused.value) and "over 0.3 MB zipped" in str(refused.value), refused.value


@pytest.mark.parametrize("entries, why", [
    ({"pkg/a.py": b"", "pkg/b.py": b""}, "only the directory 'pkg/'"),
    ({"a.py": b"", "../escape.py": b""}, "unsafe path '../escape.py'"),
    ({"a.py": b"", "/etc/x": b""}, "unsafe path '/etc/x'"),
], ids=["lone-top-directory", "dot-dot", "absolute"])
def test_the_server_refuses_a_zip_that_would_not_unpack_the_same_or_safely(entries, why):
    with pytest.raises(BadPackage, match=why.replace("(", r"\(").replace(".", r"\.")):
        check_package(zip_of(entries))


def test_a_zip_bomb_is_refused_from_its_directory():
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("zeros.bin", b"\0" * (3 * 1024 * 1024))
        archive.writestr("b.py", b"")
    assert len(bomb.getvalue()) < 20_000
    with pytest.raises(BadPackage, match="unpacks to 3.1 MB, more than the 2.1 MB limit"):
        check_package(bomb.getvalue(), max_unpacked=2 * 1024 * 1024)


@pytest.fixture
def cli_service(make_live_service, monkeypatch):
    service = make_live_service(local_entrypoint=FAKE_DRIVER)
    monkeypatch.setenv("ZEROTRAIN_URL", service.url)
    monkeypatch.setenv("ZEROTRAIN_TOKEN", service.admin_token)
    return service


def test_submit_uploads_a_relative_folder_once_and_the_driver_runs_in_it(cli_service, capsys, tmp_path,
                                                                         monkeypatch):
    folder = project(tmp_path / "proj" / "code")
    spec = make_spec(call_factory=True)
    spec["model"]["factory"] = "mypkg.model:build"
    spec["runtime"] = {"working_dir": "code"}  # relative to the spec file's folder, not the cwd
    spec_file = tmp_path / "proj" / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec))

    code, stdout, stderr = run(capsys, "submit", str(spec_file))
    assert code == 0, stderr
    job_id = stdout.split()[1]
    client = cli_service.client()
    job = client.wait(job_id, timeout=60)
    assert job.state is JobState.SUCCEEDED, client.logs(job_id)
    sha256 = build_package(folder).sha256
    storage = cli_service.settings.storage_uri
    assert job.spec["runtime"]["working_dir"] == f"{storage}/users/admin/code/{sha256}.zip"
    assert "(2 files, " in stderr and " kB zipped) as " in stderr, stderr
    logs = client.logs(job_id)
    assert "factory says 'hello from mypkg' in " in logs, logs
    workdir = logs.split("factory says 'hello from mypkg' in ")[1].split()[0]
    assert sorted(p.name for p in Path(workdir).iterdir()) == [MANIFEST, "mypkg"]

    # the same folder again: found by its sha256, not uploaded a second time
    stored = Path(storage.removeprefix("file://")) / "users" / "admin" / "code" / f"{sha256}.zip"
    before = stored.stat().st_mtime_ns
    uploads: list[str] = []
    original = Client.request

    def counting(self, method, path, **kwargs):
        uploads.append(f"{method} {path}")
        return original(self, method, path, **kwargs)

    monkeypatch.setattr(Client, "request", counting)
    code, stdout, stderr = run(capsys, "submit", str(spec_file))
    assert code == 0, stderr
    assert "POST /api/v1/code-packages" not in uploads and f"GET /api/v1/code-packages/{sha256}" in uploads
    assert stored.stat().st_mtime_ns == before
    assert client.wait(stdout.split()[1], timeout=60).state is JobState.SUCCEEDED


def test_a_missing_or_too_big_folder_is_one_line_naming_it(make_live_service, capsys, tmp_path, monkeypatch):
    service = make_live_service(local_entrypoint=FAKE_DRIVER, max_code_package_bytes=2048)
    monkeypatch.setenv("ZEROTRAIN_URL", service.url)
    monkeypatch.setenv("ZEROTRAIN_TOKEN", service.admin_token)
    spec = make_spec()
    spec["runtime"] = {"working_dir": "nowhere"}
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    code, _, stderr = run(capsys, "submit", str(spec_file))
    assert code == 2 and "Traceback" not in stderr
    assert "runtime.working_dir 'nowhere' is not a folder" in stderr and str(tmp_path / "nowhere") in stderr

    folder = project(tmp_path / "nowhere")
    (folder / "data.bin").write_bytes(os.urandom(5000))  # over the server's 2048 bytes
    code, _, stderr = run(capsys, "submit", str(spec_file))
    assert code == 2 and "Traceback" not in stderr, stderr
    assert "more than this service accepts" in stderr and "the limit is 2048 bytes" in stderr, stderr
    assert service.client().list().items == []


def test_only_the_owner_of_an_upload_may_run_it(make_live_service, tmp_path):
    service = make_live_service(local_entrypoint=FAKE_DRIVER, scheduler_enabled=False)
    alice = service.client(service.create_user("alice"))
    bob = service.client(service.create_user("bob"))
    package = build_package(project(tmp_path / "alice"))
    stored = alice.upload_code(package.data)
    assert stored.sha256 == package.sha256 and stored.size_bytes == len(package.data)
    assert bob.code_package(package.sha256) is None  # kept per user: bob cannot even see it

    def submit(client, working_dir: str) -> httpx.Response:
        spec = {**make_spec(), "runtime": {"working_dir": working_dir}}
        return client._http.post(client.url + "/api/v1/jobs", json=spec)

    assert submit(alice, stored.uri).status_code == 201
    refused = submit(bob, stored.uri)
    assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == "runtime.working_dir"
    assert "must be a package you uploaded" in refused.json()["errors"][0]["message"]
    for elsewhere in ("file:///etc/passwd.zip", stored.uri.replace(package.sha256, "0" * 64)):
        refused = submit(alice, elsewhere)
        assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == "runtime.working_dir", elsewhere
    assert submit(service.client(), stored.uri).status_code == 201  # an admin may run anyone's


def test_the_server_bounds_and_checks_what_it_stores(make_live_service):
    service = make_live_service(scheduler_enabled=False, max_code_package_bytes=4096, max_body_bytes=1024)
    client = service.client()
    http, api = client._http, client.url + "/api/v1"
    small = zip_of({"a.bin": os.urandom(2000), MANIFEST: b"{}"})
    assert len(small) > 1024
    answer = http.post(api + "/code-packages", content=small)
    assert answer.status_code == 201, answer.text  # the package's limit, not the JSON bodies' 1024 bytes
    assert http.post(api + "/code-packages", content=small).status_code == 200  # the same bytes: kept once
    too_big = zip_of({"a.bin": os.urandom(5000)})
    answer = http.post(api + "/code-packages", content=too_big)
    assert answer.status_code == 413 and "4096 bytes" in answer.json()["detail"]
    answer = http.post(api + "/code-packages", content=b"not a zip")
    assert answer.status_code == 422 and answer.json()["errors"][0]["message"] == "the body is not a zip file"
    lone = http.post(api + "/code-packages", content=zip_of({"pkg/a.py": b""}))
    assert lone.status_code == 422 and "only the directory 'pkg/'" in lone.json()["detail"]


def test_without_user_code_a_user_cannot_upload(make_live_service):
    service = make_live_service(scheduler_enabled=False, allow_user_code=False)
    alice = service.client(service.create_user("alice"))
    answer = alice._http.post(alice.url + "/api/v1/code-packages", content=zip_of({"a.py": b""}))
    assert answer.status_code == 403 and "user code is disabled" in answer.json()["detail"]


# ----------------------------------------------------------------------------- deleting old packages


@pytest.fixture
def package_store(migrated_postgres_url, tmp_path):
    """A scheduler's view: the database, file storage, and a way to age a stored package."""
    from service.db import make_engine, make_sessionmaker
    from service.settings import Settings

    engine = make_engine(migrated_postgres_url)
    settings = Settings(home=tmp_path, database_url=migrated_postgres_url, launcher="local",
                        code_package_retention_days=30)
    yield make_sessionmaker(engine), settings
    engine.dispose()


def stored(settings, owner: str, content: str, age_days: float) -> str:
    """A package of ``owner``'s uploaded ``age_days`` ago; its URI."""
    from service.code_packages import store_package

    package, _ = store_package(settings.storage_uri, owner, build_package(project(
        Path(settings.home) / "src" / f"{owner}-{content}", message=content)).data)
    then = time.time() - age_days * 86400
    os.utime(package.uri.removeprefix("file://"), (then, then))
    return package.uri


def add_job(make_session, working_dir: str, state: str, age_days: float = 0) -> None:
    import uuid
    from datetime import datetime, timedelta, timezone

    from service.models import Job

    spec = make_spec()
    spec["runtime"] = {"working_dir": working_dir}
    created = datetime.now(timezone.utc) - timedelta(days=age_days)
    with make_session() as session:
        session.add(Job(id=f"job-{uuid.uuid4().hex[:16]}", name="t", owner="alice", state=state, attempt=0,
                        spec=spec, created_at=created, updated_at=created))
        session.commit()


def exists(uri: str) -> bool:
    return Path(uri.removeprefix("file://")).exists()


def test_packages_unused_past_the_retention_are_deleted_and_those_in_use_never(package_store):
    from service.scheduler import Scheduler
    from tests.service.test_scheduler import RecordingLauncher

    make_session, settings = package_store
    unused = stored(settings, "alice", "unused", age_days=40)
    bobs = stored(settings, "bob", "unused", age_days=40)
    running = stored(settings, "alice", "running", age_days=400)
    queued = stored(settings, "alice", "queued", age_days=400)
    used_lately = stored(settings, "alice", "used-lately", age_days=40)
    finished_long_ago = stored(settings, "alice", "finished-long-ago", age_days=90)
    fresh = stored(settings, "alice", "fresh", age_days=1)
    add_job(make_session, running, "RUNNING", age_days=100)
    add_job(make_session, queued, "QUEUED", age_days=100)
    add_job(make_session, used_lately, "SUCCEEDED", age_days=2)
    add_job(make_session, finished_long_ago, "FAILED", age_days=60)

    Scheduler(make_session, RecordingLauncher(), settings).run_once()  # its periodic work
    assert [exists(uri) for uri in (unused, bobs, finished_long_ago)] == [False, False, False]
    assert [exists(uri) for uri in (running, queued, used_lately, fresh)] == [True, True, True, True]
    # a package that is gone is refused at submit with a clear error, as any missing package is
    from service.code_packages import check_working_dir
    from service.storage_policy import UnsafeUri

    with pytest.raises(UnsafeUri, match="upload it again"):
        check_working_dir(unused, settings.storage_uri, "alice", is_admin=False)


def test_a_submit_naming_a_package_and_its_deletion_never_cross(package_store):
    """A job stored while the deletion waits for the submit's lock is seen by the deletion."""
    import threading
    from datetime import timedelta

    from service.code_package_retention import delete_unused_packages, hold_packages_for_submit

    make_session, settings = package_store
    old = stored(settings, "alice", "old", age_days=40)
    deleted: list[list[str]] = []
    with make_session() as submit:
        hold_packages_for_submit(submit)  # the submit has checked that the package exists

        def sweep() -> None:
            with make_session() as session:
                deleted.append(delete_unused_packages(session, settings.storage_uri, timedelta(days=30)))
                session.commit()

        sweeper = threading.Thread(target=sweep)
        sweeper.start()
        sweeper.join(timeout=1.0)
        assert sweeper.is_alive() and exists(old)  # waits for the submit's transaction
        add_job(make_session, old, "QUEUED")  # the submit's job (committed, as the submit's own would be)
        submit.commit()
    sweeper.join(timeout=30)
    assert deleted == [[]] and exists(old)
