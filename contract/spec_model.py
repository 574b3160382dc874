"""The job spec's ``model`` block (docs/contracts.md, "Model")."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from contract.presets import PRESETS
from contract.spec_base import (MAX_URI_CHARS, BoundedJson, SpecModel, check_factory_path, check_model_dir_uri,
                                check_storage_uri)


class ModelSpec(SpecModel):
    """A built-in preset, a Hugging Face model directory (``hf``), or a user factory ``pkg.mod:fn``
    called with ``kwargs``: exactly one of the three.

    ``hf`` names a directory holding a Hugging Face ``config.json`` (and usually the tokenizer
    files): ``file://``, ``s3://``, or a plain absolute path the workers see (stored as
    ``file://``). The workers build the model with transformers' own code from that config.

    ``init_from`` (fine-tuning): a ``file://`` or ``s3://`` URI of safetensors weights -- one
    ``.safetensors`` file, or a directory with ``model.safetensors.index.json`` as Hugging Face
    and ``zerotrain ckpt consolidate`` write it -- whose names and shapes are the model's
    ``state_dict()``. The workers build the model on the meta device and every rank reads only
    the bytes it keeps; a job resuming from a checkpoint (its own, or ``resume_from``) loads
    that instead. The control plane refuses a URI the user may not read (the ``data.uri``
    rules) and, when it can read it, weights that do not fit a preset.
    """

    preset: str | None = None
    hf: str | None = Field(default=None, max_length=MAX_URI_CHARS)
    factory: str | None = None
    kwargs: BoundedJson = Field(default_factory=dict)
    init_from: str | None = Field(default=None, max_length=MAX_URI_CHARS)

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str | None) -> str | None:
        if value is not None and value not in PRESETS:
            raise PydanticCustomError(
                "unknown_preset",
                "unknown preset '{value}'; choose one of {known}",
                {"value": value, "known": ", ".join(PRESETS)},
            )
        return value

    @field_validator("factory")
    @classmethod
    def _factory(cls, value: str | None) -> str | None:
        return None if value is None else check_factory_path(value)

    @field_validator("init_from")
    @classmethod
    def _init_from(cls, value: str | None) -> str | None:
        return None if value is None else check_storage_uri(value)

    @field_validator("hf")
    @classmethod
    def _hf(cls, value: str | None) -> str | None:
        return None if value is None else check_model_dir_uri(value)

    @model_validator(mode="after")
    def _exactly_one(self) -> "ModelSpec":
        if sum(choice is not None for choice in (self.preset, self.hf, self.factory)) != 1:
            raise PydanticCustomError(
                "model_choice", "give exactly one of model.preset, model.hf or model.factory", {"field": "model"}
            )
        if self.factory is None and self.kwargs:
            raise PydanticCustomError(
                "model_kwargs", "model.kwargs applies to model.factory only", {"field": "model.kwargs"}
            )
        return self

    def architecture(self) -> dict[str, Any]:
        """What the model is, as a consolidated checkpoint's ``config.json`` says it: a preset's
        name and its ``GPTConfig`` fields, or the factory and its kwargs (not ``init_from``:
        where the weights came from is not what the model is)."""
        if self.preset is not None:
            return {"preset": self.preset, **dataclasses.asdict(PRESETS[self.preset])}
        if self.hf is not None:
            return {"hf": self.hf}
        return {"factory": self.factory, "kwargs": self.kwargs}
