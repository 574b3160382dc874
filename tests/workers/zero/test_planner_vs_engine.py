"""The planner's prediction against the real engine on Gloo worlds of N = 2 and 3 CPU ranks.

Two claims (issue 8, "must show" 2; issue 14, "must show" 5):

* model states held between steps: predicted params/optimizer bytes (+ host bytes under offload)
  equal ``engine.memory()`` after the last step within 1% plus the padding (the engine pads each
  bucket to a multiple of N; Adam's moments and its ``step`` scalars cover real elements only),
  and no gradient is held then (``grad_reducer.py``, the note on gradients' lifetime; the gradients
  within a step are ``test_accounting.py``'s);
* peak: the predicted peak of the whole job -- the worst of its parts (``planner/peak.py``:
  construction, forward, backward, step) -- is within 10% of the measured peak growth of every
  rank. Each part's prediction is printed beside its measurement.

Fast: gpt-nano in bf16, built on the meta device as the worker builds a preset (stages 0–3, stage 3
with the optimizer offloaded) and eagerly (stages 0 and 3), N = 2 and 3 (under a minute). Slow:
gpt-mini (10× larger, N = 2) in fp32 and bf16, eagerly; on meta in bf16 with stages 2 and 3 offloaded and
stage 2 with 3 micro-steps per step; gpt-small at N=1 (fp32, stage 0).

How the peak is measured, per rank, as the worker measures it (``planner.PeakMemoryMeter``; the
worker's host allocator policy, ``workers/host_memory.py``: large blocks mapped fresh, so freed
tensors leave the resident set as they leave a CUDA allocator's count): a throwaway tiny model
trains one step first (kernels, Gloo and allocator arenas are process constants, not the job's
memory); the meter starts (RSS); the job's model is built -- on the meta device, materialized by
the engine bucket by bucket, or eagerly in fp32 (the prediction's ``deferred_init``) -- and the
engine; two steps run, a lap at the end of each part;
growth = VmHWM − RSS before the model. The prediction uses device="cpu" (host and device are one
memory, no CUDA context) and activations profiled on the meta device.

One Gloo world of 3 processes serves gpt-nano's N = 2 and 3 through subgroups of its first N
ranks (spawning costs more than the measurements); gpt-mini runs at N = 2 in a world of 2.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("workers.zero.engine")

from contract.spec import ModelSpec  # noqa: E402
from contract.zero_math import low_precision_bytes, optimizer_bytes_per_param  # noqa: E402
from workers.host_memory import map_large_blocks  # noqa: E402
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
PEAK_TOLERANCE = 0.10
SIZES = (2, 3)


def configs(preset: str) -> list[dict]:
    """(stage, precision, offload, micro-steps) measured for ``preset`` at each N."""
    if preset == "gpt-nano":  # the fast test
        deferred = [dict(stage=s, precision="bf16") for s in range(4)] + [dict(stage=3, precision="bf16", offload=True)]
        return deferred + [dict(stage=s, precision="bf16", deferred=False) for s in (0, 3)]
    out = [dict(stage=s, precision=p, deferred=False) for p in ("fp32", "bf16") for s in range(4)]
    out += [dict(stage=s, precision="bf16", offload=True) for s in (2, 3)]
    return out + [dict(stage=2, precision="bf16", micro_steps=3)]  # stage 2 reduces every micro-step


def _train(engine, vocab: int, steps: int, meter: PeakMemoryMeter, micro_steps: int = 1) -> None:
    for _ in range(steps):
        for _ in range(micro_steps):
            x = torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN))
            loss = engine(x, torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN)))
            meter.lap("forward")
            engine.backward(loss)
            del loss
            meter.lap("backward")
        engine.step()
        meter.lap("step")


def _engine(model, stage: int, precision: str, group, offload: bool = False):  # a meta model: its init hook
    from workers.zero import ZeroConfig, ZeroEngine

    config = ZeroConfig(stage=stage, precision=precision, bucket_mb=BUCKET_MB, offload_optimizer=offload)
    return ZeroEngine(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), config=config, process_group=group)


def measure_rank(rank: int, world_size: int, preset: str, sizes: tuple[int, ...] = SIZES) -> list[dict]:
    """On each rank of subgroups of each size: per configuration, memory() and the peak by part."""
    map_large_blocks()
    results = []
    for n in sizes:
        group = dist.new_group(list(range(n)))  # every rank takes part in creating it
        if rank < n:
            results += [measure_one(preset, n, group, **config) for config in configs(preset)]
        dist.barrier()
    return results


def measure_one(preset: str, n: int, group, stage: int, precision: str, offload: bool = False,
                micro_steps: int = 1, deferred: bool = True) -> dict:
    warm = GPT(preset_config(preset, n_layer=1))  # same ops, tiny: warms kernels and arenas
    meter = PeakMemoryMeter("cpu")
    _train(_engine(warm, stage, precision, group, offload), warm.config.vocab_size, 1, meter)
    del warm
    gc.collect()
    meter.start()
    torch.manual_seed(0)
    with torch.device("meta") if deferred else contextlib.nullcontext():
        model = GPT(PRESETS[preset])
    engine = _engine(model, stage, precision, group, offload)
    meter.lap("construction")
    _train(engine, model.config.vocab_size, 2, meter, micro_steps)
    measured = {"n": n, "precision": precision, "stage": stage, "micro_steps": micro_steps, "offload": offload,
                "deferred": deferred, **engine.memory(), **meter.report()}
    del engine, model
    gc.collect()
    return measured


def predicted(preset: str, n: int, stage: int, precision: str, micro_steps: int = 1,
              offload: bool = False, deferred: bool = True) -> StagePrediction:
    inputs = PlanInputs(
        shape=model_shape({"preset": preset}),
        n_ranks=n,
        precision=precision,
        bucket_mb=BUCKET_MB,
        **measured_activations(ModelSpec(preset=preset), MICRO_BATCH, SEQ_LEN, precision, n, BUCKET_MB, "cpu"),
        accumulation_steps=micro_steps,
        device="cpu",
        deferred_init=deferred,
    )
    return predict(inputs, stage, offload)


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


def measure_single(rank: int, world_size: int, preset: str, stage: int, precision: str) -> dict:
    map_large_blocks()
    return measure_one(preset, world_size, None, stage, precision, deferred=False)


def check(preset: str, rank: int, measured: dict) -> list[str]:
    """One measurement against its prediction: prints the row (parts too), returns what failed."""
    n, stage, precision = measured["n"], measured["stage"], measured["precision"]
    micro_steps, offload, deferred = measured["micro_steps"], measured["offload"], measured["deferred"]
    pred = predicted(preset, n, stage, precision, micro_steps, offload, deferred)
    states_pred = pred.gpu["params"] + pred.gpu["optimizer"] + pred.cpu["total"]
    states_meas = measured["params"] + measured["grads"] + measured["optimizer"] + measured.get("host", 0)
    # padding elements, each carrying params + optimizer bytes (and the host's gradient shard)
    per_elem = 2 * low_precision_bytes(precision) + optimizer_bytes_per_param(precision)
    allowed = 0.01 * states_meas + pred.padding_bytes // low_precision_bytes(precision) * per_elem
    errors = compare(pred.to_dict(), measured)
    peak = errors["peak"]
    label = (f"{preset} N={n} rank {rank} stage {stage}{'+offload' if offload else ''} {precision} ×{micro_steps} "
             f"{'meta' if deferred else 'eager'}")
    parts = "  ".join(f"{part} {errors['peak_' + part]['predicted'] / 2**20:.1f}/"
                      f"{errors['peak_' + part]['measured'] / 2**20:.1f}" for part in pred.peak["parts"])
    print(f"  {label}: states {(states_pred - states_meas) / states_meas:+.3%}, peak "
          f"{peak['predicted'] / 2**20:.1f}/{peak['measured'] / 2**20:.1f} MiB {peak['rel_error']:+.1%} "
          f"({pred.peak['part']}; predicted/measured MiB: {parts})")
    failures = []
    if measured["grads"]:
        failures.append(f"{label}: {measured['grads']} bytes of gradients held after step()")
    if abs(states_pred - states_meas) > allowed:
        failures.append(f"{label}: model states {states_pred} predicted, {states_meas} measured")
    if abs(peak["rel_error"]) > PEAK_TOLERANCE:
        failures.append(f"{label}: peak off by {peak['rel_error']:+.1%} (more than {PEAK_TOLERANCE:.0%})")
    return failures


def run_preset(preset: str, timeout_s: float = 600, sizes: tuple[int, ...] = SIZES) -> None:
    world = max(sizes)
    per_rank = spawn_world(measure_rank, world_size=world, args=(preset, sizes), timeout_s=timeout_s)
    assert [len(results) for results in per_rank] == [
        len(configs(preset)) * sum(rank < n for n in sizes) for rank in range(world)]
    print(f"\nplanner vs engine, {preset} (model states error; peak predicted/measured, worst part):")
    failures = [f for rank, results in enumerate(per_rank) for m in results for f in check(preset, rank, m)]
    assert not failures, "\n".join(failures)


def test_predicted_peak_matches_the_engine_on_gpt_nano():
    run_preset("gpt-nano")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # a hang guard: on two busy cores N = 2 and 3 took over the default 600 s
def test_predicted_peak_matches_the_engine_on_gpt_mini():
    """At N = 2 only: N = 3 put three ranks on CI's two cores and took most of this test's time
    (up to 10 minutes of CI's 90); gpt-nano checks N = 3 through the same prediction code."""
    run_preset("gpt-mini", timeout_s=1400, sizes=(2,))


@pytest.mark.slow
def test_gpt_small_on_one_rank():
    """2 GB of model states and GPT-2's vocabulary: measured once at N=1 (about 30 s)."""
    (measured,) = spawn_world(measure_single, world_size=1, args=("gpt-small", 0, "fp32"), timeout_s=300)
    print()
    failures = check("gpt-small", 0, measured)
    assert not failures, "\n".join(failures)
