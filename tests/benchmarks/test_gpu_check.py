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
