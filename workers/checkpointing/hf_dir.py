"""A Hugging Face model directory (``model.hf``) read through ``Storage``: torch-free.

The control plane reads its ``config.json`` to plan and check a job, the workers fetch it (and
the tokenizer files) to build the model, and consolidation copies both beside the exported
weights so that ``from_pretrained`` loads the result.
"""

from __future__ import annotations

import json
import os
from typing import Any

from contract.hf_config import CONFIG_NAME, GENERATION_CONFIG_NAME, TOKENIZER_FILES

from storage.storage import Storage


def read_config(uri: str) -> dict[str, Any]:
    """``config.json`` of the HF directory at ``uri``; ``FileNotFoundError`` when it has none,
    ``ValueError`` when it is not a JSON object."""
    storage = Storage.at(uri)
    if not storage.exists(CONFIG_NAME):
        raise FileNotFoundError(f"{uri}: no {CONFIG_NAME}")
    try:
        config = json.loads(storage.read_bytes(CONFIG_NAME))
    except ValueError as exc:
        raise ValueError(f"{uri}/{CONFIG_NAME}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{uri}/{CONFIG_NAME}: not a JSON object")
    return config


def model_files(uri: str) -> dict[str, bytes]:
    """``config.json``, ``generation_config.json`` and every tokenizer file present at ``uri``, by
    name (small files)."""
    storage = Storage.at(uri)
    names = (CONFIG_NAME, GENERATION_CONFIG_NAME, *TOKENIZER_FILES)
    return {name: storage.read_bytes(name) for name in names if storage.exists(name)}


def fetch_dir(uri: str, dest: str) -> list[str]:
    """Copy ``model_files(uri)`` into the local directory ``dest``; the names copied."""
    files = model_files(uri)
    for name, data in files.items():
        with open(os.path.join(dest, name), "wb") as f:
            f.write(data)
    return list(files)
