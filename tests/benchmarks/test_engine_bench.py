"""Smoke test: ``benchmarks/engine.py`` runs at a tiny size (3 rows interleaved in one world, to
keep start-up short) and its JSON has every column: collectives counted for every row, each
row's loss trajectory bitwise equal to DDP's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_engine_benchmark_tiny(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", "--preset", "gpt-nano", "--layers", "2", "--width", "32",
         "--seq-len", "16", "--micro-batch", "2", "--steps", "2", "--warmup", "1",
         "--rows", "ddp,fsdp2,zero2", "--interleave", "--row-timeout", "120", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    for key in ("machine", "torch", "settings", "parameters", "columns", "rows", "summary"):
        assert key in report
    assert [r["row"] for r in report["rows"]] == ["ddp", "fsdp2", "zero2"]
    for row in report["rows"]:
        assert set(report["columns"]) <= set(row), set(report["columns"]) - set(row)
        assert row["ok"], row["error"]
        assert row["step_time_s"] > 0 and row["tokens_per_s"] > 0 and row["ratio_to_ddp"] > 0
        assert row["model_state_bytes"]["total"] > 0 and row["peak_bytes"] >= 0
        assert row["comm_elements"] > 0
        assert len(row["step_times_s"]) == 2
        assert len(row["peak_bytes_per_rank"]) == 2 and max(row["peak_bytes_per_rank"]) == row["peak_bytes"]
        # the peaks of an interleaved run are measured again, each row in a world of its own
        assert row["peak_source"].endswith("each row in a world of its own (a separate pass)"), row["peak_source"]
        assert row["shared_world_peak_bytes"] >= 0
    by = {r["row"]: r for r in report["rows"]}
    phi = report["parameters"]
    ddp_kinds = by["ddp"]["collectives_per_rank"][0]["kinds"]
    assert list(ddp_kinds) == ["all_reduce"] and ddp_kinds["all_reduce"]["elements"] == phi  # its buckets, unpadded
    assert by["ddp"]["comm_elements"] == 2 * phi  # counted from the dispatched ops: an all-reduce counts 2x
    assert by["zero2"]["comm_elements"] >= 2 * phi  # padded to the world size
    assert by["fsdp2"]["comm_elements"] >= 2 * phi  # gathers (forward, backward) + reduce-scatter
    own = by["zero2"]["own_comm_volume"]  # zerotrain's own account, shown beside the count
    assert own["reduce_scatter"] >= phi and own["all_gather"] >= phi and own["total"] >= 2 * phi
    assert by["ddp"]["own_comm_volume"] is None
    assert report["losses_equal_ddp"] == {"ddp": True, "fsdp2": True, "zero2": True}  # bitwise, fp32
    assert all(len(r["losses_per_rank"][0]) == 3 for r in report["rows"])  # warm-up + measured steps
    assert by["zero2"]["comm_exposed_s"] is not None and by["ddp"]["comm_exposed_s"] is None
    assert by["zero2"]["planned_peak_bytes"] > 0 and by["ddp"]["planned_peak_bytes"] is None  # the planner's
    assert report["settings"]["host_malloc"] == "mapped"  # the worker's allocator policy, every row alike
    # model state: FSDP2 shards everything, stage 2 shards gradients and optimizer state
    assert by["fsdp2"]["model_state_bytes"]["total"] < by["zero2"]["model_state_bytes"]["total"]
    assert by["zero2"]["model_state_bytes"]["total"] < by["ddp"]["model_state_bytes"]["total"]


def test_engine_benchmark_nvme_rows_train_alike_and_leave_no_swap_files(tmp_path: Path) -> None:
    """The NVMe rows (optimizer, and optimizer + parameters) end with ``close()``: the swap files
    and the folders made for them are gone; their losses are stage 3's in memory, bit for bit."""
    out, nvme = tmp_path / "engine.json", tmp_path / "nvme"
    nvme.mkdir()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", "--preset", "gpt-nano", "--layers", "2", "--width", "32",
         "--seq-len", "16", "--micro-batch", "2", "--steps", "1", "--warmup", "1", "--nvme-dir", str(nvme),
         "--rows", "zero3,zero3-nvme,zero3-nvme-params", "--row-timeout", "120", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(row["ok"] for row in by.values()), [row["error"] for row in by.values()]
    assert by["zero3-nvme-params"]["model_state_bytes"]["disk"] > by["zero3-nvme"]["model_state_bytes"]["disk"] > 0
    assert by["zero3-nvme-params"]["losses_per_rank"] == by["zero3-nvme"]["losses_per_rank"] == \
        by["zero3"]["losses_per_rank"]
    assert list(nvme.iterdir()) == []
