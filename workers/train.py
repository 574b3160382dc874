"""The per-worker training loop: one job spec in, ``steps`` ZeRO steps and their metrics out.

``train_loop(config, context)`` is what Ray Train's ``TorchTrainer`` runs on every worker (the
process group is already up there), and ``run_local(config, world_size)`` runs the very same
loop on a Gloo world of local processes, without Ray, for tests and quick experiments. What the
runtime owns (which worker group this is, the resize gate) comes in ``context``
(``workers.run_context.RunContext``); nothing here imports a runtime.

``config`` is a ``workers.loop_config.LoopConfig``; the ingest token comes from the environment
(``ZEROTRAIN_INGEST_TOKEN``), never the config.
Rank 0 reports RUNNING (and, on a restarted worker group, RESTARTING first) with the attempt;
every rank pushes its own per-step record. Checkpoints plug in through ``CheckpointHook``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from contract.environment import INGEST_TOKEN_ENV
from contract.job_states import JobState
from contract.reasons import Reason
from contract.spec import MIN_LR_RATIO, JobSpec, TrainSpec, ZeroSpec
from storage.shared import check_marker
from workers.data import ShardedBatchLoader, build_dataset, check_vocabulary
from workers.evaluation import evaluate
from workers.models import build_model, flops_per_token
from workers.host_memory import map_large_blocks
from workers.loop_config import LoopConfig
from workers.loss import StepLoss
from workers.progress import JsonlSink, progress_line, shows_progress
from workers.reporting import MetricReporter, StepMeter, WorkerAPI
from workers.run_context import RunContext
from workers.step_time_start import calibrate_and_report
from workers.user_code import user_code
from workers.user_metrics import COLLECTOR as USER_METRICS
from workers.world import World
from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.planner.check import PeakMemoryMeter
from workers.zero.optim_groups import NamedFactory, below_2d, named_factory, param_groups

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- schedule


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, schedule: str = "cosine",
          min_ratio: float = MIN_LR_RATIO, warmup_type: str = "linear") -> float:
    """LR for 0-based ``step``: warmup to ``lr`` (``train.warmup_type``: linear, or DeepSpeed's log
    ``lr·log(step+1)/log(W)``), then ``schedule`` (``train.schedule``): ``cosine`` or ``linear``
    down to ``min_ratio·lr`` at the last step, or ``constant``."""
    if warmup_steps and step < warmup_steps:
        if warmup_type == "log":  # DeepSpeed's WarmupLR (which counts at least 2 warmup steps)
            return lr * math.log(step + 1) / math.log(max(warmup_steps, 2))
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "constant":
        return lr
    if schedule == "linear":
        return lr * (min_ratio + (1 - min_ratio) * (1 - progress))
    if schedule == "cosine":
        return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    raise ValueError(f"schedule must be cosine, linear or constant, got {schedule!r}")


# ----------------------------------------------------------------------------- checkpoints


class CheckpointHook(Protocol):
    """Where checkpointing plugs into the loop: ``workers.checkpoint.TrainCheckpointHook``, or
    ``NoCheckpoints`` for a job with nowhere to write."""

    def resumes(self) -> bool:
        """Whether ``maybe_resume`` will load a checkpoint (then ``model.init_from`` is not read)."""
        ...

    def maybe_resume(self, engine: ZeroEngine, loader: ShardedBatchLoader) -> int:
        """Restore the latest checkpoint, if any; return the number of completed steps."""
        ...

    def maybe_save(self, step: int, engine: ZeroEngine, loader: ShardedBatchLoader) -> float:
        """Save after completed ``step`` when due (the last step always); return the seconds
        training was blocked. The save is committed in the background."""
        ...

    def save_now(self, step: int, engine: ZeroEngine, loader: ShardedBatchLoader) -> float:
        """Save after completed ``step`` whether due or not (a preemption: ``workers.preemption``);
        ``finish()`` then waits for its commit."""
        ...

    def finish(self) -> float:
        """After the step's record is reported: wait for the save in flight to commit (the run's
        last; or, mid-run, the checkpoint a resize parks at: ``resize_at_checkpoint``)."""
        ...


class NoCheckpoints:
    def resumes(self) -> bool:
        return False

    def maybe_resume(self, engine: ZeroEngine, loader: ShardedBatchLoader) -> int:
        return 0

    def maybe_save(self, step: int, engine: ZeroEngine, loader: ShardedBatchLoader) -> float:
        return 0.0

    def save_now(self, step: int, engine: ZeroEngine, loader: ShardedBatchLoader) -> float:
        return 0.0

    def finish(self) -> float:
        return 0.0


def make_checkpoint_hook(spec: JobSpec, config: LoopConfig, api: WorkerAPI | None,
                         reporter: MetricReporter | None) -> CheckpointHook:
    """The job's checkpoint hook (``workers.checkpoint``); none when there is nowhere to write.
    A save is committed once ``reporter`` has delivered its step's record (``workers.reporting``)."""
    storage_uri = config.storage_uri
    if not (storage_uri or spec.checkpoint.uri):
        return NoCheckpoints()
    from workers.checkpoint import make_checkpoint_hook as checkpoint_hook

    return checkpoint_hook(spec, job_id=config.job_id, storage_uri=storage_uri, api=api,
                           metrics_delivered=reporter.wait_delivered if reporter else None)


