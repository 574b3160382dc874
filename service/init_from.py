"""Does a job's ``model.init_from`` fit its model (and its ``model.hf`` build)? Checked at submit, when the control plane can tell.

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

[Note: a Hugging Face model (``model.hf``)]
``check_model_hf`` reads ``config.json`` under the same rules and time bound: no ``config.json``
in a directory the control plane sees, or a config transformers cannot build (an unknown
``model_type``, a bad value), is a 422 naming ``model.hf`` and the key; a ``data.seq_len`` (or
``eval.data.seq_len``) above the config's positions (``max_position_embeddings``, gpt2's
``n_positions``) is a 422 naming that field; ``model.init_from`` is checked against the model's
tensors (by arithmetic for the families ``contract.hf_config`` knows, else the model built on
meta). Without transformers here, only what arithmetic can tell is checked (logged).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging

from contract.hf_config import UnsupportedConfig, max_positions, state_dict_shapes
from contract.presets import PRESETS
from contract.spec import JobSpec
from service.storage_policy import UnsafeUri, is_within
from storage.storage import Storage

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 10.0
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="init-from-check")


class InitFromMismatch(ValueError):
    """The model or its weights cannot be what the spec says (message names the key); ``field`` is
    the spec field to name in the 422 (``model.init_from`` unless said otherwise)."""

    def __init__(self, message: str, field: str = "model.init_from"):
        super().__init__(message)
        self.field = field


def check_init_from(spec: JobSpec, storage_root: str, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Raise ``InitFromMismatch`` when ``spec.model.init_from`` is readable here and does not fit."""
    if spec.model.hf is not None:
        check_model_hf(spec, storage_root, timeout_s)
        return
    uri, preset = spec.model.init_from, spec.model.preset
    if uri is None or preset is None:
        return
    inside = _checkable_here("model.init_from", uri, storage_root)
    if inside is None:
        return
    from workers.checkpointing.pretrained import PretrainedWeights, WeightsNotFound

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


#: What the checks read with (the worker extra); a control plane installed without it checks nothing here.
_READERS = ("workers.checkpointing.hf_dir", "workers.checkpointing.pretrained")


def _checkable_here(field: str, uri: str, storage_root: str) -> bool | None:
    """None when the control plane leaves ``uri`` (the spec's ``field``) to the workers: outside
    the service's storage root and not a ``file://`` path, or no worker extra here to read it
    with. Otherwise whether it lies inside the storage root, where absent is the user's mistake."""
    inside = _inside(uri, storage_root)
    if not (inside or uri.startswith("file://")):
        return None
    try:
        for module in _READERS:
            importlib.import_module(module)
    except ImportError as missing:  # a control plane installed without the worker extra
        log.info("%s not checked at submit: %s", field, missing)
        return None
    return inside


def _inside(uri: str, storage_root: str) -> bool:
    try:
        return is_within(uri, storage_root)
    except UnsafeUri:
        return False


def check_model_hf(spec: JobSpec, storage_root: str, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Raise ``InitFromMismatch`` (field ``model.hf``, ``model.init_from`` or a ``seq_len``) when the
    HF model the spec names is readable here and cannot be built, or its weights do not fit it."""
    uri = spec.model.hf
    inside = _checkable_here("model.hf", uri, storage_root)
    if inside is None:
        return
    from workers.checkpointing.hf_dir import read_config
    from workers.checkpointing.pretrained import PretrainedWeights, WeightsNotFound

    def check() -> None:
        try:
            config = read_config(uri)
        except FileNotFoundError as absent:
            if inside or Storage.at(uri).exists(""):
                raise InitFromMismatch(str(absent), "model.hf") from None
            log.info("model.hf %s not visible from the control plane; the workers will read it", uri)
            return
        except ValueError as bad:
            raise InitFromMismatch(str(bad), "model.hf") from None
        for where, data in spec.data_blocks():
            context = max_positions(config)
            if data.seq_len is not None and context is not None and data.seq_len > context:
                key = "n_positions" if config.get("model_type") == "gpt2" else "max_position_embeddings"
                raise InitFromMismatch(f"{where}.seq_len ({data.seq_len}) exceeds the model's {key} ({context}) "
                                       f"in {uri}/config.json", f"{where}.seq_len")
        expected = _hf_tensors(uri, config)
        init_from = spec.model.init_from
        if expected is None or init_from is None or not (_inside(init_from, storage_root)
                                                         or init_from.startswith("file://")):
            return
        try:
            PretrainedWeights.open(init_from).resolve(expected)
        except WeightsNotFound as absent:
            if _inside(init_from, storage_root):
                raise InitFromMismatch(str(absent)) from None
        except ValueError as mismatch:
            raise InitFromMismatch(str(mismatch)) from None

    try:
        _POOL.submit(check).result(timeout=timeout_s)
    except InitFromMismatch:
        raise
    except concurrent.futures.TimeoutError:
        log.warning("model.hf %s: no answer within %.0f s; not checked", uri, timeout_s)
    except Exception as error:  # noqa: BLE001 - storage trouble is not the user's mistake
        log.warning("model.hf %s not checked at submit: %s: %s", uri, type(error).__name__, error)


def _hf_tensors(uri: str, config: dict) -> list | None:
    """The model's tensors as ``(names, shape)`` groups; ``InitFromMismatch`` (``model.hf``) when
    transformers cannot build it. None when they cannot be known here (no transformers, and a
    family the arithmetic does not know)."""
    try:
        from workers.hf_models import built_on_meta, hf_config
    except ImportError as missing:
        log.info("model.hf %s: transformers not importable here (%s); checked by arithmetic only", uri, missing)
        try:
            return state_dict_shapes(config)
        except UnsupportedConfig:
            return None
        except ValueError as bad:
            raise InitFromMismatch(f"{uri}/{bad}", "model.hf") from None
    try:
        model = built_on_meta(hf_config(config))
    except Exception as bad:  # noqa: BLE001 - whatever transformers refuses the config with
        raise InitFromMismatch(f"{uri}/config.json: transformers cannot build the model: "
                               f"{type(bad).__name__}: {bad}", "model.hf") from None
    from workers.checkpointing.pretrained import expected_tensors

    return expected_tensors(model.state_dict(keep_vars=True), lambda t: tuple(t.shape))
