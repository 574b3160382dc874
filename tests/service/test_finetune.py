"""Fine-tuning through the service: ``model.init_from`` at submit, in the workers, and the round trip.

Must show 4 (issue 14): a job trains and is checkpointed; ``zerotrain ckpt consolidate`` turns
one of its checkpoints into a Hugging Face-style directory in its owner's area; a second job
submitted through the REST API with ``model.init_from`` pointing there starts from those
weights -- its first-step loss is the earlier job's last loss -- and trains. The jobs are real:
submitted to a live control plane on PostgreSQL, claimed by its scheduler, trained by
``workers.train.train_loop`` on a local two-rank Gloo world (``run_local``, no Ray: the runtime
is not what is shown here), their metrics and checkpoints read back through the API.

[Note: why the losses can be compared exactly]
The corpus is one file of exactly ``seq_len + 1`` bytes, so every sample of every batch is the
same window and every step sees the same batch B. The earlier job's last recorded loss is
loss(w_{N-1}, B), computed before its last update, from the weights its step-(N-1) checkpoint
holds; consolidating that checkpoint (fp32) and starting the fine-tune from it, the fine-tune's
first loss is loss(w_{N-1}, B) again, up to the summation order of another ZeRO stage.

The refusals are fast: a missing key, a wrong shape, an unexpected key, weights absent from the
user's own area, a file that is not safetensors, and another user's area are each a 422 naming
``model.init_from``, and no job is stored.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from sqlalchemy import func, select

from contract.presets import PRESETS
from service.cli import main as cli
from service.models import Job
from workers.checkpointing.pretrained import expected_tensors
from storage.stfile import INDEX_NAME
from workers.loop_config import LoopConfig
from workers.models import GPT
from workers.reporting import WorkerAPI
from workers.train import run_local, train_loop

PRESET = "gpt-nano"
SEQ = 32


def test_a_presets_shapes_on_the_control_plane_are_its_models_state_dict():
    """What the control plane checks an init_from against (no torch there) is the real model."""
    for name, cfg in {**PRESETS, "no-bias": dataclasses.replace(PRESETS[PRESET], bias=False)}.items():
        with torch.device("meta"):
            model = GPT(cfg)
        real = [(names, tuple(shape)) for names, shape in expected_tensors(model.state_dict(keep_vars=True),
                                                                             lambda t: t.shape)]
        assert cfg.state_dict_shapes() == real, name


# ----------------------------------------------------------------------------- refusals at submit


def write_weights(path: Path, drop: tuple[str, ...] = (), shapes: dict | None = None,
                  extra: tuple[str, ...] = ()) -> str:
    """A safetensors file for the preset (zeros), with keys dropped, reshaped or added."""
    tensors = {}
    for names, shape in PRESETS[PRESET].state_dict_shapes():
        for name in names:
            if name not in drop:
                tensors[name] = torch.zeros((shapes or {}).get(name, shape))
    tensors.update({name: torch.zeros(2) for name in extra})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return f"file://{path}"


def spec_from(init_from: str, preset: str = PRESET) -> dict:
    return {"name": "finetune", "model": {"preset": preset, "init_from": init_from},
            "data": {"kind": "synthetic", "seq_len": SEQ},
            "train": {"steps": 2, "global_batch_size": 2, "micro_batch_size": 1},
            "zero": {"stage": 1, "precision": "fp32"}, "resources": {"num_workers": 2}}


def post(service, token: str, spec: dict) -> httpx.Response:
    return httpx.post(f"{service.url}/api/v1/jobs", json=spec, headers={"Authorization": f"Bearer {token}"})


def assert_refused(response: httpx.Response, *words: str) -> str:
    assert response.status_code == 422, response.text
    errors = response.json()["errors"]
    assert [e["field"] for e in errors] == ["model.init_from"], errors
    message = errors[0]["message"]
    for word in words:
        assert word in message, message
    return message


def test_init_from_that_does_not_fit_or_is_not_the_users_is_refused_naming_the_field(make_live_service, tmp_path):
    storage = tmp_path / "storage"
    service = make_live_service(scheduler_enabled=False, storage_uri=f"file://{storage}")
    alice, bob = service.create_user("alice"), service.create_user("bob")
    mine = storage / "users" / "alice"

    good = write_weights(mine / "good.safetensors")
    assert post(service, alice, spec_from(good)).status_code == 201
    assert_refused(post(service, alice, spec_from(write_weights(mine / "no-qkv.safetensors",
                                                                drop=("blocks.0.attn.qkv.weight",)))),
                   "missing key 'blocks.0.attn.qkv.weight'")
    assert_refused(post(service, alice, spec_from(write_weights(mine / "wide.safetensors",
                                                                shapes={"wpe.weight": (128, 128)}))),
                   "'wpe.weight' has shape [128, 128]", "[256, 128]")
    assert_refused(post(service, alice, spec_from(write_weights(mine / "extra.safetensors", extra=("adapter.w",)))),
                   "unexpected key 'adapter.w'")
    # the same file for the wrong model: gpt-mini's shapes are not gpt-nano's
    assert_refused(post(service, alice, spec_from(good, preset="gpt-mini")), "shape")
    # absent from the user's own area (the control plane's own storage: it would know)
    assert_refused(post(service, alice, spec_from(f"file://{mine}/no-such-dir")), "neither a .safetensors file")
    (mine / "junk.safetensors").write_bytes(b"\xff" * 64)  # a header "length" of 2**64 - 1 bytes
    assert_refused(post(service, alice, spec_from(f"file://{mine}/junk.safetensors")), "not a safetensors file")

    # another user's area, even with weights that fit: the data.uri rules, before anything is read
    bobs = write_weights(storage / "users" / "bob" / "good.safetensors")
    message = assert_refused(post(service, alice, spec_from(bobs)), f"file://{mine}")
    assert "bob" not in message.replace(bobs, "")
    assert post(service, bob, spec_from(bobs)).status_code == 201
    assert post(service, service.admin_token, spec_from(bobs)).status_code == 201  # admins read anything

    # outside the storage root, absent may mean "only on the workers' machines": they decide
    assert post(service, alice, spec_from("file:///nonexistent/weights")).status_code == 201
    with service.app.state.sessionmaker() as session:
        assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 4


# ----------------------------------------------------------------------------- Must show 4

STEPS = 5


def job_spec(name: str, corpus: str, stage: int, lr: float, **model) -> dict:
    return {"name": name, "model": {"preset": PRESET, **model},
            "data": {"kind": "text", "uri": corpus, "seq_len": SEQ},
            "train": {"steps": STEPS, "global_batch_size": 4, "micro_batch_size": 2, "lr": lr,
                      "schedule": "constant", "seed": 0},
            "zero": {"stage": stage, "precision": "fp32", "bucket_mb": 0.25},
            "resources": {"num_workers": 2},
            "checkpoint": {"every_steps": 1, "keep_last": 2}}


def run_job(service, client, job_id: str, monkeypatch) -> list[float]:
    """Claim the queued job as the scheduler does, train it on two local ranks, report it
    finished as the driver would; its rank-0 losses by step, through the API."""
    tokens = dict(service.app.state.scheduler.claim())
    monkeypatch.setenv("ZEROTRAIN_INGEST_TOKEN", tokens[job_id])  # the spawned ranks inherit it
    stored = client.get(job_id).spec
    run_local(LoopConfig(spec=stored, job_id=job_id, api_url=service.url,
                          storage_uri=service.settings.storage_uri), 2)
    api = WorkerAPI(service.url, job_id, tokens[job_id])
    try:
        api.post_state("SUCCEEDED", message="training finished")
    finally:
        api.close()
    return [m.loss for m in sorted(client.metrics(job_id, rank=0), key=lambda m: m.step)]


def reference_losses(weights: Path, window: bytes, lr: float) -> list[float]:
    """Single-process PyTorch from the consolidated files: the job's AdamW (betas 0.9/0.95, no
    weight decay, clipping at 1.0) on its batch of four copies of the window."""
    state = {}
    for shard in sorted(weights.glob("model-*.safetensors")):
        state.update(load_file(shard))
    model = GPT(PRESETS[PRESET])
    model.load_state_dict(state, strict=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    tokens = torch.tensor(list(window))
    x, y = tokens[:-1].repeat(4, 1), tokens[1:].repeat(4, 1)
    losses = []
    for _ in range(STEPS):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_fine_tune_from_a_consolidated_checkpoint_of_an_earlier_job(make_live_service, tmp_path, monkeypatch):
    storage = tmp_path / "storage"
    service = make_live_service(scheduler_enabled=False, storage_uri=f"file://{storage}")
    client = service.client(service.create_user("alice"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    window = (b"def f(x):\n    return 2 * x + 1\n" * 2)[: SEQ + 1]
    (corpus / "one-window.txt").write_bytes(window)
    assert len(window) == SEQ + 1

    base = client.submit(job_spec("base", f"file://{corpus}", stage=2, lr=3e-3)).id
    base_losses = run_job(service, client, base, monkeypatch)
    assert len(base_losses) == STEPS and base_losses[-1] < base_losses[0] - 0.5

    # the checkpoint the last loss was computed from, as the API lists it; consolidated by the CLI
    checkpoint = {c.step: c.uri for c in client.checkpoints(base)}[STEPS - 1]
    weights = f"file://{storage}/users/alice/{PRESET}-base"
    assert cli(["ckpt", "consolidate", checkpoint, weights, "--max-shard-mb", "1"]) == 0
    out = Path(weights.removeprefix("file://"))
    index = json.loads((out / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) >= 3  # ~4 MB in 1 MB shards
    assert (index["metadata"]["job_id"], index["metadata"]["step"]) == (base, str(STEPS - 1))
    assert json.loads((out / "config.json").read_text()) == {"preset": PRESET,
                                                             **dataclasses.asdict(PRESETS[PRESET])}

    # a fine-tuning LR: a fresh AdamW's first steps (each element moved by about lr) at the base
    # job's 3e-3 throw a trained model off, in single-process PyTorch just the same
    lr = 1e-4
    tuned = client.submit(job_spec("tuned", f"file://{corpus}", stage=3, lr=lr, init_from=weights)).id
    tuned_losses = run_job(service, client, tuned, monkeypatch)
    assert tuned_losses[0] == pytest.approx(base_losses[-1], rel=1e-5)  # where the base job ended
    assert tuned_losses[0] < base_losses[0] - 0.5  # not a fresh start
    assert tuned_losses[-1] < tuned_losses[0] - 0.1  # and it trains
    assert tuned_losses == pytest.approx(reference_losses(out, window, lr), rel=1e-5)

    # a restarted attempt resumes from the job's own checkpoint (at any world size: one rank, in
    # this process) and does not read init_from again -- the weights are gone by now
    shutil.rmtree(out)
    rerun = train_loop(LoopConfig(spec=client.get(tuned).spec, job_id=tuned, api_url=None,
                                   storage_uri=service.settings.storage_uri))
    assert rerun["losses"] == []  # its last checkpoint is its final step: nothing left to train