# ----------------------------------------------------------------------------- starting


def start_attempt(attempt_base: int, world: World, api: WorkerAPI | None,
                  context: RunContext = RunContext()) -> int:
    """Agree on this worker group's attempt (``attempt_base`` + the worker group's number) and
    tell the control plane it runs.

    Rank 0 decides and reports; the others learn the attempt (or the refusal) by broadcast,
    so a cancelled job stops every rank before the first step.
    """
    outcome: tuple[int, str | None] = (0, None)
    if world.rank == 0:
        group = context.worker_group()  # 1, or 2 and on after the runtime restarted the group
        attempt = attempt_base + group
        outcome = (attempt, None)
        if api is not None:
            try:
                if group > 1:
                    api.post_state(JobState.RESTARTING, attempt=attempt, reason=Reason.WORKER_FAILED,
                                   message=f"Ray Train restarted the worker group (attempt {attempt})")
                api.post_state(JobState.RUNNING, attempt=attempt,
                               message=f"{world.world_size} workers training (attempt {attempt})")
            except Exception as error:  # noqa: BLE001 - every rank must learn about it
                outcome = (attempt, f"{type(error).__name__}: {error}")
    attempt, refusal = world.broadcast(outcome)
    if refusal:
        raise RuntimeError(f"not starting attempt {attempt}: {refusal}")
    return attempt


# ----------------------------------------------------------------------------- engine


