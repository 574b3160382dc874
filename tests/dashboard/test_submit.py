"""Must-show 1 (the last part): a bad spec's 422 is shown next to the wrong field, and fixing
that field on the page submits the job."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.dashboard.conftest import SCREENSHOTS, sign_in

pytestmark = pytest.mark.browser

BAD_YAML = """\
name: bad-batch
model:
  preset: gpt-nano
data:
  kind: synthetic
  seq_len: 64
train:
  steps: 20
  global_batch_size: 10
  micro_batch_size: 4
zero:
  stage: 1
  stagee: 2
resources:
  num_workers: 2
"""


def field(page, dotted: str):
    return page.locator(f"#spec-fields [data-field='{dotted}']")


def test_422_is_shown_next_to_the_wrong_field(dashboard, page):
    sign_in(page, dashboard.url, dashboard.service.admin_token)
    page.get_by_role("button", name="Submit a job…").click()
    spec_text = page.get_by_label("Job spec (JSON or YAML)")

    spec_text.fill("name: [unclosed")
    page.get_by_role("button", name="Submit job").click()
    expect(page.locator("#spec-text-error")).to_contain_text("Not valid YAML")
    expect(spec_text).to_have_attribute("aria-invalid", "true")

    spec_text.fill(BAD_YAML)
    page.get_by_role("button", name="Submit job").click()
    typo = field(page, "zero.stagee")
    expect(typo.locator(".field-error")).to_contain_text("Extra inputs are not permitted")
    expect(typo.get_by_role("textbox")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#spec-errors")).to_contain_text("zero.stagee")
    expect(page.locator("#spec-fields .field-error")).to_have_count(1)  # only that field

    spec_text.fill(BAD_YAML.replace("  stagee: 2\n", ""))
    page.get_by_role("button", name="Submit job").click()
    batch = field(page, "train.global_batch_size")
    expect(batch.locator(".field-error")).to_contain_text("multiple of 8")
    expect(batch.locator(".field-error")).to_contain_text("(10)")
    expect(field(page, "train.micro_batch_size").locator(".field-error")).to_have_count(0)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("#submit-panel").screenshot(path=str(SCREENSHOTS / "spec-422.png"))

    batch.get_by_role("textbox").fill("16")  # fix it where the message is
    batch.get_by_role("textbox").press("Tab")
    expect(spec_text).to_have_value(BAD_YAML.replace("  stagee: 2\n", "").replace(": 10\n", ": 16\n"))
    page.get_by_role("button", name="Submit job").click()
    expect(page.get_by_role("heading", name="bad-batch", level=1)).to_be_visible()
    assert "/jobs/job-" in page.url
