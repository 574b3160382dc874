"""Team isolation. The hostile-tenant checks run again across teams: a
team's job is visible to its members and to nobody else (404 on every job route, never a 403
that would confirm the id), a viewer cannot submit, a member cannot cancel a teammate's job,
a maintainer can; membership is read on every request, so a removed member loses access at once."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import event

from service.client import ZerotrainError
from tests.helpers.service_specs import make_spec
from tests.service.test_auth import USER_JOB_ROUTES, call

READ_ROUTES = [(method, route) for method, route in USER_JOB_ROUTES if method == "GET"]


@pytest.fixture
def teams(make_live_service):
    """Team "red": maia (maintainer), mel (member), vic (viewer); team "blue": bo (member); and
    olga, in no team. Mel has a queued job in red, bo one in blue."""
    service = make_live_service(scheduler_enabled=False)
    admin = service.client()
    tokens = {name: service.create_user(name) for name in ("maia", "mel", "vic", "bo", "olga")}
    admin.create_team("red")
    admin.create_team("blue")
    admin.set_team_member("red", "maia", "maintainer")
    service.client(tokens["maia"]).set_team_member("red", "mel", "member")  # a maintainer manages members
    service.client(tokens["maia"]).set_team_member("red", "vic", "viewer")
    admin.set_team_member("blue", "bo", "member")
    red_job = service.client(tokens["mel"]).submit({**make_spec(), "team": "red"}).id
    blue_job = service.client(tokens["bo"]).submit({**make_spec(), "team": "blue"}).id
    return service, tokens, red_job, blue_job


def status(error: pytest.ExceptionInfo) -> int:
    return error.value.status


def test_a_teams_job_is_404_on_every_route_to_everyone_outside_it(teams):
    service, tokens, red_job, blue_job = teams
    for outsider in ("bo", "olga"):
        for method, route in USER_JOB_ROUTES:
            response = call(service, method, route, red_job, tokens[outsider])
            assert response.status_code == 404, (outsider, method, route, response.text)
            assert response.json()["detail"] == f"job {red_job!r} not found"
    assert [job.id for job in service.client(tokens["bo"]).list().items] == [blue_job]
    assert service.client(tokens["olga"]).list().items == []
    # nor can an outsider resume from it (its checkpoints are the team's)
    with pytest.raises(ZerotrainError) as refused:
        service.client(tokens["bo"]).submit({**make_spec(), "resume_from": {"job_id": red_job}})
    assert status(refused) == 422 and refused.value.errors[0]["field"] == "resume_from.job_id"
    # the team's members list is a 404 outside the team too
    for outsider in ("bo", "olga"):
        response = httpx.get(f"{service.url}/api/v1/teams/red/members", timeout=10,
                             headers={"Authorization": f"Bearer {tokens[outsider]}"})
        assert response.status_code == 404 and "not found" in response.json()["detail"]
    assert service.client(tokens["mel"]).get(red_job).state.value == "QUEUED"  # nothing above touched it


def test_every_member_reads_the_teams_jobs_whatever_their_role(teams):
    service, tokens, red_job, blue_job = teams
    for member in ("maia", "mel", "vic"):
        for method, route in READ_ROUTES:
            response = call(service, method, route.removesuffix("/stream"), red_job, tokens[member])
            assert response.status_code == 200, (member, method, route, response.text)
        assert [job.id for job in service.client(tokens[member]).list().items] == [red_job]
    assert service.client(tokens["vic"]).get(red_job).team == "red"


def test_a_viewer_cannot_submit_and_nobody_submits_to_a_team_they_are_not_in(teams):
    service, tokens, _, _ = teams
    with pytest.raises(ZerotrainError) as viewer:
        service.client(tokens["vic"]).submit({**make_spec(), "team": "red"})
    assert status(viewer) == 403 and "viewer" in str(viewer.value) and "member" in str(viewer.value)
    for team in ("red", "no-such-team"):  # the same answer whether or not the team exists
        with pytest.raises(ZerotrainError) as outsider:
            service.client(tokens["bo"]).submit({**make_spec(), "team": team})
        assert status(outsider) == 422 and outsider.value.errors[0]["field"] == "team"
        assert f"no team {team!r} that you are a member of" in outsider.value.errors[0]["message"]
    assert service.client(tokens["vic"]).list().items[0].owner == "mel"  # nothing of vic's was queued


def test_a_member_cannot_cancel_a_teammates_job_and_a_maintainer_can(teams):
    service, tokens, red_job, _ = teams
    maia_job = service.client(tokens["maia"]).submit({**make_spec(), "team": "red"}).id
    for member in ("mel", "vic"):
        with pytest.raises(ZerotrainError) as refused:
            service.client(tokens[member]).cancel(maia_job)
        assert status(refused) == 403 and "maintainer" in str(refused.value)
    assert service.client(tokens["maia"]).get(maia_job).state.value == "QUEUED"
    assert service.client(tokens["mel"]).cancel(red_job).state.value == "CANCELLED"  # a member cancels their own
    cancelled = service.client(tokens["maia"]).cancel(maia_job)
    assert cancelled.state.value == "CANCELLED"
    other = service.client(tokens["mel"]).submit({**make_spec(), "team": "red"}).id
    by_maintainer = service.client(tokens["maia"]).cancel(other)
    assert by_maintainer.state.value == "CANCELLED" and by_maintainer.message == "cancelled by maia"


def test_only_maintainers_manage_members_and_a_removed_member_loses_access_at_once(teams):
    service, tokens, red_job, _ = teams
    for member in ("mel", "vic"):
        with pytest.raises(ZerotrainError) as refused:
            service.client(tokens[member]).set_team_member("red", "olga", "maintainer")
        assert status(refused) == 403
    with pytest.raises(ZerotrainError) as not_admin:
        service.client(tokens["maia"]).create_team("green")
    assert status(not_admin) == 403
    assert {(m.user, m.role) for m in service.client(tokens["vic"]).team_members("red")} == {
        ("maia", "maintainer"), ("mel", "member"), ("vic", "viewer")}
    assert [(t.name, t.role) for t in service.client(tokens["vic"]).teams()] == [("red", "viewer")]
    service.client(tokens["maia"]).remove_team_member("red", "vic")
    with pytest.raises(ZerotrainError) as gone:
        service.client(tokens["vic"]).get(red_job)
    assert status(gone) == 404
    assert service.client(tokens["vic"]).teams() == []
    service.client(tokens["mel"]).remove_team_member("red", "mel")  # anyone may leave
    assert service.client(tokens["mel"]).get(red_job).owner == "mel"  # their own job stays theirs
    with pytest.raises(ZerotrainError) as duplicate:
        service.client().create_team("red")
    assert status(duplicate) == 409


def test_listing_ones_teams_reads_them_in_one_statement(teams):
    """``GET /teams`` answers an admin (every team) and a member (their own, with their role) from
    one query of the teams, so the names and the roles cannot come from two different moments."""
    service, tokens, _, _ = teams
    statements: list[str] = []

    def record(_conn, _cursor, statement, *_args):  # noqa: ANN001
        if "team" in statement.lower():
            statements.append(statement)

    event.listen(service.app.state.engine, "before_cursor_execute", record)
    try:
        for token, expected in ((None, [("blue", "maintainer"), ("red", "maintainer")]),
                                (tokens["mel"], [("red", "member")]), (tokens["olga"], [])):
            statements.clear()
            assert [(t.name, t.role) for t in service.client(token).teams()] == expected
            assert len(statements) == 1, statements
    finally:
        event.remove(service.app.state.engine, "before_cursor_execute", record)


TEAM_HOOK = "https://93.184.216.34/hook"  # a global address: no allow-list entry, no DNS


def test_only_a_teams_maintainers_manage_its_webhooks_and_outsiders_see_nothing(teams):
    service, tokens, _, _ = teams
    maia, mel, vic, olga = (service.client(tokens[name]) for name in ("maia", "mel", "vic", "olga"))
    secret = "s" * 16
    for member in (mel, vic):
        with pytest.raises(ZerotrainError) as refused:
            member.create_webhook(TEAM_HOOK, ["job.succeeded"], secret, team="red")
        assert status(refused) == 403 and "maintainer" in str(refused.value)
    for team in ("red", "no-such-team"):  # outside the team: missing, as its jobs are
        with pytest.raises(ZerotrainError) as outsider:
            olga.create_webhook(TEAM_HOOK, ["job.succeeded"], secret, team=team)
        assert status(outsider) == 404
    hook = maia.create_webhook(TEAM_HOOK, ["job.succeeded"], secret, team="red")
    assert (hook.team, hook.owner) == ("red", None)
    assert [h.id for h in maia.webhooks()] == [hook.id] and [h.id for h in service.client().webhooks()] == [hook.id]
    assert mel.webhooks() == vic.webhooks() == olga.webhooks() == []
    for member in (mel, vic):
        for act in (member.delete_webhook, member.webhook_deliveries):
            with pytest.raises(ZerotrainError) as refused:
                act(hook.id)
            assert status(refused) == 403
    for act in (olga.delete_webhook, olga.webhook_deliveries, service.client(tokens["bo"]).delete_webhook):
        with pytest.raises(ZerotrainError) as outsider:
            act(hook.id)
        assert status(outsider) == 404
    assert maia.webhook_deliveries(hook.id) == [] and maia.delete_webhook(hook.id).id == hook.id
