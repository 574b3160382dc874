"""Packaging a code folder honours its ``.gitignore`` and ``.zerotrainignore`` files with git's
rules (service/code_packages.py, "ignore files"): a git-ignored data folder is not shipped."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
import yaml

from service.cli import main
from service.code_packages import MANIFEST, MAX_PACKAGE_BYTES, build_package

from tests.helpers.service_specs import FAKE_DRIVER, make_spec


def names(folder: Path) -> list[str]:
    return sorted(zipfile.ZipFile(io.BytesIO(build_package(folder).data)).namelist())


def tree(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def test_a_git_ignored_60_mb_data_folder_is_left_out_of_what_submit_uploads(make_live_service, capsys,
                                                                             tmp_path, monkeypatch):
    service = make_live_service(local_entrypoint=FAKE_DRIVER, scheduler_enabled=False)
    monkeypatch.setenv("ZEROTRAIN_URL", service.url)
    monkeypatch.setenv("ZEROTRAIN_TOKEN", service.admin_token)
    folder = tree(tmp_path / "proj" / "code", {"train.py": "print('hi')\n", "data/README": "shards\n"})
    with open(folder / "data" / "shard-0.bin", "wb") as shard:  # incompressible: 60 MB zipped too
        for _ in range(60):
            shard.write(os.urandom(1_000_000))
    spec_file = tmp_path / "proj" / "job.yaml"
    spec_file.write_text(yaml.safe_dump({**make_spec(), "runtime": {"working_dir": "code"}}))

    # without an ignore file the folder is what it was: too big, refused before anything is uploaded
    assert main(["submit", str(spec_file)]) == 2
    refused = capsys.readouterr().err
    assert f"more than the {MAX_PACKAGE_BYTES / 1e6:.1f} MB limit" in refused and "Traceback" not in refused, refused
    assert service.client().list().items == []

    (folder / ".gitignore").write_text("# large inputs live in storage\ndata/\n")
    assert main(["submit", str(spec_file)]) == 0
    captured = capsys.readouterr()
    job = service.client().get(captured.out.split()[1])
    stored = Path(job.spec["runtime"]["working_dir"].removeprefix("file://"))
    assert stored.stat().st_size < 10_000, captured.err
    assert sorted(zipfile.ZipFile(stored).namelist()) == [".gitignore", MANIFEST, "train.py"]


def test_zerotrainignore_leaves_out_what_git_keeps(tmp_path):
    folder = tree(tmp_path / "work", {
        "train.py": "", "notebooks/explore.ipynb": "{}", "notebooks/helpers.py": "", "runs/a/log.txt": "x",
        ".zerotrainignore": "notebooks/*.ipynb\n/runs\n",
        ".gitignore": "*.ipynb\n!notebooks/explore.ipynb\n",  # git keeps the notebook; the job does not need it
    })
    assert names(folder) == [".gitignore", MANIFEST, ".zerotrainignore", "notebooks/helpers.py", "train.py"]


def test_negation_patterns_take_files_back_and_deeper_ignore_files_win(tmp_path):
    folder = tree(tmp_path / "work", {
        ".gitignore": "*.csv\n!small.csv\ndata/*\n!data/labels.json\n",
        "big.csv": "1", "small.csv": "1", "sub/small.csv": "1", "sub/other.csv": "1",
        "data/x.bin": "1", "data/labels.json": "{}",
        "pkg/.gitignore": "!keep.csv\n/local.py\n", "pkg/keep.csv": "1", "pkg/drop.csv": "1",
        "pkg/local.py": "", "pkg/deep/local.py": "",
        "cache/.gitignore": "*\n",  # the usual way to ignore a whole folder from inside it
        "cache/blob": "1",
    })
    assert names(folder) == [".gitignore", MANIFEST, "data/labels.json", "pkg/.gitignore", "pkg/deep/local.py",
                             "pkg/keep.csv", "small.csv", "sub/small.csv"]


def test_a_file_in_an_ignored_folder_cannot_be_taken_back_as_in_git(tmp_path):
    folder = tree(tmp_path / "work", {".gitignore": "build/\n!build/keep.py\n", "build/keep.py": "", "a.py": ""})
    assert names(folder) == [".gitignore", MANIFEST, "a.py"]


@pytest.mark.parametrize("ignore", [None, "", "# only a comment\n\n"], ids=["no-file", "empty", "comment"])
def test_without_patterns_nothing_changes(tmp_path, ignore):
    files = {"a.py": "", "data/x.csv": "1", "sub/b.py": "", "sub/.hidden": ""}
    bare = build_package(tree(tmp_path / "bare", files))
    if ignore is None:
        assert sorted(zipfile.ZipFile(io.BytesIO(bare.data)).namelist()) == sorted([MANIFEST, *files])
        return
    other = build_package(tree(tmp_path / "bare", {".zerotrainignore": ignore}))
    assert sorted(zipfile.ZipFile(io.BytesIO(other.data)).namelist()) == sorted([MANIFEST, ".zerotrainignore", *files])
