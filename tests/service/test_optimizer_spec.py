"""``train.optimizer``, its options, ``train.no_decay`` and ``train.schedule`` in the job spec."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from contract.spec import ADAM_BETAS, ADAM_EPS, JobSpec

from tests.helpers.service_specs import VALID_SPEC


def spec_with(**train) -> dict:
    spec = copy.deepcopy(VALID_SPEC)
    spec["train"].update(train)
    return spec


def refusal(**train) -> tuple[str, str]:
    """(the field the 422 would name, its message) of a spec refused for these train fields."""
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(spec_with(**train))
    error = info.value.errors()[0]
    field = (error.get("ctx") or {}).get("field") or ".".join(str(p) for p in error["loc"])
    return field, error["msg"]


def test_an_old_spec_keeps_todays_optimizer_and_schedule():
    train = JobSpec.model_validate(VALID_SPEC).train
    assert (train.optimizer, train.schedule, train.no_decay, train.no_decay_1d) == ("adamw", "cosine", [], True)
    assert train.optimizer_options() == {"betas": ADAM_BETAS, "eps": ADAM_EPS} == {"betas": (0.9, 0.95), "eps": 1e-8}


@pytest.mark.parametrize("fields, options", [
    ({"optimizer": "adam", "betas": [0.8, 0.99], "eps": 1e-6}, {"betas": (0.8, 0.99), "eps": 1e-6}),
    ({"optimizer": "adamw", "betas": [0, 0.5]}, {"betas": (0.0, 0.5), "eps": 1e-8}),
    ({"optimizer": "sgd"}, {"momentum": 0.0, "nesterov": False}),
    ({"optimizer": "sgd", "momentum": 0.9, "nesterov": True}, {"momentum": 0.9, "nesterov": True}),
])
def test_valid_optimizers_and_their_options_round_trip(fields, options):
    spec = JobSpec.model_validate(spec_with(**fields, no_decay=["wte.*", "*.norm.*"], no_decay_1d=False,
                                            schedule="linear"))
    assert spec.train.optimizer_options() == options
    assert (spec.train.no_decay, spec.train.no_decay_1d, spec.train.schedule) == (["wte.*", "*.norm.*"], False,
                                                                                   "linear")
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec  # what workers re-validate
    assert JobSpec.model_validate(spec.model_dump()) == spec


@pytest.mark.parametrize("fields, field, message", [
    ({"optimizer": "muon"}, "train.optimizer", "orthogonalizes"),
    ({"optimizer": "Adafactor"}, "train.optimizer", "row and column"),
    ({"optimizer": "lion"}, "train.optimizer", "choose one of adamw, adam, sgd"),
    ({"optimizer": 3}, "train.optimizer", "string"),
    ({"betas": [0.9, 1.0]}, "train.betas", "[0, 1)"),
    ({"betas": [0.9]}, "train.betas", "at least 2"),
    ({"betas": [0.9, 0.95], "optimizer": "sgd"}, "train.betas", "applies to adam and adamw"),
    ({"eps": 0}, "train.eps", "greater than 0"),
    ({"eps": 1e-8, "optimizer": "sgd"}, "train.eps", "applies to adam and adamw"),
    ({"momentum": 0.9}, "train.momentum", "applies to sgd"),
    ({"momentum": 1.0, "optimizer": "sgd"}, "train.momentum", "less than 1"),
    ({"nesterov": True, "optimizer": "sgd"}, "train.nesterov", "momentum > 0"),
    ({"nesterov": True}, "train.nesterov", "applies to sgd"),
    ({"no_decay": [""]}, "train.no_decay", "1 to 256 characters"),
    ({"no_decay": "*.bias"}, "train.no_decay", "list"),
    ({"no_decay_1d": "yes"}, "train.no_decay_1d", "boolean"),
    ({"schedule": "step"}, "train.schedule", "'cosine', 'linear' or 'constant'"),
])
def test_bad_values_name_the_field(fields, field, message):
    named, msg = refusal(**fields)
    assert named == field and message in msg, (named, msg)
