"""Evaluation and user-reported metrics (issue 17, Must show 2).

A real job with an ``eval`` block -- submitted to a live control plane on PostgreSQL, claimed by
its scheduler, trained by ``workers.train.train_loop`` on a local two-rank Gloo world
(``run_local``, no Ray) -- has ``eval_loss`` at every ``every_steps`` and after the last step,
the same on every rank and absent elsewhere; the scalars its model factory reports
(tests/service/reporting_model.py) come back through the metrics API, per record and
downsampled, evaluation's as ``eval/<name>``. ``evaluate`` itself is checked against
single-process PyTorch at ZeRO-3 on two ranks, and the ingest's bounds on user metrics are
checked at the API.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from contract.metrics import MAX_USER_METRICS
from contract.spec import JobSpec
from workers.data import ShardedBatchLoader, SyntheticDataset, build_dataset
from workers.reporting import WorkerAPI
from workers.loop_config import LoopConfig
from workers.evaluation import evaluate
from workers.train import build_engine, run_local
from workers.world import World
from workers.user_metrics import Collector
from workers.zero.testing import spawn_world

from tests.service.reporting_model import build

STEPS, EVERY = 5, 2
VOCAB, SEQ, MICRO = 32, 16, 2


def job_spec(**changes) -> dict:
    spec = {"name": "evaluated", "model": {"factory": "tests.service.reporting_model:build",
                                           "kwargs": {"vocab_size": VOCAB}},
            "data": {"kind": "synthetic", "vocab_size": VOCAB, "seq_len": SEQ},
            "train": {"steps": STEPS, "global_batch_size": 4, "micro_batch_size": MICRO, "lr": 1e-2, "seed": 0},
            "zero": {"stage": 2, "precision": "fp32"}, "resources": {"num_workers": 2},
            "eval": {"every_steps": EVERY, "batches": 3,
                     "data": {"kind": "synthetic", "vocab_size": VOCAB, "seq_len": SEQ}}}
    spec.update(changes)
    return spec


def test_a_job_with_an_eval_block_reports_eval_loss_and_the_users_scalars(make_live_service, monkeypatch, capfd):
    service = make_live_service(scheduler_enabled=False)
    alice = service.create_user("alice")
    client = service.client(alice)
    job_id = client.submit(job_spec()).id
    tokens = dict(service.app.state.scheduler.claim())
    monkeypatch.setenv("ZEROTRAIN_INGEST_TOKEN", tokens[job_id])  # the spawned ranks inherit it
    run_local(LoopConfig(spec=client.get(job_id).spec, job_id=job_id, api_url=service.url), 2)
    api = WorkerAPI(service.url, job_id, tokens[job_id])
    try:
        api.post_state("SUCCEEDED", message="training finished")
    finally:
        api.close()
    out = capfd.readouterr()

    records = client.metrics(job_id)
    assert sorted((m.step, m.rank) for m in records) == [(s, r) for s in range(1, STEPS + 1) for r in (0, 1)]
    evaluated = {2, 4, 5}  # every 2 steps, and the last one
    for m in records:
        assert (m.eval_loss is not None) == (m.step in evaluated), m
    by_step = {}
    for m in records:
        if m.eval_loss is not None:  # one all_reduce: every rank holds the mean over ranks
            by_step.setdefault(m.step, set()).add(m.eval_loss)
    assert all(len(values) == 1 for values in by_step.values()), by_step
    eval_losses = [next(iter(by_step[s])) for s in sorted(by_step)]
    assert all(0 < loss < 2 * math.log(VOCAB) for loss in eval_losses)
    assert eval_losses[-1] < eval_losses[0]  # the model learns, and the eval sees the same batches
    assert "eval loss" in out.out  # rank 0's progress line on evaluated steps

    # the model's reports: per record, the step's mean; evaluation's under eval/
    for m in records:
        names = set(m.user or {})
        expected = {"accuracy", "constant"} | ({"parameters"} if m.step == 1 else set()) \
            | ({"eval/accuracy"} if m.step in evaluated else set())
        assert names == expected, (m.step, m.rank, m.user)
        assert 0 <= m.user["accuracy"] <= 1 and m.user["constant"] == 0.5
    params = sum(p.numel() for p in build(VOCAB).parameters())
    assert {m.user["parameters"] for m in records if m.step == 1} == {params}
    assert "user metric 'not a number' dropped" in out.err  # one warning, and the job went on

    # downsampled: a mean per rank and bucket of steps, the user's scalars included
    points = client.metrics(job_id, rank=0, max_points=1)
    assert len(points) == 1 and points[0].user["constant"] == pytest.approx(0.5)
    assert points[0].eval_loss == pytest.approx(sum(eval_losses) / len(eval_losses))

    # the job page's answer: eval_loss on the loss chart, the user's names in order of arrival
    chart = httpx.get(f"{service.url}/api/v1/jobs/{job_id}/metrics/chart",
                      headers={"Authorization": f"Bearer {alice}"}).json()
    loss_chart = next(c for c in chart["charts"] if c["id"] == "loss")
    assert [(s["key"], s["sparse"]) for s in loss_chart["series"]] == [("loss", False), ("eval_loss", True)]
    drawn = chart["series"]["eval_loss"]  # null on the steps without an evaluation
    assert [v is None for v in drawn] == [True, False, True, False, False]
    assert [v for v in drawn if v is not None] == pytest.approx(eval_losses, rel=1e-6)
    user = chart["user_metrics"]
    assert set(user["names"]) == {"accuracy", "constant", "parameters", "eval/accuracy"}
    constant = user["values"][user["names"].index("constant")]
    assert constant == [0.5] * STEPS


# ----------------------------------------------------------------------------- evaluate() itself


def _evaluate_on_rank(rank: int, world_size: int) -> dict:
    spec = JobSpec.model_validate(job_spec(zero={"stage": 3, "precision": "fp32", "bucket_mb": 0.001}))
    world = World.current(use_gpu=False)
    torch.manual_seed(0)
    engine = build_engine(spec, build(VOCAB), world.device)
    dataset = build_dataset(spec.eval.data, seed=0)
    counted = engine.comm.counter.snapshot()
    first = evaluate(engine, dataset, batches=3, micro_batch_size=MICRO, world=world)
    again = evaluate(engine, dataset, batches=3, micro_batch_size=MICRO, world=world)
    training = engine.module.training
    uncounted = engine.comm.counter.snapshot() == counted
    engine.close()
    return {"first": first, "again": again, "training": training, "uncounted": uncounted}


def test_evaluate_is_the_mean_loss_of_single_process_pytorch_over_every_ranks_batches():
    """Stage 3 on two ranks: each evaluates its own slice of the same samples; the mean over
    ranks is plain PyTorch's mean over all of them, with dropout off; nothing is counted as a
    step's communication and the model is back in training mode."""
    ranks = spawn_world(_evaluate_on_rank, world_size=2)
    torch.manual_seed(0)
    model = build(VOCAB).eval()
    dataset = SyntheticDataset(VOCAB, SEQ, seed=0)
    losses = []
    with torch.no_grad():
        for rank in range(2):
            loader = ShardedBatchLoader(dataset, global_batch_size=3 * MICRO * 2, micro_batch_size=MICRO,
                                        rank=rank, world_size=2)
            losses += [float(model(x, y)) for x, y in loader.next_batch()]
    reference = sum(losses) / len(losses)
    for result in ranks:
        assert result["first"] == pytest.approx(reference, rel=1e-6)
        assert result["again"] == result["first"]  # the same batches every time
        assert result["training"] is True
        assert result["uncounted"]  # a step's comm_bytes stays what training moved


