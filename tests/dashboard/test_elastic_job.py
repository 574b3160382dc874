"""An elastic, hybrid-sharded job as the dashboard shows it: the range of worker counts it may run
at (the job page and the jobs list) and how it shards, in words."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import spec, with_token

pytestmark = pytest.mark.browser


def test_an_elastic_jobs_pages_show_its_worker_range_and_hybrid_sharding(dashboard, page):
    job = dashboard.submit(spec("elastic", resources__num_workers=2, resources__min_workers=1))
    hybrid = dashboard.submit(spec("hybrid", resources__num_workers=4, zero__shard_group_size=2))
    with_token(page, dashboard.service.admin_token)
    page.goto(f"{dashboard.url}/jobs/{job.job_id}")
    expect(page.locator(".job-page")).to_have_attribute("data-rendered", "true")
    meta = page.locator("dl.meta")
    expect(meta.locator("dt", has_text="Workers").locator("xpath=following-sibling::dd[1]")).to_have_text(
        "1–2 × (1 CPU, 0 GPU), elastic")
    expect(meta.locator("dt", has_text="Sharding")).to_have_count(0)  # not hybrid: nothing to say

    page.goto(f"{dashboard.url}/jobs/{hybrid.job_id}")
    expect(page.locator(".job-page")).to_have_attribute("data-rendered", "true")
    expect(meta.locator("dt", has_text="Sharding").locator("xpath=following-sibling::dd[1]")).to_have_text(
        "hybrid: shards within groups of 2 ranks, replicated across groups")
    expect(meta.locator("dt", has_text="Workers").locator("xpath=following-sibling::dd[1]")).to_have_text(
        "4 × (1 CPU, 0 GPU)")

    page.goto(f"{dashboard.url}/")
    expect(page.locator("tr", has=page.locator("a", has_text="elastic")).locator("td", has_text="1–2")).to_have_count(1)
