"""The torch-free ZeRO arithmetic against the design table, written out here independently."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import zero_math as zm

GB = 1e9

# The design table as (replicated coefficient, partitioned coefficient) of Φ per stage: bytes
# per rank = a·Φ + b·Φ/N. Mixed precision: 2-byte params/grads, K = 12; fp32: 4-byte, K = 8.
TABLE = {
    "bf16": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)},
    "fp16": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)},
    "fp32": {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)},
}


def table_bytes(phi: int, n: int, precision: str, stage: int) -> float:
    replicated, partitioned = TABLE[precision][stage]
    return replicated * phi + partitioned * phi / n


def test_the_stage_traits_table():
    shards = {s: (t.shards_optimizer, t.shards_gradients, t.shards_parameters) for s, t in zm.STAGE_TRAITS.items()}
    assert shards == {0: (False, False, False), 1: (True, False, False), 2: (True, True, False),
                      3: (True, True, True)}
    assert [zm.stage_traits(s).gradient_collective for s in zm.STAGES] == [
        "all_reduce", "reduce_scatter", "reduce_scatter", "reduce_scatter"]
    assert [zm.stage_traits(s).reduces_at_step for s in zm.STAGES] == [False, True, False, False]
    assert [zm.stage_traits(s).shard_world(8) for s in zm.STAGES] == [1, 8, 8, 8]
    assert all(t.stage == s for s, t in zm.STAGE_TRAITS.items())


def test_the_contract_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import contract.zero_math, contract.spec; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_design_example_1_3b_on_8_gpus():
    phi = 1_300_000_000
    assert zm.model_state_bytes(phi, 8, "bf16", 0).gpu_total == pytest.approx(20.8 * GB)
    assert zm.model_state_bytes(phi, 8, "bf16", 3).gpu_total == pytest.approx(2.6 * GB)


@pytest.mark.parametrize("precision", zm.PRECISIONS)
@pytest.mark.parametrize("stage", zm.STAGES)
@pytest.mark.parametrize(
    "phi,n", [(1_300_000_000, 8), (7_500_000_000, 64), (124_475_904, 2), (1_057_152, 3), (10_844_160, 1), (1000, 7)]
)
def test_model_states_follow_the_table(phi, n, precision, stage):
    got = zm.model_state_bytes(phi, n, precision, stage).gpu_total
    # Shards round up to whole elements: at most N-1 elements per partitioned term more.
    slack = 16 * (n - 1) / n
    assert table_bytes(phi, n, precision, stage) <= got <= table_bytes(phi, n, precision, stage) + slack


@pytest.mark.parametrize("precision", zm.PRECISIONS)
def test_terms_split_as_the_stage_says(precision):
    phi, n = 1_200_000, 4
    p = 4 if precision == "fp32" else 2
    k = 8 if precision == "fp32" else 12
    expect = {
        0: (p * phi, p * phi, k * phi),
        1: (p * phi, p * phi, k * phi // n),
        2: (p * phi, p * phi // n, k * phi // n),
        3: (p * phi // n, p * phi // n, k * phi // n),
    }
    for stage, (params, grads, optim) in expect.items():
        s = zm.model_state_bytes(phi, n, precision, stage)
        assert (s.gpu_params, s.gpu_grads, s.gpu_optimizer) == (params, grads, optim)
        assert s.cpu_total == 0


@settings(max_examples=60, deadline=None)
@given(
    phi=st.integers(1, 10**12),
    n=st.integers(1, 4096),
    precision=st.sampled_from(zm.PRECISIONS),
)
def test_higher_stages_never_need_more_and_stage_3_divides_stage_0(phi, n, precision):
    totals = [zm.model_state_bytes(phi, n, precision, s).gpu_total for s in zm.STAGES]
    assert totals == sorted(totals, reverse=True)
    if phi % n == 0:
        assert totals[3] * n == totals[0] == 16 * phi


@pytest.mark.parametrize("precision", zm.PRECISIONS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_moves_master_moments_and_a_gradient_shard_to_the_host(stage, precision):
    phi, n = 8_000_000, 8
    plain = zm.model_state_bytes(phi, n, precision, stage)
    off = zm.model_state_bytes(phi, n, precision, stage, offload=True)
    assert off.gpu_optimizer == 0
    assert (off.gpu_params, off.gpu_grads) == (plain.gpu_params, plain.gpu_grads)
    assert (off.cpu_params, off.cpu_grads, off.cpu_optimizer) == (4 * phi // n, 4 * phi // n, 8 * phi // n)


def test_communication_elements_per_stage():
    phi = 1000
    assert [zm.comm_elements(phi, s, reshard_after_forward=True) for s in zm.STAGES] == [2000, 2000, 2000, 3000]
    assert zm.comm_elements(phi, 3, reshard_after_forward=False) == 2000


def test_bad_stage_and_precision_are_refused():
    with pytest.raises(ValueError, match="stage"):
        zm.model_state_bytes(10, 2, "bf16", 4)
    with pytest.raises(ValueError, match="stage"):
        zm.stage_traits(True)
    with pytest.raises(ValueError, match="precision"):
        zm.model_state_bytes(10, 2, "int8", 0)


def test_time_model_ring_collectives():
    # 1 GB per step over 4 ranks on a 100 Gbit/s link: 0.75 GB crosses each link in 0.06 s.
    bw = zm.gbps_to_bytes_per_s(100)
    assert bw == 12.5e9
    assert zm.bytes_per_s_to_gbps(bw) == 100
    t = zm.comm_time_s(1e9, 4, bw)
    assert t == pytest.approx(0.06)
    assert zm.efficiency(0.18, t) == pytest.approx(0.75)
    need = zm.bandwidth_for_efficiency(1e9, 4, 0.18, target=0.75)
    assert need == pytest.approx(bw)
    assert zm.comm_time_s(1e9, 1, bw) == 0.0
    assert zm.gb_to_bytes(1.5) == 1_500_000_000 and zm.gb_to_bytes(None) is None


@settings(max_examples=40, deadline=None)
@given(
    comm_bytes=st.floats(1e3, 1e12),
    n=st.integers(2, 1024),
    compute_s=st.floats(1e-3, 100),
    target=st.floats(0.05, 0.95),
)
def test_needed_bandwidth_reaches_the_target_efficiency(comm_bytes, n, compute_s, target):
    need = zm.bandwidth_for_efficiency(comm_bytes, n, compute_s, target)
    assert zm.efficiency(compute_s, zm.comm_time_s(comm_bytes, n, need)) == pytest.approx(target)
