"""Must show 4: ``zerotrain ckpt consolidate`` of a gpt-small checkpoint in bounded memory.

Two Gloo ranks train gpt-small (124M parameters, fp32, ZeRO-2) one step and save: the
parameters and both AdamW moments are split across the two shards (~1.5 GB). The CLI then
runs in a child process under ``/usr/bin/time -v``; its peak RSS, minus what the same
interpreter needs just to import the CLI and the consolidation code, must stay below twice
the largest tensor (the 50304x768 token embedding, 154 MB). The output loads into a plain
``GPT`` with ``strict=True`` and equals ``full_state_dict()`` exactly. The numbers are printed
(``pytest -s``) and written to ``consolidate_gpt_small.json`` in the test's tmp directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from workers.checkpoint import CheckpointManager, checkpoints_uri
from storage.manifest import numel, read_manifest, resolve, total_size
from workers.models import GPT, preset_config
from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.testing import spawn_world

TIME = shutil.which("time") or "/usr/bin/time"
BASELINE = "import service.cli, service.cli.ckpt, workers.checkpointing.consolidate, numpy, fsspec"


def save_gpt_small(rank: int, world_size: int, root: str, reference: str) -> dict:
    torch.manual_seed(0)
    model = GPT(preset_config("gpt-small"))
    engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), ZeroConfig(stage=2, precision="fp32"))
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, 50304, (1, 16), generator=g)
    engine.backward(engine(idx, idx.roll(-1, 1)))
    engine.step()
    manager = CheckpointManager(checkpoints_uri(root, "small"), job_id="small")
    blocked_s = manager.save(1, engine)  # the host copy; the upload goes on in the background
    report = manager.wait()
    manager.close()
    full = engine.full_state_dict()
    if rank == 0:
        save_file(full, reference)
    return {"blocked_s": blocked_s, "shard_bytes": report.shard_bytes, "upload_s": report.upload_s}


def max_rss_kb(command: list[str]) -> tuple[int, subprocess.CompletedProcess]:
    done = subprocess.run([TIME, "-v", *command], capture_output=True, text=True, timeout=600)
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    assert match, done.stderr[-2000:]
    return int(match.group(1)), done


@pytest.mark.skipif(not os.path.exists(TIME), reason="needs /usr/bin/time")
def test_consolidate_gpt_small_in_bounded_memory(tmp_path):
    root, reference = f"file://{tmp_path}/storage", str(tmp_path / "reference.safetensors")
    saves = spawn_world(save_gpt_small, 2, args=(root, reference), timeout_s=600)

    checkpoint = resolve(checkpoints_uri(root, "small"))
    manifest = read_manifest(checkpoint)
    out = tmp_path / "gpt-small.safetensors"
    zerotrain = [sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())"]
    peak_kb, done = max_rss_kb([*zerotrain, "ckpt", "consolidate", checkpoint.uri, str(out)])
    assert done.returncode == 0, done.stdout + done.stderr
    baseline_kb, _ = max_rss_kb([sys.executable, "-c", BASELINE])

    largest = max(4 * numel(manifest["tensors"][section][name]["shape"])
                  for _, section, name in manifest["model_state_dict"])
    numbers = {
        "checkpoint_bytes": total_size(manifest), "output_bytes": out.stat().st_size,
        "largest_tensor_bytes": largest, "peak_rss_bytes": peak_kb * 1024,
        "interpreter_and_imports_rss_bytes": baseline_kb * 1024,
        "consolidation_rss_bytes": (peak_kb - baseline_kb) * 1024,
        "save_per_rank": saves,  # checkpoint_blocked_s, shard size and upload seconds of each rank
    }
    (tmp_path / "consolidate_gpt_small.json").write_text(json.dumps(numbers, indent=1))
    print("\nconsolidate gpt-small:", json.dumps(numbers))
    assert numbers["consolidation_rss_bytes"] < 2 * largest
    phi = sum(numel(entry["shape"]) for entry in manifest["tensors"]["params"].values())  # tied: once
    assert 12 * phi <= numbers["checkpoint_bytes"] < 12 * phi + (2 << 20)  # fp32 weights + 2 moments, once

    with torch.device("meta"):
        model = GPT(preset_config("gpt-small"))
    weights = load_file(out)
    model.load_state_dict(weights, strict=True, assign=True)
    with safe_open(reference, "pt") as ref:
        assert sorted(ref.keys()) == sorted(weights)
        for key in ref.keys():
            assert torch.equal(weights[key], ref.get_tensor(key)), key
