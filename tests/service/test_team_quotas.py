"""Team quotas through the API, the SDK and the real admitter, on PostgreSQL and on SQLite: admins
set them, members read them, a submit above the team's priority bound is a 422 naming
``priority``, a team at its quota waits with reason ``team_quota`` while other teams start, and a
team under its guaranteed share preempts another team's jobs of equal priority."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from service.cli import main
from service.client import ValidationFailed, ZerotrainError
from service.models import Job
from service.schemas import JobState
from service.states import transition
from tests.helpers.service_specs import FAKE_DRIVER, make_spec


def spec_for(team: str, workers: int = 1, priority: int = 0) -> dict:
    spec = make_spec(hang_s=0.2)
    spec["team"], spec["priority"] = team, priority
    spec["resources"] = {**spec["resources"], "num_workers": workers, "cpus_per_worker": 1}
    return spec


class Teams:
    """A 4-CPU service whose scheduler is driven by hand, with teams red (mel, a member) and blue;
    olga is in no team."""

    def __init__(self, make_live_service, database: dict):
        self.service = make_live_service(local_entrypoint=FAKE_DRIVER, local_capacity_cpus=4, max_user_priority=10,
                                         scheduler_enabled=False, **database)
        self.admin = self.service.client()
        for team in ("red", "blue"):
            self.admin.create_team(team)
        self.admin.set_team_member("red", "mel", "member")
        self.mel = self.service.client(self.service.create_user("mel"))
        self.olga = self.service.client(self.service.create_user("olga"))

    def claim(self) -> list[str]:
        return [job_id for job_id, _ in self.service.app.state.scheduler.claim()]

    def run(self, spec: dict) -> str:
        """Submit as the admin, admit and make it RUNNING as its driver would."""
        job_id = self.admin.submit(spec).id
        assert job_id in self.claim(), "the cluster should have had room for it"
        with self.service.app.state.sessionmaker() as session:
            transition(session, job_id, JobState.RUNNING, reason="test", attempt=1)
            session.commit()
        return job_id

    def asked(self) -> dict[str, str]:
        with self.service.app.state.sessionmaker() as session:
            return dict(session.execute(select(Job.id, Job.preempt_for).where(Job.preempt_for.is_not(None))).all())


@pytest.fixture(params=["postgresql", "sqlite"])
def teams(request, make_live_service, tmp_path) -> Teams:
    database = {} if request.param == "postgresql" else {"home": tmp_path / "home", "database_url": ""}
    teams = Teams(make_live_service, database)
    assert teams.service.database_url.startswith(request.param)
    return teams


def test_admins_set_a_quota_members_read_it_and_nobody_else_does(teams):
    quota = teams.admin.set_team_quota("red", gpus=2, cpus=3.5, running_jobs=4, max_priority=3, share=0.5)
    assert (quota.team, quota.gpus, quota.cpus, quota.running_jobs, quota.max_priority, quota.share) == \
        ("red", 2, 3.5, 4, 3, 0.5)
    assert teams.mel.team_quota("red") == quota
    assert (quota.used.gpus, quota.used.cpus, quota.used.running_jobs) == (0, 0, 0)
    with pytest.raises(ZerotrainError) as member:
        teams.mel.set_team_quota("red", gpus=100)
    assert member.value.status == 403 and "only admins" in str(member.value)
    for team in ("red", "no-such-team"):  # outside the team: missing, as a job is
        with pytest.raises(ZerotrainError) as outsider:
            teams.olga.team_quota(team)
        assert outsider.value.status == 404
    with pytest.raises(ZerotrainError) as missing:
        teams.admin.set_team_quota("no-such-team", gpus=1)
    assert missing.value.status == 404
    cleared = teams.admin.set_team_quota("red", cpus=4)  # a PUT replaces: what is left out is off
    assert (cleared.cpus, cleared.gpus, cleared.share, cleared.max_priority) == (4, None, None, None)
    assert teams.mel.team_quota("red").cpus == 4


@pytest.mark.parametrize("bounds, field", [({"share": 1.5}, "share"), ({"gpus": -1}, "gpus"),
                                           ({"running_jobs": 2.5}, "running_jobs"),
                                           ({"max_priority": 5000}, "max_priority"), ({"tpus": 1}, "tpus")])
def test_bad_bounds_are_a_422_naming_the_field(teams, bounds, field):
    with pytest.raises(ValidationFailed) as refused:
        teams.admin.set_team_quota("red", **bounds)
    assert refused.value.fields == [field]


def test_the_shares_sum_to_at_most_one(teams):
    teams.admin.set_team_quota("red", share=0.6)
    with pytest.raises(ValidationFailed) as refused:
        teams.admin.set_team_quota("blue", share=0.5)
    assert refused.value.fields == ["share"] and "sum to at most 1" in str(refused.value)
    assert teams.admin.set_team_quota("blue", share=0.4).share == 0.4
    assert teams.admin.set_team_quota("red", share=0.6, cpus=2).share == 0.6  # its own share is not counted twice


def test_a_submit_above_the_teams_priority_bound_is_a_422_naming_priority(teams):
    teams.admin.set_team_quota("red", max_priority=3, cpus=1)
    assert teams.mel.submit(spec_for("red", priority=3)).state is JobState.QUEUED
    with pytest.raises(ValidationFailed) as above:
        teams.mel.submit(spec_for("red", priority=4))
    assert above.value.fields == ["priority"] and "above 3, the highest team red's quota" in str(above.value)
    assert teams.mel.submit({**spec_for("red"), "team": None, "priority": 4}).state is JobState.QUEUED  # no team
    assert teams.admin.submit(spec_for("red", priority=9)).state is JobState.QUEUED  # admins: any
    with pytest.raises(ValidationFailed) as too_big:  # more than the team may ever hold: never starts
        teams.mel.submit(spec_for("red", workers=2))
    assert too_big.value.fields == ["resources.num_workers"] and "quota" in str(too_big.value)


def test_a_team_at_its_quota_waits_with_the_reason_and_other_teams_start(teams):
    teams.admin.set_team_quota("red", running_jobs=1)
    first = teams.mel.submit(spec_for("red")).id
    second = teams.mel.submit(spec_for("red")).id
    blue = teams.admin.submit(spec_for("blue")).id
    assert teams.claim() == [first, blue]  # red's second job does not stall blue's
    waiting = teams.mel.get(second)
    assert waiting.state is JobState.QUEUED and waiting.reason == "team_quota"
    assert waiting.message == "waiting: team red runs 1 jobs, its quota is 1 (zerotrain team quota red)"
    used = teams.mel.team_quota("red").used
    assert (used.running_jobs, used.cpus) == (1, 1)
    teams.admin.set_team_quota("red", running_jobs=2)  # raised: it starts on the next pass
    assert teams.claim() == [second]


def test_a_team_under_its_share_preempts_another_teams_jobs_of_equal_priority(teams):
    teams.admin.set_team_quota("blue", share=0.5)
    reds = [teams.run(spec_for("red")) for _ in range(4)]  # red, with no share, holds all 4 CPUs
    blue = teams.admin.submit(spec_for("blue", workers=2)).id
    assert teams.claim() == []
    assert teams.asked() == {reds[3]: blue, reds[2]: blue}  # the fewest; ties to the newest
    # a second blue job would take blue over its share: it waits in line and asks nobody
    teams.admin.submit(spec_for("blue", workers=2))
    assert teams.claim() == [] and len(teams.asked()) == 2


def test_the_cli_shows_a_quota_and_changes_only_the_bounds_named(make_live_service, capsys, monkeypatch):
    service = make_live_service(scheduler_enabled=False)
    monkeypatch.setenv("ZEROTRAIN_URL", service.url)
    monkeypatch.setenv("ZEROTRAIN_TOKEN", service.admin_token)
    service.client().create_team("red")

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["team", "quota", "red", *argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, out, _ = run("--gpus", "4", "--share", "0.5")
    rows = [[cell.strip() for cell in line.strip("│").split("│")] for line in out.splitlines() if line.startswith("│")]
    assert code == 0 and "team red" in out
    assert ["gpus", "4", "0"] in rows and ["share", "0.5", ""] in rows and ["cpus", "none", "0"] in rows
    code, out, _ = run("--running-jobs", "2", "-o", "json")
    quota = json.loads(out)
    assert (quota["gpus"], quota["share"], quota["running_jobs"], quota["cpus"]) == (4, 0.5, 2, None)
    code, out, _ = run("--gpus", "none", "-o", "json")
    assert json.loads(out)["gpus"] is None and json.loads(out)["running_jobs"] == 2
    code, _, err = run("--share", "2")
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1 and "share" in err
    assert service.client().team_quota("red").share == 0.5  # a refused change changes nothing
