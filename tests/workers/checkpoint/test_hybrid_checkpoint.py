"""Checkpoints of hybrid-sharded engines (``ZeroConfig(shard_group_size=G)``, docs/engine.md).

A hybrid engine's shards are those of a world of G, replicated R times: only the ranks of
replica 0 (ranks 0..G-1, whose ``shard_rank`` is their rank) write tensors, so the checkpoint
is the one a world of G would write, plus empty shard files of the replicas; every rank loads
its shard-group slice by byte range. Saved at world 4 = 2 groups x 2, resumed at the same
layout (bit-for-bit continuation up to float rounding), at world 2 without hybrid sharding and
another stage; and a plain world-2 save resumed hybrid at world 4, stage 3. hpZ
(``hpz_partition_size=2``, issue 35: it composes with elastic resizes) the same way: saved at
world 4 (two hpZ groups of 2) and resumed at world 2 (one group of 2), and a plain world-2
save resumed with hpZ at world 4. Slow: five Gloo worlds, two of four ranks, on the test
machine's two cores (minutes).
"""

from __future__ import annotations

import json
import uuid

import pytest

from storage.storage import Storage

from .test_resume import _run_phase, assert_same_params

pytestmark = pytest.mark.slow

BATCH = 24  # whole micro-batches of 2 at 2 and 4 ranks
HALF, FULL = 3, 6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = f"file://{tmp_path_factory.mktemp('hybrid')}"
    hsdp, plain = f"hsdp-{uuid.uuid4().hex[:6]}", f"plain-{uuid.uuid4().hex[:6]}"
    hpz = f"hpz-{uuid.uuid4().hex[:6]}"
    common = dict(uri=root, global_batch=BATCH)
    hybrid2 = dict(common, stage=2, shard_group_size=2)
    hpz2 = dict(common, stage=3, hpz_partition_size=2)
    phase1 = [
        (4, "hsdp first", dict(hybrid2, job_id=hsdp, until=HALF)),
        (4, "hpz first", dict(hpz2, job_id=hpz, until=HALF)),
        (4, "hsdp straight", dict(hybrid2, job_id=f"{hsdp}-ref", until=FULL, save=False)),
        (2, "plain first", dict(common, stage=1, job_id=plain, until=HALF)),
        (2, "plain straight", dict(common, stage=3, job_id=f"{plain}-ref", until=FULL, save=False)),
    ]
    phase2 = [
        (4, "hsdp resumed", dict(hybrid2, job_id=hsdp, until=FULL, init_seed=7, resume={"job_id": hsdp}, save=False)),
        (4, "hsdp stage 3 from plain", dict(common, stage=3, shard_group_size=2, job_id=plain, until=FULL, init_seed=9,
                                            resume={"job_id": plain}, save=False)),
        (2, "plain from hsdp", dict(common, stage=3, job_id=hsdp, until=FULL, init_seed=11, resume={"job_id": hsdp},
                                    save=False)),
        (2, "hpz at 2 from hpz at 4", dict(hpz2, job_id=hpz, until=FULL, init_seed=13, resume={"job_id": hpz},
                                           save=False)),
        (4, "hpz at 4 from plain", dict(hpz2, job_id=plain, until=FULL, init_seed=17, resume={"job_id": plain},
                                        save=False)),
    ]
    results = _run_phase(phase1)
    results.update(_run_phase(phase2))
    results["root"], results["hsdp"] = root, hsdp
    return results


def test_a_hybrid_checkpoint_is_a_world_of_g_with_empty_replica_shards(runs):
    step_dir = Storage.at(f"{runs['root']}/{runs['hsdp']}/checkpoints")
    manifest = json.loads(step_dir.read_bytes(f"step_{HALF:08d}/manifest.json"))
    assert (manifest["world_size"], manifest["shard_world_size"], manifest["stage"]) == (4, 2, 2)
    assert len(manifest["rng"]) == 4
    writers = {piece["file"] for entry in manifest["tensors"]["params"].values() for piece in entry["pieces"]}
    assert writers == {f"shard_{r:05d}_of_00004.safetensors" for r in (0, 1)}  # replica 0 only


@pytest.mark.parametrize("resumed,straight,rtol", [
    ("hsdp resumed", "hsdp straight", 1e-6),  # the same layout: the uninterrupted run's math
    ("plain from hsdp", "plain straight", 1e-4),  # another world size sums in another order
    ("hsdp stage 3 from plain", "hsdp straight", 1e-4),
    ("hpz at 2 from hpz at 4", "plain straight", 1e-4),  # an elastic shrink of an hpZ job
    ("hpz at 4 from plain", "hsdp straight", 1e-4),  # and a grow into hpZ groups
])
def test_resumed_runs_continue_like_the_uninterrupted_run(runs, resumed, straight, rtol):
    for rank, out in enumerate(runs[resumed]):
        assert out["loaded_step"] == HALF
        assert_same_params(out["full"], runs[straight][rank]["full"], rtol=rtol, atol=rtol / 10)
        assert out["position"] == FULL * BATCH
        assert out["bytes_read"] == out["bytes_needed"]  # every rank reads its shard-group slice, no more
