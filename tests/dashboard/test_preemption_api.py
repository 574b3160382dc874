"""``GET /api/v1/dashboard/preemption`` on the embedded SQLite database (the browser tests run
on PostgreSQL): what a queued job makes room for, when a job was preempted and for whom, and
nothing at all for a caller who may see neither job."""

from __future__ import annotations

import httpx

from service.schemas import JobState
from service.states import transition
from tests.dashboard.conftest import spec
from tests.helpers.service_specs import FAKE_DRIVER


def test_the_answer_names_the_jobs_asked_and_the_job_made_room_for_on_sqlite(make_live_service, tmp_path):
    service = make_live_service(home=tmp_path / "home", database_url="", local_entrypoint=FAKE_DRIVER,
                                local_capacity_cpus=4, scheduler_enabled=False)
    assert service.database_url.startswith("sqlite:")
    admin, alice = service.client(), service.create_user("alice")
    low = admin.submit(spec("low", resources__num_workers=4)).id
    started = dict(service.app.state.scheduler.claim())
    with service.app.state.sessionmaker() as session:
        transition(session, low, JobState.RUNNING, reason="test", attempt=1)
        session.commit()
    high = admin.submit(spec("high", priority=5, resources__num_workers=2)).id
    assert service.app.state.scheduler.claim() == []

    def answer(token: str, *job_ids: str) -> httpx.Response:
        return httpx.get(f"{service.url}/api/v1/dashboard/preemption", params={"job_id": list(job_ids)},
                         headers={"Authorization": f"Bearer {token}"})

    items = answer(service.admin_token, high, low).raise_for_status().json()["items"]
    assert list(items) == [high]
    assert items[high]["asked"] == [{"id": low, "name": "low", "priority": 0, "team": None, "state": "RUNNING"}]
    assert items[high]["asked_hidden"] == 0 and items[high]["preempted"] == []
    with httpx.Client(base_url=f"{service.url}/api/v1/jobs/{low}/worker",
                      headers={"Authorization": f"Bearer {started[low]}"}) as worker:
        worker.post("/preempted", json={"step": 3}).raise_for_status()
    items = answer(service.admin_token, high, low).raise_for_status().json()["items"]
    assert list(items) == [low]  # the high job makes room no more: nothing is asked for it
    [preempted] = items[low]["preempted"]
    assert preempted["for_job"]["id"] == high and preempted["at"]
    assert answer(alice, high, low).json() == {"items": {}}  # neither is hers
    bad = answer(alice, "no such id!")
    assert bad.status_code == 422 and "job_id" in bad.text


def test_more_job_ids_than_a_page_is_a_422_naming_job_id(make_live_service, tmp_path):
    """The dashboard's per-page calls take at most a page of ids: more is refused, not cut short."""
    from service.dashboard.api import PAGE_JOBS

    service = make_live_service(home=tmp_path / "home", database_url="", scheduler_enabled=False)
    ids = [f"job-{n}" for n in range(PAGE_JOBS + 1)]
    for route in ("preemption", "progress"):
        answer = httpx.get(f"{service.url}/api/v1/dashboard/{route}", params={"job_id": ids},
                           headers={"Authorization": f"Bearer {service.admin_token}"})
        assert answer.status_code == 422 and "job_id" in answer.text, (route, answer.text)
        fits = httpx.get(f"{service.url}/api/v1/dashboard/{route}", params={"job_id": ids[:PAGE_JOBS]},
                         headers={"Authorization": f"Bearer {service.admin_token}"})
        assert fits.status_code == 200 and fits.json()["items"] == {}, (route, fits.text)
