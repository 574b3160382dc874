"""Smoke test: ``benchmarks/engine.py`` runs at a tiny size (3 rows in one world, to keep start-up
short) and its JSON has every column."""

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
         "--rows", "ddp,fsdp2,zero2", "--shared-world", "--row-timeout", "120", "--json", str(out)],
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
    by = {r["row"]: r for r in report["rows"]}
    phi = report["parameters"]
    assert by["ddp"]["comm_elements"] == 2 * phi  # computed: all-reduce of every element
    assert by["zero2"]["comm_elements"] >= 2 * phi  # measured, padded to the world size
    assert by["fsdp2"]["comm_elements"] >= 2 * phi  # measured: gathers (forward, backward) + reduce-scatter
    assert by["zero2"]["comm_exposed_s"] is not None and by["ddp"]["comm_exposed_s"] is None
    assert by["zero2"]["planned_peak_bytes"] > 0 and by["ddp"]["planned_peak_bytes"] is None  # the planner's
    assert report["settings"]["host_malloc"] == "mapped"  # the worker's allocator policy, every row alike
    # same seed, same data, fp32: every system reaches the same loss
    losses = [r["final_loss"] for r in report["rows"]]
    assert max(losses) - min(losses) < 1e-3, losses
    # model state: FSDP2 shards everything, stage 2 shards gradients and optimizer state
    assert by["fsdp2"]["model_state_bytes"]["total"] < by["zero2"]["model_state_bytes"]["total"]
    assert by["zero2"]["model_state_bytes"]["total"] < by["ddp"]["model_state_bytes"]["total"]
