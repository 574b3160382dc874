"""Issue 32 through the job spec: ``zero: {offload_optimizer: nvme, nvme_path}`` trains a job on 2
Gloo ranks exactly as the same job in memory, reports its swap-file I/O per step, keeps its files
under ``nvme_path/<job id>/<rank>/`` while it runs and removes them when it ends."""

from __future__ import annotations

import json

from workers.loop_config import LoopConfig
from workers.train import run_local

STEPS = 4


def _job(tmp_path, name: str, zero: dict, summaries_out: list | None = None) -> tuple[list[float], list[dict]]:
    spec = {"name": name, "model": {"preset": "gpt-nano"},
            "data": {"kind": "synthetic", "seq_len": 32},
            "train": {"steps": STEPS, "global_batch_size": 4, "micro_batch_size": 1, "lr": 1e-3, "seed": 0},
            "zero": {"stage": 3, "precision": "fp32", "bucket_mb": 0.25, **zero}, "resources": {"num_workers": 2}}
    metrics = tmp_path / f"metrics-{name}"
    summaries = run_local(LoopConfig(spec=spec, job_id=name, api_url=None, attempt_base=0,
                                      metrics_path=str(metrics), storage_uri=f"file://{tmp_path / 'storage'}"),
                          world_size=2)
    records = [json.loads(line) for path in sorted(metrics.parent.glob(f"{metrics.name}*")) if path.is_file()
               for line in path.read_text().splitlines()]
    if summaries_out is not None:
        summaries_out.extend(summaries)
    return summaries[0]["losses"], [r for r in records if "io_read_bytes" in r]


def test_an_nvme_job_trains_as_in_memory_and_leaves_no_files(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    memory_losses, _ = _job(tmp_path, "in-memory", {})
    summaries: list[dict] = []
    losses, records = _job(tmp_path, "on-nvme", {"offload_optimizer": "nvme", "nvme_path": str(nvme)}, summaries)
    assert losses == memory_losses and len(losses) == STEPS
    steps = [r for r in records if r["io_write_bytes"]]
    assert {r["rank"] for r in steps} == {0, 1} and all(r["mem_disk_bytes"] > 0 for r in steps)
    assert all(r["io_wait_s"] is not None and r["io_read_bytes"] > 0 for r in steps if r["step"] > 1)
    assert list(nvme.iterdir()) == []  # nvme_path/on-nvme/<rank>/ removed, and the job's folder
    # at start both ranks probed the disk together: rank 0's predicted step prices the swap files
    predicted = summaries[0]["step_time"]
    assert predicted["disk_rate"]["read_bytes_per_s"] > 0 and predicted["disk_time_s"] > 0
    assert predicted["step_time_s"] is not None and predicted["disk_exposed_s"] is not None
    # the optimizer's files are made by the first step: construction moved nothing
    assert all(s["construction_io"]["io_write_bytes"] == 0 for s in summaries)