def resolve_zero(spec: JobSpec, device: torch.device) -> ZeroSpec:
    """The spec's ``zero`` block, or for ``"auto"`` the planner's choice with this machine's memory
    (``workers.planning.resolved_zero``: stage, offloads, ``nvme_path`` where NVMe is used).

    The control plane resolves "auto" at submit for presets; it reaches a worker only for user
    factories, which are planned here (workers run user code by design).
    """
    if spec.zero.stage != "auto":
        return spec.zero
    from workers.planning import plan_for_spec, resolved_zero

    if device.type == "cuda":
        budget = {"gpu_memory_bytes": torch.cuda.get_device_properties(device).total_memory}
    else:  # CPU workers of one machine share its memory
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget = {"host_memory_bytes": host_bytes // spec.resources.num_workers}
    return resolved_zero(spec.zero, plan_for_spec(spec, **budget))


def build_job_model(spec: JobSpec, *, resuming: bool) -> tuple[torch.nn.Module, Any]:
    """The job's model and the engine's ``init_weights`` for it.

    [Note: which models are built on meta]
    A preset is built on the meta device and materialized bucket by bucket by the engine, so no
    rank holds the whole fp32 model: with no ``init_from`` its ``init_weights`` hook gives the
    same bits as an eager build (one seed, one model); with ``model.init_from`` each rank reads
    the slices it keeps from the file. A factory model is built on meta only with
    ``init_from`` (whatever its own initialization would be, the file replaces it); without, it
    is built eagerly, as always, since user code need not support meta construction. A job
    that resumes (a restarted attempt, ``resume_from``) loads its checkpoint over whatever the
    engine starts from, so ``init_from`` is not read then: the checkpoint wins, and a restart
    does not depend on the pretrained files still being there. An HF model (``model.hf``) is
    always built with its parameters on meta: ``init_from``, or else its own per-module init
    seeded by ``train.seed`` (``workers.hf_models.init_weights_for``).
    """
    init_from = None if resuming else spec.model.init_from
    if spec.model.hf is not None:  # built with its parameters on meta (workers.hf_models)
        from workers.hf_models import init_weights_for

        model = build_model(spec.model)
        return model, init_from if init_from is not None else init_weights_for(model, spec.train.seed)
    if spec.model.preset is None and init_from is None:
        return build_model(spec.model), None
    with torch.device("meta"):
        return build_model(spec.model), init_from


def build_engine(spec: JobSpec, model: torch.nn.Module, device: torch.device,
                 init_weights: Any = None, job_id: str = "job") -> ZeroEngine:
    """The job's ``ZeroEngine``: the spec's ``zero`` block (stage resolved here) and its optimizer;
    a model on meta is materialized on ``device`` from ``init_weights`` (``build_job_model``).
    Swap files (``zero.nvme_path``) go to ``nvme_path/<job_id>/<rank>/``."""
    train = spec.train
    zero = resolve_zero(spec, device)
    nvme_path = None if zero.nvme_path is None else os.path.join(zero.nvme_path, job_id)
    config = ZeroConfig.from_spec(zero, train, nvme_path=nvme_path)
    optimizer = optimizer_factory(train, on_host=config.optimizer_offload is not None)
    if any(p.is_meta for p in model.parameters()):
        buffers_to(model, device)
        return ZeroEngine(model, optimizer=optimizer, config=config, init_weights=init_weights)
    return ZeroEngine(model.to(device), optimizer=optimizer, config=config)


def buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """Move the real buffers of a model whose parameters are on meta to ``device``. An HF model is
    built with its buffers computed for real on the CPU (rotary tables, ``workers.hf_models``); the
    engine computes where a meta model's first real tensor is, which must be the worker's device."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                module._buffers[name] = buffer.to(device)


TORCH_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


#: optimizers whose CPU step has a fused kernel (``fused=True``), used when the step runs on the host
FUSED_ON_HOST = ("adamw", "adam")


def optimizer_factory(train: TrainSpec, on_host: bool = False) -> NamedFactory:
    """The spec's optimizer over named pieces: ``train.weight_decay`` in one group, ``weight_decay=0``
    for parameters with ndim < 2 (``train.no_decay_1d``) or a name matching ``train.no_decay``.

    [Note: the fused host step]
    With optimizer offload (``on_host``) the whole optimizer step runs on the host's fp32 masters
    and is most of an offloaded step's time. torch's CPU default for Adam/AdamW is a per-tensor
    loop; ``fused=True`` is one vectorized kernel per tensor, several times faster and equal to the
    loop up to last-bit rounding (``benchmarks/host_optimizer.py`` measures both), so offload uses
    it. Adam's normalization can grow that rounding to a small fraction of one step on parameters
    whose gradients are near ``eps``: an offloaded job is no longer bit-identical to the same job
    without offload, only close (``tests/workers/test_train_optimizer.py`` bounds it).
    """
    optimizer = TORCH_OPTIMIZERS[train.optimizer]
    rules = ([below_2d] if train.no_decay_1d else []) + list(train.no_decay)
    options = train.optimizer_options()
    if on_host and train.optimizer in FUSED_ON_HOST:
        options["fused"] = True
    return named_factory(lambda pieces: optimizer(param_groups(pieces, weight_decay=train.weight_decay,
                                                               no_decay=rules), lr=train.lr, **options))


# ----------------------------------------------------------------------------- the loop


def train_loop(config: LoopConfig, context: RunContext | None = None) -> dict[str, Any]:
    """Train the job's model for ``train.steps`` steps on this rank; return a short summary.
    ``context``: what the runtime injects (default: one worker group, no resizes)."""
    context = context if context is not None else RunContext()
    spec = JobSpec.model_validate(config.spec)  # this rank's boundary: attributes from here on
    train, data = spec.train, spec.data
    world = World.current(use_gpu=spec.resources.gpus_per_worker > 0)
    token = os.environ.get(INGEST_TOKEN_ENV)
    api = WorkerAPI(config.api_url, config.job_id, token) if config.api_url and token else None
    attempt = start_attempt(config.attempt_base, world, api, context)
    with user_code("checking the job's storage"):  # a node without the shared file:// root: no restart
        check_marker(config.storage_uri, config.job_id, rank=world.rank)
    # an elastic run on Ray: parks at a checkpoint for a resize (runtime/resize_at_checkpoint.py)
    resize_gate = None if context.resize_gate is None else context.resize_gate(world.rank, world.device)
    USER_METRICS.reset()  # from here on, what the user's code reports (factories included) is this run's

    if world.device.type == "cpu":  # freed tensors leave the resident set (workers/host_memory.py)
        map_large_blocks()
    reporter = MetricReporter(api.post_metrics) if api is not None else None
    checkpoints = make_checkpoint_hook(spec, config, api, reporter)
    # a job with checkpoints stops at one when a higher-priority job needs its workers
    preempt = make_preempt_gate(spec, config, world, token) if api is not None and spec.preemptible \
        and not isinstance(checkpoints, NoCheckpoints) else None
    peak = PeakMemoryMeter(world.device)  # the job's peak, part by part, as the planner predicts it
    peak.start()  # what the process held before the model is not the job's
    torch.manual_seed(train.seed)
    with user_code("building the model"):  # an error here is the job's, not the cluster's: no restart
        model, init_weights = build_job_model(spec, resuming=checkpoints.resumes())
        engine = build_engine(spec, model, world.device, init_weights, job_id=config.job_id)
    predicted_time = calibrate_and_report(spec, engine, world, api, attempt)  # rates, predicted step time (rank 0)
    torch.manual_seed(train.seed + world.rank)  # dropout differs per rank
    with user_code("building the data"):  # bad files, rows, fields or tokenizers: the user's to fix
        dataset = build_dataset(data, seed=train.seed, model_dir=spec.model.hf)
        check_vocabulary(dataset, model, where="data")
        eval_data = None
        if spec.eval is not None:
            eval_data = build_dataset(spec.eval.data, seed=train.seed, model_dir=spec.model.hf)
            check_vocabulary(eval_data, model, where="eval.data")
    loader = ShardedBatchLoader(dataset, global_batch_size=train.global_batch_size, prefetch=True,
                                micro_batch_size=train.micro_batch_size, rank=world.rank, world_size=world.world_size)
    seq_len = int(data.seq_len or getattr(getattr(model, "config", None), "block_size", 0))
    meter = StepMeter(rank=world.rank, attempt=attempt,
                      flops_per_token=flops_per_token(model, seq_len),
                      comm_element_bytes=engine.precision.compute_dtype.itemsize, device=world.device,
                      precision=engine.config.precision, world_size=world.world_size)
    sinks: list[Any] = [reporter] if reporter is not None else []
    if config.metrics_path:
        sinks.append(JsonlSink(f"{config.metrics_path}.rank{world.rank}.jsonl"))
    peak.lap("construction")

    total_steps = train.steps
    step = checkpoints.maybe_resume(engine, loader)
    peak.lap("resume" if step else "construction")
    first_step = step + 1  # of this attempt: an error in it is the user's code (user_code.py)
    accumulation = loader.accumulation_steps
    token_weighted = spec.model.factory is None  # the loop's own loss (workers/loss.py), not the factory's
    losses: list[float] = []
    preempted_at: int | None = None
    try:
        while step < total_steps:
            lr = lr_at(step, lr=train.lr, warmup_steps=train.warmup_steps, total_steps=total_steps,
                       schedule=train.schedule, min_ratio=train.min_lr_ratio, warmup_type=train.warmup_type)
            for group in engine.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            started = time.perf_counter()
            with user_code("the first training step") if step + 1 == first_step else contextlib.nullcontext():
                micro_batches = loader.next_batch()
                step_loss = StepLoss(micro_batches, token_weighted=token_weighted,
                                     world_size=world.world_size, device=world.device)
                for micro, (inputs, targets) in enumerate(micro_batches):
                    inputs = inputs.to(world.device, non_blocking=True)
                    targets = targets.to(world.device, non_blocking=True)
                    output = engine(inputs) if token_weighted else engine(inputs, targets)
                    loss = step_loss.micro_loss(output, targets)
                    peak.lap("forward")
                    # the engine sums micro-steps, like PyTorch; sync on the last one lets stages 0/1
                    # reduce during that backward instead of after it
                    engine.backward(loss, sync=micro == accumulation - 1)
                    peak.lap("backward")
                info = engine.step()
                peak.lap("step")
            loss_value = step_loss.value()  # .item() waits for the device
            step_time = time.perf_counter() - started
            step += 1
            blocked = checkpoints.maybe_save(step, engine, loader)
            if blocked:
                peak.lap("checkpoint")
            eval_loss = None  # an evaluation's forward passes count in the next lap, the forward's
            if eval_data is not None and spec.eval.due(step, total_steps):
                eval_loss = evaluate(engine, eval_data, batches=spec.eval.batches,
                                     micro_batch_size=train.micro_batch_size, world=world,
                                     token_weighted=token_weighted)
            samples = accumulation * loader.micro_batch_size
            record = meter.record(step=step, loss=loss_value, lr=lr, step_time_s=step_time, samples=samples,
                                  tokens=samples * seq_len, info=info, memory=engine.step_memory(),
                                  peak_memory_bytes=peak.peak_growth(), comm_volume=engine.comm_volume(),
                                  comm_bytes=engine.comm_volume("bytes")["total"],
                                  checkpoint_blocked_s=blocked, eval_loss=eval_loss, user=USER_METRICS.take())
            losses.append(loss_value)
            for sink in sinks:
                sink.report(record)
            # an evaluation is rare and costly enough to be worth its line
            if world.rank == 0 and (shows_progress(step, total_steps) or eval_loss is not None):
                print(progress_line(record, total_steps, world.world_size), flush=True)
            if resize_gate is not None and blocked and step < total_steps:
                if preempt is not None and preempt.cap()[0]:
                    resize_gate.keep_cap(preempt.cap()[1])
                resize_gate.at_checkpoint(step, wait_commit=checkpoints.finish)
            if preempt is not None and preempt.should_stop(step, saved=bool(blocked), step_time_s=step_time):
                if preempt.shrink_to is not None and resize_gate is not None:
                    shrink_for_preemption(step, bool(blocked), preempt, resize_gate, checkpoints, engine, loader,
                                          world, api)
                    continue  # a group already as small as asked trains on
                preempted_at = stop_for_preemption(step, bool(blocked), preempt, checkpoints, engine, loader,
                                                   world, api)
                break
        if checkpoints.finish():  # the last save, committed once its step's record is delivered
            peak.lap("checkpoint")
    finally:
        loader.close()
        if preempt is not None:
            preempt.close()
        unsent = sum(sink.close(timeout_s=120.0) for sink in sinks)
        if api is not None:
            api.close()
    if unsent:
        raise RuntimeError(f"{unsent} metric records could not be delivered to the control plane")
    if preempted_at is None:  # a preempted attempt's peak is not the run's
        report_measured_memory(config, world, attempt, {**engine.step_memory(), **peak.report()})
    summary = {"rank": world.rank, "attempt": attempt, "losses": losses, "memory": engine.step_memory(),
               "preempted_at": preempted_at, "comm_volume": engine.comm_volume(), "stage": engine.config.stage,
               "group_lrs": [group["lr"] for group in engine.optimizer.param_groups], "step_time": predicted_time,
               "construction_io": engine.construction_io()}  # NVMe: the shards written as built, apart from step 1
    # Only on the way out of a run that succeeded: close() is collective (a barrier), and after a
    # training error a peer may be gone -- the error propagates untouched, as it always did.
    engine.close()
    return summary


def make_preempt_gate(spec: JobSpec, config: LoopConfig, world: World, token: str) -> Any:
    """This rank's ``workers.preemption.PreemptGate``; rank 0's polls the control plane."""
    from workers.preemption import PreemptGate, PreemptionWatch

    watch = None
    if world.rank == 0:
        poller = WorkerAPI(config.api_url, config.job_id, token)
        watch = PreemptionWatch(poller.get_preemption, on_close=poller.close)
    return PreemptGate(rank=world.rank, device=world.device, watch=watch,
                       every_steps=spec.checkpoint.every_steps, total_steps=spec.train.steps)


def stop_for_preemption(step: int, saved: bool, preempt: Any, checkpoints: CheckpointHook, engine: ZeroEngine,
                        loader: ShardedBatchLoader, world: World, api: WorkerAPI) -> int:
    """Every rank: save at ``step`` unless it just did, wait for the commit; rank 0 reports the
    job preempted (it queues again). Returns ``step``."""
    if not saved:
        checkpoints.save_now(step, engine, loader)
    checkpoints.finish()
    if world.rank == 0:
        print(f"preempted at the checkpoint of step {step} to make room for job {preempt.for_job()}", flush=True)
        api.post_preempted(step)
    return step


def shrink_for_preemption(step: int, saved: bool, preempt: Any, resize_gate: Any, checkpoints: CheckpointHook,
                          engine: ZeroEngine, loader: ShardedBatchLoader, world: World, api: WorkerAPI) -> None:
    """Every rank: save at ``step`` unless it just did; the group shrinks to ``preempt.shrink_to``
    workers from that checkpoint (``ResizeGate.shrink``: Ray replaces this group, or one already
    that small trains on); rank 0 reports it."""
    if not saved:
        checkpoints.save_now(step, engine, loader)
    workers = preempt.shrink_to
    preempt.shrunk()

    def report() -> None:  # a report that fails is made again by the smaller group's rank 0, still asked
        try:
            api.post_shrunk(step, workers)
        except Exception as error:  # noqa: BLE001 - the shrink goes on: Ray replaces the parked group
            log.warning("could not report the shrink to %s workers at step %s: %s", workers, step, error)

    resize_gate.shrink(step, workers, world.world_size, wait_commit=checkpoints.finish, report=report)


def report_measured_memory(config: LoopConfig, world: World, attempt: int, measured: dict[str, float]) -> None:
    """Rank 0 sends every rank's ``engine.step_memory()`` and peak growth (``peak``, and ``peak_<part>``
    for each part of the job: ``PeakMemoryMeter.report``) once, at the end of the run, so the
    control plane can check the planner's prediction term by term and part by part."""
    ranks = [measured]
    if world.world_size > 1:
        ranks = [None] * world.world_size
        dist.all_gather_object(ranks, measured)
    token = os.environ.get(INGEST_TOKEN_ENV)
    if world.rank != 0 or not (config.api_url and token):
        return
    api = WorkerAPI(config.api_url, config.job_id, token)
    try:
        api.post_memory(attempt, [{k: float(v) for k, v in r.items()} for r in ranks])
    except Exception as error:  # noqa: BLE001 - a missing check must not fail a finished training
        log.warning("could not report measured memory: %s", error)
    finally:
        api.close()


# ----------------------------------------------------------------------------- without Ray


def _local_rank_entry(rank: int, world_size: int, config: LoopConfig) -> dict[str, Any]:
    return train_loop(config)


def run_local(config: LoopConfig, world_size: int) -> list[dict[str, Any]]:
    """Run ``train_loop`` on a fresh local Gloo world of ``world_size`` processes; per-rank summaries."""
    from workers.zero.testing import spawn_world

    return spawn_world(_local_rank_entry, world_size=world_size, args=(config,))
