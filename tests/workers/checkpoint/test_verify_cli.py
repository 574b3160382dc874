"""Must show 5 (verify finds a flipped byte) and the ``zerotrain ckpt`` commands, on file:// and S3.

One process, one tiny GPT (tied head, frozen position table, a buffer) trained a few steps
at stage 1 and saved; then the CLI as a user runs it, and the consolidated file compared with
``full_state_dict()`` bit for bit (fp32) and with torch's own rounding (bf16). Consolidated
to a directory, the output is Hugging Face's layout (size-bounded shards + index) and loads
into a model built on meta through the engine's ``init_weights``, as a fine-tuning job does.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from service.cli import main as cli
from workers.checkpoint import CheckpointManager, checkpoints_uri
from workers.checkpointing.consolidate import float32_to_bf16
from storage.manifest import shard_name
from storage.stfile import INDEX_NAME, shard_file_name
from storage.storage import Storage
from workers.data import ShardedBatchLoader, SyntheticDataset
from workers.zero import ZeroConfig, ZeroEngine

from .ranks import GLOBAL_BATCH, MICRO, SEQ, VOCAB, make_engine, tiny_gpt

JOB = "cli-job"


@pytest.fixture
def saved(storage_root):
    """A committed checkpoint at step 3 (and an uncommitted directory at step 9)."""
    torch.set_num_threads(1)
    engine = make_engine(1, seed=0)
    loader = ShardedBatchLoader(SyntheticDataset(VOCAB, SEQ), global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO)
    for _ in range(3):
        for x, y in loader.next_batch():
            engine.backward(engine(x, y))
        engine.step()
    uri = checkpoints_uri(storage_root, JOB)
    manager = CheckpointManager(uri, job_id=JOB)
    manager.save(3, engine, loader, wait=True)
    manager.close()
    with Storage.at(uri).open_write("step_00000009/" + shard_name(0, 1)) as f:
        f.write(b"half a shard")
    return uri, engine.full_state_dict()


def test_verify_detects_a_flipped_byte(saved, capsys):
    uri, _ = saved
    step = f"{uri}/step_00000003"
    assert cli(["ckpt", "verify", step]) == 0
    assert "OK" in capsys.readouterr().out
    checkpoint = Storage.at(step)
    name = shard_name(0, 1)
    data = bytearray(checkpoint.read_bytes(name))
    data[len(data) // 2] ^= 0x01
    checkpoint.fs.pipe_file(checkpoint.path(name), bytes(data))
    assert cli(["ckpt", "verify", step]) == 1
    out = capsys.readouterr().out
    assert f"{name}: sha256" in out and "BAD" in out


def test_list_shows_only_committed_checkpoints(saved, capsys):
    uri, _ = saved
    assert cli(["ckpt", "list", uri.rsplit("/checkpoints", 1)[0]]) == 0
    steps = [line.split("│")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert [s for s in steps if s] == ["3"]  # step 9 has no manifest
    assert cli(["ckpt", "list", uri, "-o", "json"]) == 0  # one JSON document, for scripts
    listed = json.loads(capsys.readouterr().out)["items"]
    assert [(c["step"], c["uri"], c["world_size"]) for c in listed] == [(3, f"{uri}/step_00000003", 1)]


def test_user_errors_are_one_line(saved, capsys, tmp_path):
    uri, _ = saved
    assert cli(["ckpt", "verify", f"{uri}/step_00000009"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "not a committed checkpoint" in err and "\n" not in err
    assert cli(["ckpt", "consolidate", f"file://{tmp_path}/nothing-here", str(tmp_path / "x.safetensors")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_consolidate_loads_strictly_and_matches(saved, tmp_path, dtype):
    uri, full = saved
    out = tmp_path / f"model-{dtype}.safetensors"
    assert cli(["ckpt", "consolidate", uri, str(out), "--dtype", dtype]) == 0
    weights = load_file(out)
    model = tiny_gpt(seed=99)
    model.load_state_dict(weights, strict=True)
    assert list(weights) == list(model.state_dict())  # every key, tied ones included
    assert torch.equal(weights["lm_head.weight"], weights["wte.weight"])
    for key, value in full.items():
        want = value.to(torch.bfloat16) if dtype == "bf16" and value.is_floating_point() else value
        assert weights[key].dtype == want.dtype and torch.equal(weights[key], want), key


def test_consolidate_to_a_hugging_face_directory(saved, tmp_path, capsys):
    uri, full = saved
    out = tmp_path / "hf"
    shard_mb = 0.004  # 4 kB: the ~2 kB matrices pair up, the 4 kB embedding has a shard of its own
    assert cli(["ckpt", "consolidate", f"{uri}/step_00000003", str(out), "--max-shard-mb", str(shard_mb)]) == 0
    index = json.loads((out / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 3 and files == [shard_file_name(i, n) for i in range(n)]
    assert f"in {n} files" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, INDEX_NAME])  # no config.json: the
    # fixture's manifest does not name its model (a job's does: tests/service/test_finetune.py)
    ours = {"job_id": JOB, "step": "3", "dtype": "fp32", "format": "pt"}
    assert index["metadata"] == {**ours, "source": f"{uri}/step_00000003",
                                 "total_size": sum(v.numel() * v.element_size() for v in full.values())}
    weights = {}
    for name in files:
        with safe_open(out / name, "pt") as shard:
            assert shard.metadata() == {**ours, "source": f"{uri}/step_00000003"}
        part = load_file(out / name)
        assert {k: name for k in part} == {k: f for k, f in index["weight_map"].items() if f == name}
        nbytes = [v.numel() * v.element_size() for v in part.values()]
        assert len(part) == 1 or sum(nbytes) <= shard_mb * 1e6
        weights.update(part)
    assert list(weights) == list(full)  # state_dict order, tied and frozen keys and the buffer included
    for key, value in full.items():
        assert torch.equal(weights[key], value), key

    with torch.device("meta"):
        model = tiny_gpt(seed=99)
    engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), ZeroConfig(stage=1, precision="bf16", bucket_mb=0.002),
                        init_weights=f"file://{out}")
    loaded = engine.full_state_dict()
    engine.close()
    assert list(loaded) == list(full)
    for key, value in full.items():
        assert torch.equal(loaded[key], value), key


def test_bf16_rounding_matches_torch():
    values = torch.tensor([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.4e38, -3.4e38, 1e-40, float("inf"),
                           float("-inf"), float("nan"), 0.1, -2.5e-5] + torch.randn(1000).tolist())
    ours = torch.from_numpy(float32_to_bf16(values.numpy()).view("int16")).view(torch.bfloat16)
    theirs = values.to(torch.bfloat16)
    assert torch.equal(ours.view(torch.int16)[~values.isnan()], theirs.view(torch.int16)[~values.isnan()])
    assert ours[values.isnan()].isnan().all()
