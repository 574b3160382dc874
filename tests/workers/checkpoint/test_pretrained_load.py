"""Issue 14, must-show 2: pretrained weights in a Hugging Face-style directory (index + 2
shards, the tied head stored once) on a real S3 server on loopback, loaded by 4 ranks built on
meta. Each rank reads only the bytes of the elements it keeps: at most its share of the model
plus one tensor's worth (a piece cut at a shard boundary), whatever the stage that shards.
"""

from __future__ import annotations

import math

import fsspec
import pytest
import torch

from storage.storage import storage_options
from workers.zero.testing import spawn_world

from ..zero import deferred_cases as dc

N = 4


def _upload(local_dir: str, uri: str) -> None:
    fs = fsspec.filesystem("s3", **storage_options("s3"))
    fs.put(local_dir.rstrip("/") + "/", uri.removeprefix("s3://"), recursive=True)


@pytest.mark.parametrize("zero", [dict(stage=1), dict(stage=2, precision="bf16"), dict(stage=3)])
def test_each_rank_reads_its_share_from_s3(tmp_path, s3_bucket, zero):
    state = dc.pretrained_state(dc.SMALL)
    local = dc.write_hf_dir(state, str(tmp_path / "hf"))
    uri = f"{s3_bucket}/pretrained/gpt"
    _upload(local, uri)
    tensors = {k: v for k, v in state.items() if k != "lm_head.weight"}  # the tie: one tensor
    model_bytes = sum(v.numel() * v.element_size() for v in tensors.values())
    largest = max(v.numel() * v.element_size() for v in tensors.values())
    results = spawn_world(dc.load_world, N, args=(dc.SMALL, uri, {**zero, "bucket_mb": 0.2}, 1, "initial"))
    read = [r["bytes_read"] for r in results]
    assert sum(read) >= model_bytes  # every byte was read by someone
    for rank, got in enumerate(read):
        assert got <= math.ceil(model_bytes / N) + largest, (zero, rank, read, model_bytes)
    for k, v in state.items():
        assert torch.equal(results[0]["initial"][k], v), k
