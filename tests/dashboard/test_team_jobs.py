"""Issue 34 in Chromium: the job list shows each job's team; a team's job is listed for every
member of the team and for nobody outside it."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import spec, with_token

pytestmark = pytest.mark.browser


def test_the_list_shows_a_teams_job_to_its_viewer_with_its_team_and_hides_it_from_outsiders(dashboard, page):
    service = dashboard.service
    alice, carol, bob = (service.create_user(name) for name in ("alice", "carol", "bob"))
    admin = service.client()
    admin.create_team("red")
    admin.set_team_member("red", "alice", "viewer")
    admin.set_team_member("red", "carol", "member")
    team_job = dashboard.submit(spec("carols-team-run", team="red"), token=carol)
    own_job = dashboard.submit(spec("alices-run"), token=alice)
    dashboard.submit(spec("bobs-run"), token=bob)

    with_token(page, alice)
    page.goto(dashboard.url)
    rows = page.locator("#jobs-table tbody tr[data-job-id]")
    expect(rows).to_have_count(2)  # her own and her team's; not bob's
    expect(page.locator(f"tr[data-job-id='{team_job.job_id}'] td.team")).to_have_text("red")
    expect(page.locator(f"tr[data-job-id='{own_job.job_id}'] td.team")).to_have_text("–")

    with_token(page, bob)
    page.goto(dashboard.url)
    expect(page.locator("#jobs-table tbody tr[data-job-id]")).to_have_count(1)
    expect(page.locator(f"tr[data-job-id='{team_job.job_id}']")).to_have_count(0)
