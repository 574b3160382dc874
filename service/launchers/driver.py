"""How a job's driver is started, for every launcher: its command line and its environment.

Why one module: the driver's environment is a security boundary. A job's own code (a
``model.factory``, a ``data.factory``, a ``runtime.working_dir`` package) runs in the driver's
and the workers' processes and can read every variable they were given, so a job gets an
allow-list: what it needs and nothing else. The control plane's own secrets -- its database URL,
the bootstrap admin token, the Ray token it holds for a cluster, the Kubernetes config, any
other ``ZEROTRAIN_*`` setting -- never reach a job, because nothing copies a variable that is
not named here. Every launcher calls ``driver_environment`` (or the two halves it joins,
below) and ``driver_command``, so the allow-list is written once.

[Note: two halves of a driver's environment]
``job_environment(request)`` is what this job is told: its id, attempt, API URL, ingest token
and storage URI (the variables ``workers.launch`` and ``workers.train`` read), and the Ray
Train settings every job runs with (``RAY_TRAIN_ENV``). It travels with
the job: the local launcher's child environment, the Ray job's ``runtime_env.env_vars``, the
KubeRay pods' container env (the ingest token by Secret reference there).
``host_environment()`` is what any process needs from the machine it runs on, copied from the
control plane's own environment through ``HOST_VARIABLES``/``HOST_PREFIXES``: where programs,
modules and libraries are, home and locale, the loopback and collective-communication knobs,
and the object-store endpoint and credentials the workers use (``storage.storage``
and botocore read them). Only what runs on this machine takes it: the local launcher's driver,
and the Ray head the Ray launcher starts (its raylets spawn the drivers and the workers from
its environment). A remote Ray cluster's nodes and a Kubernetes pod have their own.

[Note: what a job's code can still reach]
With ``Settings.job_storage_credentials = "shared"`` (the default) the storage credentials are
the control plane's own, one set for every job, so a job's code can read and write everything
those keys can. With ``"sts"`` no storage key is copied (``STORAGE_KEY_VARIABLES``: not to a
driver, not to the embedded Ray head); the job is told ``STORAGE_CREDENTIALS_ENV`` and its
processes fetch temporary credentials for its own prefixes with its ingest token
(``service.job_credentials``, ``storage.credentials``). On a Ray cluster shared by
several jobs, a job's code also holds that cluster's Ray token (Ray hands it to every process
it starts), with which it can read other jobs' ``runtime_env`` through the Jobs API -- their
ingest tokens included. docs/contracts.md and deploy/README.md say the same.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from contract.environment import (
    API_URL_ENV,
    ATTEMPT_ENV,
    ENV_PREFIX,
    INGEST_TOKEN_ENV,
    JOB_ENV_PASSTHROUGH_ENV,
    JOB_ID_ENV,
    S3_ENDPOINT_ENV,
    STORAGE_CREDENTIALS_ENV,
    STORAGE_MARKER_ENV,
    STORAGE_URI_ENV,
    UPLOAD_ATTEMPTS_ENV,
)
from service.launchers.base import LaunchRequest
from storage import credentials as storage_credentials

DRIVER_MODULE = "workers.launch"

# What a job is told (read by workers/launch.py and workers/train.py).
# (the names: contract/environment.py; "api": the job's processes get storage credentials from the control plane)
STORAGE_CREDENTIALS_FROM_API = storage_credentials.FROM_API

# [Note: Ray Train settings every job runs with]
# They travel with the job's own variables (``job_environment``), so the driver, the Ray Train
# controller and every worker read them under each launcher. Each keeps a job's log readable:
# - RAY_TRAIN_ENABLE_PRINT_PATCH=0: Ray Train's workers replace ``print`` with a function that
#   writes to stdout *and* logs the text through the root logger (to stderr), because a Ray
#   worker's ``sys.stdout`` is not ``sys.__stdout__``; both streams reach the driver, so every
#   line a rank prints (rank 0's progress lines, a user's own prints) would be in the log twice.
#   Unpatched, ``print`` writes once; logging records still go through Ray Train's handlers.
# - RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0: Ray Train's PreemptionWatcher actor is created with
#   the worker actors' handles and ``max_restarts=-1``, for which Ray's core worker logs an
#   error on every run (ray-project/ray#53727). The watcher lets Ray Train wait out a node
#   drain before restarting, for its own ``ray.train.report`` checkpoints and
#   ``get_preemption_info``; zerotrain uses neither (it checkpoints itself, and a restarted
#   group resumes from that). Without it a drained node's worker dies and Ray Train restarts
#   the group on its preemption budget (``max_preemption_failures``, unlimited by default),
#   which the death's ``RayActorError.preempted`` selects.
# - RAY_DEDUP_LOGS=0: the driver folds lines that differ only in their numbers, written by
#   several processes within 5 s, into the first one and a later "[repeated 3x across cluster]"
#   under the last writer's prefix. "rank 1 has waited 30.0s on collective #5" would then never
#   appear under rank 1's process, and each rank's "this process is rank N" line
#   (contract.log_lines) would be folded into rank 0's: a job's log is read per rank
#   (``GET /logs?rank=N``), so each rank's lines are kept, each under its own prefix.
RAY_TRAIN_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
                 "RAY_DEDUP_LOGS": "0"}

# Ray and Gloo on loopback: Ray keeps 127.0.0.1 instead of swapping in the machine's address,
# and Gloo's sockets use the loopback interface.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"}

# What a process needs from the machine it runs on; copied from the control plane's environment
# when set there, and nothing else is.
HOST_VARIABLES = frozenset({
    # the process runs: programs, modules and libraries, whose home, which locale and time zone
    "PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR",
    # loopback, devices and threads for Ray, Gloo and torch
    *LOOPBACK_ENV, "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
    # the object store as the workers reach it (endpoint; botocore's AWS_* below)
    S3_ENDPOINT_ENV,
    # the workers' own knobs
    UPLOAD_ATTEMPTS_ENV,
})
HOST_PREFIXES = (
    "LC_",  # locale categories
    "AWS_",  # botocore's settings: the storage credentials, region, retries, profile
    "NCCL_",  # NCCL's network and debugging knobs on GPU nodes
)
_HOST_NAME = re.compile("|".join(re.escape(prefix) for prefix in HOST_PREFIXES))

# botocore's ways to find long-lived credentials: never copied where a job gets scoped ones
STORAGE_KEY_VARIABLES = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN",
})


# An operator's own additions to the allow-list: a comma-separated list of variable names
# (e.g. HF_TOKEN, HTTPS_PROXY). The service's settings and Ray's token are never passed on.
PASSTHROUGH_ENV = JOB_ENV_PASSTHROUGH_ENV
NEVER_PASSED = re.compile(re.escape(ENV_PREFIX) + r"|RAY_AUTH_TOKEN|RAY_ADDRESS$|KUBECONFIG$")


def passthrough_names(source: Mapping[str, str]) -> frozenset[str]:
    names = {name.strip() for name in source.get(PASSTHROUGH_ENV, "").split(",") if name.strip()}
    return frozenset(name for name in names if not NEVER_PASSED.match(name))


def is_host_variable(name: str, passthrough: frozenset[str] = frozenset()) -> bool:
    return name in HOST_VARIABLES or name in passthrough or _HOST_NAME.match(name) is not None


def host_environment(source: Mapping[str, str] | None = None, *, storage_keys: bool = True) -> dict[str, str]:
    """The allow-listed part of ``source`` (the control plane's environment by default), plus
    the names the operator listed in ``ZEROTRAIN_JOB_ENV_PASSTHROUGH``; without the storage
    keys (``STORAGE_KEY_VARIABLES``) when ``storage_keys`` is false (scoped job credentials)."""
    source = os.environ if source is None else source
    passthrough = passthrough_names(source)
    return {name: value for name, value in source.items() if is_host_variable(name, passthrough)
            and (storage_keys or name not in STORAGE_KEY_VARIABLES)}


def job_environment(request: LaunchRequest) -> dict[str, str]:
    """What one job attempt is told (the ingest token is under ``INGEST_TOKEN_ENV``), and the
    Ray Train settings every job runs with (``RAY_TRAIN_ENV``)."""
    return {
        JOB_ID_ENV: request.job_id,
        ATTEMPT_ENV: str(request.attempt),
        API_URL_ENV: request.api_url,
        INGEST_TOKEN_ENV: request.ingest_token,
        STORAGE_URI_ENV: request.storage_uri,
        **({STORAGE_CREDENTIALS_ENV: STORAGE_CREDENTIALS_FROM_API} if request.scoped_storage else {}),
        **({STORAGE_MARKER_ENV: request.storage_marker} if request.storage_marker else {}),
        **RAY_TRAIN_ENV,
    }


def driver_environment(request: LaunchRequest, source: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a driver started on this machine: the host half, then the job's."""
    return {**host_environment(source, storage_keys=not request.scoped_storage), **job_environment(request)}


def driver_command(request: LaunchRequest, *, python: str = "python", entrypoint: str = DRIVER_MODULE) -> list[str]:
    """The driver's argv: ``python -m workers.launch --job-id ID --api URL`` (or a script path
    ending in ``.py`` instead of the module). Never a secret: launchers log and show it. Where a
    launcher needs one string (Ray's entrypoint), it is ``shlex.join`` of this."""
    target = [entrypoint] if entrypoint.endswith(".py") else ["-m", entrypoint]
    return [python, *target, "--job-id", request.job_id, "--api", request.api_url]
