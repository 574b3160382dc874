"""``make gpu-check`` on a machine without CUDA: one line saying so, after its self-test, exit 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

REPO = Path(__file__).resolve().parents[2]


def test_self_test_of_the_checks_own_logic_passes():
    assert gpu_check.self_test() >= 20


def test_the_self_test_fails_when_its_logic_is_wrong(monkeypatch):
    monkeypatch.setattr(gpu_check, "overlap_fraction", lambda copies, compute: 1.0)
    with pytest.raises(AssertionError, match="copy time overlapping compute"):
        gpu_check.self_test()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu-check measures there")
def test_without_cuda_it_prints_one_line_and_exits_0(tmp_path: Path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device on this machine"), proc.stdout
    assert "checks passed" in lines[0] and not out.exists()  # nothing measured, nothing written


def gloo_equivalence(rank: int, world_size: int):
    import torch

    return gpu_check.equivalence_run(torch.device("cpu"), rank, world_size, steps=2)


def test_its_equivalence_run_is_bit_identical_on_a_forced_gloo_world_of_one():
    """(a)'s code path on the CPU: every stage and offload, forced through a 1-rank group, against PyTorch."""
    from workers.zero.testing import spawn_world

    out = spawn_world(gloo_equivalence, 1)[0]
    rows = gpu_check.equivalence_rows({"plain": out})
    assert [r["system"] for r in rows] == list(gpu_check.EQUIVALENCE_SYSTEMS)
    assert all(r["identical"] for r in rows), rows


def test_on_a_gpu_machine_the_sections_are_assembled_into_the_json_and_table(monkeypatch, tmp_path: Path):
    """The parent's side of a CUDA run, its children stood in for: every section lands in the report,
    a child that timed out or failed is reported as such, and the table shows each."""
    import json

    calls = []

    def child(args, timeout_s, env=None):
        calls.append((args[0], timeout_s, env))
        if args[0] == "equivalence":
            if env:  # the no-caching variant's child died
                return None, "exit -6: CUDA error"
            return {"world": 1, "reference": [5.0, 4.0], "systems": {"zero2": [5.0, 4.0]}}, ""
        if args[0] == "throughput":
            return {"preset": "gpt-1b", "micro_batch": 8, "seq_len": 1024,
                    "rows": [{"system": "zero2", "step_time_s": gpu_check.time_summary([0.2, 0.3])}],
                    "timeline": {"skipped": "out of time"}}, ""
        return None, "timed out after 150 s"

    monkeypatch.setattr(gpu_check, "run_child", child)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    path = tmp_path / "out" / "gpu_check.json"
    report = gpu_check.run_on_gpu(str(path), 450.0)
    assert [c[0] for c in calls] == ["equivalence"] * 3 + ["throughput", "offload_capacity"]
    assert all(c[1] >= gpu_check.MIN_EQUIVALENCE_RUN_S for c in calls[:3])
    assert not report["equivalence"]["all_identical"]  # a variant that died is not a pass
    assert report["offload_capacity"] == {"skipped": "timed out after 150 s"}
    assert report["offload_timeline"] == {"skipped": "out of time"} and "timeline" not in report["throughput"]
    assert json.loads(path.read_text())["device"] == "NVIDIA H200"
    text = "\n".join(gpu_check.table_lines(report))
    assert "exit -6: CUDA error" in text and "timed out after 150 s" in text and "gpt-1b" in text


def gloo_build_systems(rank: int, world_size: int):
    """Two steps of every throughput system through ``_build_system``, as (b) runs them on a GPU."""
    from dataclasses import replace

    import torch

    from workers.models import GPT, PRESETS

    cfg = replace(PRESETS["gpt-nano"], block_size=16)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    out = {}
    for system in gpu_check.THROUGHPUT_SYSTEMS:
        torch.manual_seed(0)
        model = GPT(cfg)  # fp32, as (b) builds it: each system applies its own bf16
        step, exposed = gpu_check._build_system(system, model, (x, x), torch.device("cpu"))
        step()
        step()
        out[system] = exposed
    return out


def test_every_throughput_system_steps_through_the_engines_public_api():
    """(b)'s per-system step on the CPU, so an engine API change fails here, not first on a GPU machine:
    zerotrain's stages report their exposed communication each step, the peers report none."""
    from workers.zero.testing import spawn_world

    out = spawn_world(gloo_build_systems, 1)[0]
    for system, exposed in out.items():
        if system.startswith("zero"):
            assert len(exposed) == 2 and all(isinstance(t, float) and t >= 0 for t in exposed), (system, exposed)
        else:
            assert exposed == [], system


def test_the_base_model_b_copies_keeps_the_tied_head():
    """(b)/(c) measure the preset the planner predicts: ``to_empty`` alone would give the head a weight
    of its own (103M more parameters at gpt-1b, their master and Adam moments on top)."""
    from dataclasses import replace

    from workers.models import GPT, PRESETS, num_parameters

    cfg = replace(PRESETS["gpt-nano"], block_size=16)
    base = gpu_check.base_model(cfg, torch.device("cpu"))
    assert base.lm_head.weight is base.wte.weight
    assert num_parameters(base) == num_parameters(GPT(cfg))
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in base.parameters())
