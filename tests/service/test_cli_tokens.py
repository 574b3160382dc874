"""``zerotrain token list|revoke`` and ``token create --expires-days`` against a live server."""

from __future__ import annotations

import pytest

from service.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def as_user(make_live_service, monkeypatch):
    service = make_live_service(scheduler_enabled=False)
    monkeypatch.setenv("ZEROTRAIN_URL", service.url)

    def use(token: str) -> None:
        monkeypatch.setenv("ZEROTRAIN_TOKEN", token)

    return service, use


def test_a_user_lists_and_revokes_their_token_from_the_cli(as_user, capsys):
    service, use = as_user
    alice = service.client().create_token("alice")
    use(alice.token)
    code, stdout, _ = run(capsys, "token", "list")
    assert code == 0 and "alice" in stdout and str(alice.id) in stdout and "admin" not in stdout.split("\n", 3)[-1]
    code, stdout, _ = run(capsys, "token", "revoke", str(alice.id))
    assert code == 0 and f"token {alice.id} of alice revoked" in stdout
    code, _, stderr = run(capsys, "token", "list")
    assert code == 2 and "invalid or revoked API token" in stderr and "Traceback" not in stderr


def test_revoking_someone_elses_token_is_one_line_not_found(as_user, capsys):
    service, use = as_user
    bob = service.client().create_token("bob")
    use(service.client().create_token("alice").token)
    code, _, stderr = run(capsys, "token", "revoke", str(bob.id))
    assert code == 2 and f"token {bob.id} not found" in stderr and len(stderr.strip().splitlines()) == 1


def test_token_create_refuses_a_bad_expiry_with_one_line(capsys):
    code, _, stderr = run(capsys, "token", "create", "dave", "--expires-days", "0")
    assert code == 2 and "--expires-days must be in (0, 3650]" in stderr


def test_token_create_refuses_a_name_that_is_not_a_slug_with_one_line(capsys):
    code, _, stderr = run(capsys, "token", "create", "team:red")  # it could pass for team red's webhooks' owner
    assert code == 2 and "NAME must be letters" in stderr and len(stderr.strip().splitlines()) == 1
