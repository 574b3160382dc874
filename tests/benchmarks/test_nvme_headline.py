"""The NVMe headline benchmark's own arithmetic (no world, no disk): which rank's step is the
step's, and the optimizer step's share of the disk's measured bandwidth; and the DeepSpeed NVMe
row's config."""

from __future__ import annotations

import pytest

from benchmarks import nvme_headline
from benchmarks.peers import deepspeed_row

GB = 10**9


def rank(step_s: float, opt_s: float, read: int, written: int, comm: float = 0.5, io: float = 1.0) -> dict:
    step = {"loss": 7.0, "step_s": step_s, "forward_s": 1.0, "backward_s": 2.0, "opt_s": opt_s,
            "comm_exposed_s": comm, "io_wait_s": io, "io_read_bytes": 3 * read, "io_write_bytes": written,
            "opt_read_bytes": read, "opt_write_bytes": written}
    return {"probe": {"read_bytes_per_s": 2 * GB, "write_bytes_per_s": 1 * GB, "direct": True},
            "steps": [step], "peak_bytes": 5 * GB, "baseline_rss_bytes": GB, "disk_bytes": 9 * GB,
            "files_bytes": 9 * GB, "construction_s": 3.0}


def test_the_step_is_the_slowest_ranks_and_the_disk_share_counts_every_ranks_bytes():
    ranks = [rank(10.0, 4.0, 2 * GB, 1 * GB, comm=0.5), rank(12.0, 5.0, 2 * GB, 1 * GB, comm=0.25)]
    summary = nvme_headline.summarize(ranks, world=2)
    step = summary["steps"][0]
    assert step["step_s"] == 12.0 and step["comm_s"] == 0.25  # rank 1's: the slower
    assert step["compute_s"] == pytest.approx(12.0 - 0.25 - 1.0)
    assert step["opt_s"] == 5.0 and step["opt_read_bytes"] == 4 * GB and step["opt_write_bytes"] == 2 * GB
    # the disk moves 4 GB in at 2 GB/s and 2 GB out at 1 GB/s: 4 s of its time in a 5 s step phase
    assert step["opt_disk_fraction"] == pytest.approx(4.0 / 5.0)
    assert step["opt_read_bytes_per_s"] == pytest.approx(0.8 * GB)
    assert summary["peak_rss_bytes_per_rank"] == [6 * GB, 6 * GB]


def test_the_disk_share_uses_the_slowest_probe():
    ranks = [rank(10.0, 4.0, GB, GB), rank(10.0, 4.0, GB, GB)]
    ranks[1]["probe"] = {**ranks[1]["probe"], "read_bytes_per_s": 1 * GB}
    step = nvme_headline.summarize(ranks, world=2)["steps"][0]
    assert step["opt_disk_fraction"] == pytest.approx((2 / 1 + 2 / 1) / 4.0)


def test_the_deepspeed_nvme_row_offloads_both_to_the_folder_with_our_block_size_and_depth(tmp_path):
    config = deepspeed_row.ds_config("ds3-nvme", {"precision": "fp32", "bucket_mb": 25.0, "micro_batch": 1,
                                                  "nvme_dir": str(tmp_path)})
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    for part in ("offload_optimizer", "offload_param"):
        assert zero[part]["device"] == "nvme" and zero[part]["nvme_path"].startswith(str(tmp_path))
    assert config["aio"]["block_size"] == 2**20 and config["aio"]["queue_depth"] == 8
    assert config["zero_force_ds_cpu_optimizer"] is False  # the same torch AdamW as every row
    assert "ds3-nvme" not in deepspeed_row.DEFAULT_ROWS  # it needs --nvme-dir
