"""Does a job's ``model.init_from`` fit its model? Checked at submit, when the control plane can tell.

A fine-tuning job that names weights whose tensors do not match the model would otherwise
wait in the queue, start its workers, and fail in the engine with ``missing key ...``. So at
submit the control plane opens the source the way the workers will
(``workers.checkpointing.pretrained``: the index and each file's header, a few small ranged
reads, never the tensors) and compares names and shapes with the model's ``state_dict()``. The
answer is a 422 naming ``model.init_from`` with the engine's own message (the key, its shape).
Whether the user may read the URI at all is decided before, by the ``data.uri`` rules
(``service/api/spec_access.py``); nothing here reads a URI that check refused.

[Note: what is checked, and what is left to the workers]
* The model's shapes come from ``contract.presets`` (``GPTConfig.state_dict_shapes``, tested
  against the real model): no torch needed. A ``model.factory`` is never imported on the
  control plane (that would run user code here), so its weights are checked by the workers.
* What is read: a source inside the service's storage root (the control plane's own storage;
  absent there is a 422) or a ``file://`` path (absent may only mean "on the workers' machines,
  not here": accepted, the workers decide). Any other ``s3://`` URI is left to the workers: the
  control plane does not reach out to buckets and endpoints it was not configured for.
* Storage that does not answer (an outage, a hung endpoint) must not turn a submit into a
  user error nor hold the request: the check runs in a thread with ``CHECK_TIMEOUT_S`` and an
  error that is not about the weights themselves accepts the job unverified (logged).
"""

from __future__ import annotations

import concurrent.futures
import logging

from contract.presets import PRESETS
from contract.spec import JobSpec
from service.storage_policy import UnsafeUri, is_within

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 10.0
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="init-from-check")


class InitFromMismatch(ValueError):
    """The weights at ``model.init_from`` cannot initialize the model (message names the key)."""


def check_init_from(spec: JobSpec, storage_root: str, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Raise ``InitFromMismatch`` when ``spec.model.init_from`` is readable here and does not fit."""
    uri, preset = spec.model.init_from, spec.model.preset
    if uri is None or preset is None:
        return
    inside = _inside(uri, storage_root)
    if not (inside or uri.startswith("file://")):
        return
    try:
        from workers.checkpointing.pretrained import PretrainedWeights, WeightsNotFound
    except ImportError as missing:  # a control plane installed without the worker extra
        log.info("model.init_from not checked at submit: %s", missing)
        return
    expected = PRESETS[preset].state_dict_shapes()

    def fits() -> None:
        PretrainedWeights.open(uri).resolve(expected)

    try:
        _POOL.submit(fits).result(timeout=timeout_s)
    except WeightsNotFound as absent:
        if inside:
            raise InitFromMismatch(str(absent)) from None
        log.info("model.init_from %s not visible from the control plane; the workers will read it", uri)
    except ValueError as mismatch:  # malformed, or a missing/unexpected key, or a shape
        raise InitFromMismatch(str(mismatch)) from None
    except concurrent.futures.TimeoutError:
        log.warning("model.init_from %s: no answer from storage within %.0f s; not checked", uri, timeout_s)
    except Exception as error:  # noqa: BLE001 - storage trouble is not the user's mistake
        log.warning("model.init_from %s not checked at submit: %s: %s", uri, type(error).__name__, error)


def _inside(uri: str, storage_root: str) -> bool:
    try:
        return is_within(uri, storage_root)
    except UnsafeUri:
        return False
