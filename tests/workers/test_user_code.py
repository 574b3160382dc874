"""Errors of the job's own code end the run at once (issue 17): ``workers.user_code`` and the
Ray runtime's failure policy, checked on Ray Train's own error objects."""

from __future__ import annotations

import pickle

import torch.distributed as dist
from ray.train import WorkerGroupError
from ray.train.v2._internal.execution.failure_handling import FailureDecision

from contract.reasons import Reason
from workers.runtime.ray_train import FailFastPolicy, failure_reason, failure_summary, fail_fast_on_user_errors
from workers.user_code import MAX_MESSAGE_CHARS, UserCodeError, is_user_code_error, user_code


def users_factory():
    raise KeyError("n_embd")  # what a typo in a user's config looks like


def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as error:  # noqa: BLE001
        return error
    raise AssertionError("did not raise")


def _in_user_code():
    with user_code("building the model"):
        users_factory()


def test_an_error_in_user_code_names_what_failed_the_exception_and_the_users_frame():
    error = _raised(_in_user_code)
    assert isinstance(error, UserCodeError) and isinstance(error.__cause__, KeyError)
    message = error.args[0]
    assert message.startswith("building the model failed: KeyError: 'n_embd'")
    assert "in users_factory" in message and 'raise KeyError("n_embd")' in message
    assert len(message) <= MAX_MESSAGE_CHARS
    assert is_user_code_error(pickle.loads(pickle.dumps(error)))  # it crosses Ray's process boundary


def test_a_communication_error_is_not_the_users():
    def lost_peer():
        with user_code("the first training step"):
            raise dist.DistNetworkError("Connection closed by peer")

    error = _raised(lost_peer)
    assert type(error) is dist.DistNetworkError and not is_user_code_error(error)


def _lost(name: str) -> BaseException:
    return type(name, (RuntimeError,), {})("the actor died")


def _group_error(failures: dict) -> WorkerGroupError:
    return WorkerGroupError("Training failed", failures)


def test_the_policy_raises_on_user_errors_and_retries_lost_workers():
    policy = FailFastPolicy(__import__("ray.train", fromlist=["FailureConfig"]).FailureConfig(max_failures=2))
    user = _group_error({0: _raised(_in_user_code), 1: _raised(_in_user_code)})
    assert policy.make_decision(user) is FailureDecision.RAISE
    lost = _group_error({0: _raised(_in_user_code), 1: _lost("ActorDiedError")})  # a peer's loss, seen from rank 0
    assert policy.make_decision(lost) is FailureDecision.RETRY
    assert policy.make_decision(_group_error({1: _lost("ActorDiedError")})) is FailureDecision.RETRY


def test_the_job_message_is_the_users_error_in_a_few_lines():
    error = _group_error({0: _raised(_in_user_code)})
    assert failure_reason(error) == Reason.USER_CODE_ERROR
    summary = failure_summary(error)
    assert summary.startswith("building the model failed: KeyError: 'n_embd'") and len(summary) < 2000


def test_the_trainer_builds_our_policy():
    """The swap of Ray's (private) policy factory still reaches what fit() calls."""
    import ray.train.v2.api.data_parallel_trainer as trainer_module

    with fail_fast_on_user_errors():
        policy = trainer_module.create_failure_policy(__import__("ray.train", fromlist=["FailureConfig"]).FailureConfig())
    assert isinstance(policy, FailFastPolicy)
    assert trainer_module.create_failure_policy is not FailFastPolicy
    import inspect

    assert "create_failure_policy(self.run_config.failure_config)" in inspect.getsource(trainer_module)
