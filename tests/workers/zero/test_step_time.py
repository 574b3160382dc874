"""The planner's NVMe disk time: the traffic it prices is what the engine moves, and the folder
rate probe measures through the engine's own I/O path and leaves nothing behind."""

from __future__ import annotations

import pytest
import torch

from workers.models import build_model
from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.planner import ModelShape, PlanInputs, predict
from workers.zero.planner.disk_rate import measure_disk_rate
from workers.zero.planner.step_time import disk_time_s
from workers.zero.swap_io import aligned


@pytest.mark.parametrize("stage", [1, 3])
def test_predicted_disk_traffic_is_what_an_nvme_step_moves(stage, tmp_path):
    torch.manual_seed(0)
    model = build_model({"preset": "gpt-nano"})
    shape = ModelShape.of(model)
    engine = ZeroEngine(model, lambda params: torch.optim.AdamW(params, lr=1e-3),
                        ZeroConfig(stage=stage, offload_optimizer="nvme", nvme_path=str(tmp_path / "swap")))
    try:
        infos = []
        for _ in range(3):
            idx = torch.randint(0, 100, (2, 16))
            engine.backward(engine(idx, idx))
            infos.append(engine.step())
    finally:
        engine.close()
    rate = 1e9
    prediction = predict(PlanInputs(shape=shape, n_ranks=1, disk_bytes_per_s=rate, compute_s=0.5), stage, "nvme")
    # the first step only writes (there is no state to read yet); every later one reads and writes it all
    assert infos[0].io_write_bytes == prediction.disk_bytes
    for info in infos[1:]:
        assert (info.io_read_bytes, info.io_write_bytes) == (prediction.disk_bytes, prediction.disk_bytes)
    assert prediction.disk_time_s == pytest.approx(2 * prediction.disk_bytes / rate)
    assert prediction.step_time_s == pytest.approx(0.5 + prediction.disk_time_s)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_first_step_reports_its_own_io_and_construction_its_writes_apart(precision, tmp_path):
    """Stage 3 built on meta with the parameters and the optimizer on NVMe: construction writes every
    unit's shard to its file (``engine.construction_io()``), and the first step's ``io_write_bytes``
    are that step's alone: each file written once, as in every later step."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model({"preset": "gpt-nano"})
    shape = ModelShape.of(model)
    config = ZeroConfig(stage=3, precision=precision, offload_params="nvme", offload_optimizer="nvme",
                        nvme_path=str(tmp_path / "swap"))
    engine = ZeroEngine(model, lambda params: torch.optim.AdamW(params, lr=1e-3), config)
    try:
        built = engine.construction_io()
        idx = torch.randint(0, 100, (2, 16))
        engine.backward(engine(idx, idx))
        first = engine.step()
    finally:
        engine.close()
    inputs = PlanInputs(shape=shape, n_ranks=1, precision=precision, offload_params="nvme")
    both, params_only = predict(inputs, 3, "nvme"), predict(inputs, 3, False)
    assert first.io_write_bytes == both.disk_write_bytes
    assert built["io_write_bytes"] == params_only.disk_bytes and built["io_read_bytes"] == 0
    assert built["io_wait_s"] >= 0


def test_no_disk_time_without_nvme_or_a_rate():
    shape = ModelShape.from_count(1e6)
    assert predict(PlanInputs(shape=shape, n_ranks=2, disk_bytes_per_s=1e9), 2, True).disk_time_s is None
    assert predict(PlanInputs(shape=shape, n_ranks=2), 2, "nvme").disk_time_s is None


def test_no_step_time_while_a_term_is_unknown():
    shape = ModelShape.from_count(1e6)
    assert predict(PlanInputs(shape=shape, n_ranks=2, compute_s=1.0), 2).step_time_s is None  # no link rate
    assert predict(PlanInputs(shape=shape, n_ranks=1, compute_s=1.0), 2, "nvme").step_time_s is None  # no disk
    known = predict(PlanInputs(shape=shape, n_ranks=2, compute_s=1.0, bandwidth_bytes_per_s=1e9), 2)
    assert known.step_time_s == pytest.approx(1.0 + known.comm_time_s)


def test_disk_time_adds_reads_and_writes():
    assert disk_time_s(10**9, 10**9, 2e9, 1e9) == pytest.approx(0.5 + 1.0)
    assert disk_time_s(10**9, 10**9, 2e9) == pytest.approx(1.0)
    assert disk_time_s(3 * 10**9, 10**9, 1e9) == pytest.approx(3.0 + 1.0)  # stage 3's parameter files: read more
    with pytest.raises(ValueError, match="positive"):
        disk_time_s(1, 1, 0.0)


def test_measure_disk_rate_moves_the_bytes_and_cleans_up(tmp_path):
    rate = measure_disk_rate(str(tmp_path), nbytes=3 * 2**20 + 5)
    assert rate.nbytes == aligned(3 * 2**20 + 5)
    assert 0 < rate.read_bytes_per_s < float("inf") and 0 < rate.write_bytes_per_s < float("inf")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="nbytes"):
        measure_disk_rate(str(tmp_path), nbytes=0)