# ----------------------------------------------------------------------------- bounds


def test_the_collector_drops_what_breaks_a_rule_and_warns_once_per_name(caplog):
    collector = Collector(max_names=2)
    for _ in range(3):
        collector.report({"a": 1.0, "": 2.0, "b\n": 3.0, "nan": float("nan"), "text": "0.9", "flag": True,
                          "big": 10 ** 400, "x" * 65: 1.0, "vector": torch.ones(2)})
        collector.report({"b": torch.tensor(4.0), "c": 5.0})
    assert collector.take() == {"a": 1.0, "b": 4.0}  # "c" is past the bound of 2 names
    assert collector.take() == {}
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 9 and len(set(dropped)) == 9, dropped  # each name once, not once a step
    with collector.evaluating():
        collector.report({"a": 2.0})
    assert collector.take() == {}  # "eval/a" would be a third name


def test_the_control_plane_refuses_bad_user_metrics_and_keeps_a_jobs_first_names(make_live_service):
    service = make_live_service(scheduler_enabled=False)
    client = service.client(service.create_user("alice"))
    job_id = client.submit(job_spec()).id
    (_, ingest), = service.app.state.scheduler.claim()

    def post(records: list[dict]) -> httpx.Response:
        return httpx.post(f"{service.url}/api/v1/jobs/{job_id}/metrics", json={"records": records},
                          headers={"Authorization": f"Bearer {ingest}"})

    for user, field in (({"a\x00": 1.0}, "records.0.user"), ({"x" * 65: 1.0}, "records.0.user"),
                        ({"a": "high"}, "records.0.user.a"),
                        ({f"n{i}": 1.0 for i in range(MAX_USER_METRICS + 1)}, "records.0.user")):
        response = post([{"attempt": 0, "rank": 0, "step": 1, "user": user}])
        assert response.status_code == 422, response.text
        assert response.json()["errors"][0]["field"].startswith(field), response.json()
    response = httpx.post(f"{service.url}/api/v1/jobs/{job_id}/metrics", headers={
        "Authorization": f"Bearer {ingest}", "content-type": "application/json"},
        content=b'{"records": [{"attempt": 0, "rank": 0, "step": 1, "user": {"a": NaN}}]}')
    assert response.status_code == 422
    assert client.metrics(job_id) == []

    # two ranks, each with a full set of its own names: the job keeps the first MAX_USER_METRICS
    first = {f"r0-{i:02d}": float(i) for i in range(MAX_USER_METRICS)}
    second = {f"r1-{i:02d}": float(i) for i in range(MAX_USER_METRICS)}
    assert post([{"attempt": 0, "rank": 0, "step": 1, "user": first}]).json()["accepted"] == 1
    assert post([{"attempt": 0, "rank": 1, "step": 1, "user": {**second}},
                 {"attempt": 0, "rank": 0, "step": 2, "user": {"r0-00": 7.0}}]).json()["accepted"] == 2
    again = post([{"attempt": 0, "rank": 0, "step": 2, "user": {"r0-00": 8.0}}]).json()  # re-sent: ignored
    assert again == {"accepted": 0, "duplicates": 1}
    stored = {(m.rank, m.step): m.user for m in client.metrics(job_id)}
    assert stored == {(0, 1): first, (1, 1): None, (0, 2): {"r0-00": 7.0}}
