"""Hugging Face causal LMs as job models (``model: {hf: URI}``), built with transformers' own code.

``model.hf`` names a directory holding an HF ``config.json`` (and usually the tokenizer files):
``file://`` is read in place, ``s3://`` is fetched into a local temporary directory first
(config and tokenizer files only; the weights, if any, are ``model.init_from``'s and are read
by range). The model is ``AutoModelForCausalLM.from_config`` with its parameters on the meta
device; the engine materializes it bucket by bucket, from ``model.init_from``'s safetensors
(HF names) or from ``init_weights_for`` (a random init, see the note). Nothing reaches a hub:
``HF_HUB_OFFLINE`` is set before transformers is imported.

[Note: parameters on meta, buffers real]
Rotary embeddings keep ``inv_freq`` as a non-persistent buffer computed in ``__init__``: a
weights file cannot hold it, so a model built wholly under ``torch.device("meta")`` could not
be loaded. ``params_on_meta`` puts only parameters on meta (what accelerate's
``init_empty_weights(include_buffers=False)`` does); buffers are computed for real, and small.

[Note: one seed, one model (HF)]
Without ``init_from`` every module is initialized by the model's own ``_init_weights`` (the
family's scheme: normal(0, initializer_range), norms to 1, ...) with the global RNG seeded by
(``train.seed``, the module's name) just before. So the values do not depend on the order the
engine materializes modules in, nor on the rank: one process building the model on meta and
initializing its modules in any order with ``init_weights_for`` gets the same bits.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
import threading
from typing import Any, Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from workers.checkpointing.hf_dir import fetch_dir, read_config  # noqa: E402


def hf_config(config: dict[str, Any]):
    """The transformers config object for a ``config.json`` dict (its ``model_type``'s class, no hub).
    ``ValueError`` naming the key: an unknown or missing ``model_type``, a value the class refuses."""
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"config.json: 'model_type' {model_type!r} is not a model type transformers knows")
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(config))
    except Exception as exc:  # noqa: BLE001 - transformers raises several kinds for a bad value
        raise ValueError(f"config.json: transformers cannot build a {model_type} config: {exc}") from None


_ORIGINAL_REGISTER = nn.Module.register_parameter
_PATCH_LOCK = threading.Lock()
_patch_users = 0
_local = threading.local()


def _register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    _ORIGINAL_REGISTER(module, name, param)
    if getattr(_local, "depth", 0) and param is not None and not param.is_meta:
        module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block, by this thread, is created on the meta device
    (buffers are not). ``nn.Module.register_parameter`` is patched while any thread is inside; other
    threads' modules are left as they are (the control plane plans in a thread pool)."""
    global _patch_users
    with _PATCH_LOCK:
        if _patch_users == 0:
            nn.Module.register_parameter = _register_on_meta
        _patch_users += 1
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        with _PATCH_LOCK:
            _patch_users -= 1
            if _patch_users == 0:
                nn.Module.register_parameter = _ORIGINAL_REGISTER


def built_on_meta(config) -> nn.Module:
    """The causal LM of a transformers config wholly on the meta device (shapes only: the control
    plane's check of a config and of the weights' names)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def build_hf_model(uri: str) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of ``uri``'s config.json, parameters on meta, training mode."""
    from transformers import AutoModelForCausalLM

    config = hf_config(read_config(uri))
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    return model


def init_weights_for(model: nn.Module, seed: int) -> Callable[[nn.Module], None]:
    """The engine's ``init_weights`` for an HF model without ``init_from`` (see the note)."""
    names = {id(m): n for n, m in model.named_modules()}
    init = model._init_weights

    def init_module(module: nn.Module) -> None:
        digest = hashlib.sha256(f"{seed}:{names.get(id(module), '')}".encode()).digest()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
            init(module)

    return init_module


@functools.lru_cache(maxsize=8)
def local_dir(uri: str) -> str:
    """A local directory with ``uri``'s config and tokenizer files (``uri`` itself when file://)."""
    if uri.startswith("file://"):
        return uri[len("file://"):]
    dest = tempfile.mkdtemp(prefix="zerotrain-hf-")
    fetch_dir(uri, dest)
    return dest
