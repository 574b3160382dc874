"""The planner's prediction against the real engine on Gloo worlds of N = 1, 2, 3 CPU ranks.

Two claims (issue 8, "must show" 2):

* model states: predicted params/grads/optimizer bytes (+ host bytes under offload) equal
  ``engine.memory()`` within 1% plus the padding (the engine pads each bucket to a multiple
  of N; Adam's moments and its ``step`` scalars cover real elements only);
* total: the predicted per-rank total is within 15% of the measured peak RSS growth.

Stages 0–3 on gpt-nano (fp32, bf16) and gpt-mini (bf16); also stage 2 with 3 micro-steps
(gpt-mini, N=2), stages 2 and 3 with the optimizer offloaded (gpt-nano, bf16), and gpt-small
at N=1 (fp32, stage 0).

How the peak is measured, per rank (``planner.PeakMemoryMeter``): a throwaway tiny model trains
one step first (kernels, Gloo and allocator arenas are process constants, not the job's
memory); the meter starts (RSS); the job's model and engine are built; the kernel's peak-RSS
mark is reset and two steps run; growth = VmHWM − RSS before the model. glibc is told to serve
every allocation above 64 KiB with mmap (``MALLOC_MMAP_THRESHOLD_``) so freed tensors leave the
RSS, as they leave a CUDA allocator's "allocated" counter. The prediction uses device="cpu"
(no CUDA context) and activations profiled on the meta device.

One Gloo world of 3 processes per preset serves N = 1, 2 and 3 through subgroups of its
first N ranks (spawning costs more than the measurements).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("workers.zero.engine")

from contract.spec import ModelSpec  # noqa: E402
from contract.zero_math import low_precision_bytes, optimizer_bytes_per_param  # noqa: E402
from workers.models import GPT, PRESETS, preset_config  # noqa: E402
from workers.planning import measured_activations  # noqa: E402
from workers.zero.planner import (  # noqa: E402
    PeakMemoryMeter,
    PlanInputs,
    StagePrediction,
    compare,
    model_shape,
    predict,
)
from workers.zero.testing import spawn_world  # noqa: E402

MICRO_BATCH, SEQ_LEN, BUCKET_MB = 4, 128, 1.0
STAGES = (0, 1, 2, 3)
# Both precisions on gpt-nano; gpt-mini (10× larger, 3 ranks on 2 shared cores) in bf16 only to
# keep the runtime near a minute. (Measured once in fp32 too: peak errors +4.1…+4.6%, -2.2%.)
PRECISIONS = {"gpt-nano": ("fp32", "bf16"), "gpt-mini": ("bf16",)}


WORLD = 3
ACCUMULATING = ("gpt-mini", 2)  # also measured with 3 micro-steps per step (stage 2, bf16)
OFFLOADING = "gpt-nano"  # also measured with the optimizer offloaded (stages 2 and 3, bf16)


def _train(engine, vocab: int, steps: int, micro_steps: int = 1) -> None:
    for _ in range(steps):
        for _ in range(micro_steps):
            x = torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN))
            loss = engine(x, torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN)))
            engine.backward(loss)
        engine.step()


def _engine(model, stage: int, precision: str, group, offload: bool = False):
    from workers.zero import ZeroConfig, ZeroEngine

    config = ZeroConfig(stage=stage, precision=precision, bucket_mb=BUCKET_MB, offload_optimizer=offload)
    return ZeroEngine(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), config=config, process_group=group)


def measure_rank(rank: int, world_size: int, preset: str) -> list[dict]:
    """On each rank of subgroups of size 1..3: per precision and stage, memory() and peak growth."""
    results = []
    for n in range(1, world_size + 1):
        group = dist.new_group(list(range(n)))  # every rank takes part in creating it
        if rank < n:
            results += [measure_one(preset, n, stage, precision, group)
                        for precision in PRECISIONS[preset] for stage in STAGES]
            if (preset, n) == ACCUMULATING:  # stage 2 holds a micro-step's scratch into the next
                results.append(measure_one(preset, n, 2, "bf16", group, micro_steps=3))
            if preset == OFFLOADING:
                results += [measure_one(preset, n, stage, "bf16", group, offload=True) for stage in (2, 3)]
        dist.barrier()
    return results


def measure_one(preset: str, n: int, stage: int, precision: str, group, micro_steps: int = 1,
                offload: bool = False) -> dict:
    warm = GPT(preset_config(preset, n_layer=1))  # same ops, tiny: warms kernels and arenas
    _train(_engine(warm, stage, precision, group, offload), warm.config.vocab_size, 1)
    del warm
    gc.collect()
    meter = PeakMemoryMeter("cpu")
    meter.start()
    torch.manual_seed(0)
    model = GPT(PRESETS[preset])
    engine = _engine(model, stage, precision, group, offload)
    meter.reset_peak()
    _train(engine, model.config.vocab_size, 2, micro_steps)
    measured = {"n": n, "precision": precision, "stage": stage, "micro_steps": micro_steps, "offload": offload,
                "peak": meter.peak_growth(), **engine.memory()}
    del engine, model
    gc.collect()
    return measured


def predicted(preset: str, n: int, stage: int, precision: str, micro_steps: int = 1,
              offload: bool = False) -> StagePrediction:
    inputs = PlanInputs(
        shape=model_shape({"preset": preset}),
        n_ranks=n,
        precision=precision,
        bucket_mb=BUCKET_MB,
        **measured_activations(ModelSpec(preset=preset), MICRO_BATCH, SEQ_LEN, precision, n, BUCKET_MB, "cpu"),
        accumulation_steps=micro_steps,
        device="cpu",
    )
    return predict(inputs, stage, offload)


@pytest.fixture(autouse=True)
def _mmap_large_allocations(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


def measure_single(rank: int, world_size: int, preset: str, stage: int, precision: str) -> dict:
    return measure_one(preset, world_size, stage, precision, None)


def check(preset: str, rank: int, measured: dict) -> list[str]:
    """One measurement against its prediction: prints the row, returns what failed."""
    n, stage, precision = measured["n"], measured["stage"], measured["precision"]
    micro_steps, offload = measured["micro_steps"], measured["offload"]
    pred = predicted(preset, n, stage, precision, micro_steps, offload)
    states_pred = pred.gpu["params"] + pred.gpu["grads"] + pred.gpu["optimizer"]
    states_meas = measured["params"] + measured["grads"] + measured["optimizer"] + measured.get("host", 0)
    states_pred += pred.cpu["total"]
    # padding elements, each carrying params + grads + optimizer bytes
    per_elem = 2 * low_precision_bytes(precision) + optimizer_bytes_per_param(precision)
    allowed = 0.01 * states_meas + pred.padding_bytes // low_precision_bytes(precision) * per_elem
    peak = compare(pred.to_dict(), measured)["peak"]  # + host terms under offload: same RAM here
    row = {
        "preset": preset, "n": n, "rank": rank, "stage": f"{stage}{'+offload' if offload else ''}",
        "precision": precision, "micro": micro_steps,
        "states_rel_err": (states_pred - states_meas) / states_meas,
        "peak_pred": peak["predicted"], "peak_meas": peak["measured"], "peak_rel_err": peak["rel_error"],
    }
    failures = []
    if abs(states_pred - states_meas) > allowed:
        failures.append(f"model states off: {row}")
    if abs(peak["rel_error"]) > 0.15:
        failures.append(f"peak off by more than 15%: {row}")
    print("  {preset} N={n} rank {rank} stage {stage} {precision} ×{micro}: states {states_rel_err:+.4%} "
          "peak {peak_pred:.0f}/{peak_meas:.0f} B {peak_rel_err:+.1%}".format(**row))
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gpt-nano", "gpt-mini"])
def test_prediction_matches_the_engine(preset):
    per_rank = spawn_world(measure_rank, world_size=WORLD, args=(preset,), timeout_s=300)
    configs = len(STAGES) * len(PRECISIONS[preset])
    extra = [int(preset == ACCUMULATING[0] and rank < ACCUMULATING[1]) + 2 * (WORLD - rank) * (preset == OFFLOADING)
             for rank in range(WORLD)]
    assert [len(results) for results in per_rank] == [(WORLD - rank) * configs + extra[rank] for rank in range(WORLD)]
    print("\nplanner vs engine (relative errors: model states, peak):")
    failures = [f for rank, results in enumerate(per_rank) for m in results for f in check(preset, rank, m)]
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_gpt_small_on_one_rank():
    """2 GB of model states and GPT-2's vocabulary: measured once at N=1 (about 30 s)."""
    (measured,) = spawn_world(measure_single, world_size=1, args=("gpt-small", 0, "fp32"), timeout_s=300)
    print()
    failures = check("gpt-small", 0, measured)
    assert not failures, "\n".join(failures)
