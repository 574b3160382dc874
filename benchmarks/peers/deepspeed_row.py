"""DeepSpeed ZeRO-1/2/3 as rows of the engine benchmark (``make bench`` installs DeepSpeed).

The same GPT, seed, batches and optimizer as every other row: a torch ``AdamW`` with the same
hyper-parameters, handed to ``deepspeed.initialize`` with ``zero_allow_untested_optimizer``
(DeepSpeed's own fused CPU Adam would be a different optimizer, and needs compiled ops). On
CPU, DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) runs over the Gloo world the benchmark
already initialised (``deepspeed.init_distributed(dist_backend="gloo")`` finds it and keeps it).

Rows (``ROWS``): ``ds1``/``ds2``/``ds3`` with DeepSpeed's defaults, and ``ds1-reduce``/``ds2-reduce``
with ``use_multi_rank_bucket_allreduce: false``, and ``ds3-nvme``: ZeRO-3 with ``offload_optimizer`` and
``offload_param`` on ``device: nvme`` under ``--nvme-dir`` (its ``async_io`` op is built on first use:
libaio's headers and a compiler). [Note: why the variant] With the default
``true``, ZeRO-1/2 all-reduce every gradient bucket (2Φ) and then all-gather the updated
partitions (Φ): 3Φ per step; ``false`` reduces each partition to its owner instead (Φ), 2Φ in
all -- the ZeRO paper's schedule, and what zerotrain's stages 1/2 do with a reduce-scatter.
Bucket sizes follow ``--bucket-mb`` as for DDP and zerotrain (DeepSpeed counts elements).
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch

from benchmarks.runner import Runner, tensor_bytes

ROWS: dict[str, str] = {
    "ds1": "DeepSpeed ZeRO-1",
    "ds1-reduce": "DeepSpeed ZeRO-1, multi-rank AR off",
    "ds2": "DeepSpeed ZeRO-2",
    "ds2-reduce": "DeepSpeed ZeRO-2, multi-rank AR off",
    "ds3": "DeepSpeed ZeRO-3",
    "ds3-nvme": "DeepSpeed ZeRO-3, optimizer + params on NVMe",
}
DEFAULT_ROWS = [row for row in ROWS if not row.endswith("-nvme")]  # ds3-nvme needs --nvme-dir and DeepSpeed's aio op
#: DeepSpeed's aio settings for ds3-nvme: zerotrain's swap I/O (1 MiB blocks, eight in flight)
AIO = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False, "overlap_events": True}
#: what ``make bench`` installs; the rows say "n/a" with this hint when DeepSpeed is missing
INSTALL_HINT = "deepspeed is not installed (make bench installs it)"


def prepare_environment(rank: int, world_size: int) -> None:
    """Before DeepSpeed is imported: its CPU accelerator, and the launcher variables it reads."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_SIZE=str(world_size))


def ds_config(row: str, args: dict) -> dict[str, Any]:
    """The DeepSpeed config of ``row``: its ZeRO stage, defaults otherwise, buckets of --bucket-mb."""
    if row not in ROWS:
        raise ValueError(f"unknown DeepSpeed row {row!r}; choose from {list(ROWS)}")
    stage = int(row[2])
    element_bytes = 2 if args["precision"] == "bf16" else 4
    bucket = int(args["bucket_mb"] * 2**20 / element_bytes)
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket}
    if stage < 3:
        zero["allgather_bucket_size"] = bucket
    if row.endswith("-reduce"):
        zero["use_multi_rank_bucket_allreduce"] = False
    if row.endswith("-nvme"):  # ZeRO-Infinity: its own folder under --nvme-dir, the torch AdamW kept
        path = os.path.join(args["nvme_dir"], f"deepspeed-{os.getpid()}")
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "pin_memory": False}
        zero["offload_param"] = {"device": "nvme", "nvme_path": path, "pin_memory": False}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args["micro_batch"],
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # zerotrain rows run with grad_clip=None, DDP/FSDP2 clip nothing
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if row.endswith("-nvme"):
        config.update(aio=AIO, zero_force_ds_cpu_optimizer=False)
    if args["precision"] == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _tensors_held(obj: Any, depth: int, seen: set[int]) -> list[torch.Tensor]:
    """Tensors reachable from ``obj`` through containers and DeepSpeed's own objects' attributes."""
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif type(obj).__module__.startswith("deepspeed") and hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return []
    out: list[torch.Tensor] = []
    for item in items:
        out.extend(_tensors_held(item, depth - 1, seen))
    return out


def prewarm(rows: list[str], args: dict, device: torch.device) -> None:
    """Load DeepSpeed's code before any row's meter starts: one step of a 1-block GPT per stage in ``rows``.

    Importing DeepSpeed, its CPU accelerator's shared-memory op and what ``deepspeed.initialize``
    and a ZeRO stage's first step import lazily make tens of MiB of resident pages (measured:
    ~48 MiB on a 42k-parameter model, whatever the bucket size) that belong to no row; they
    would otherwise land in the peak of whichever DeepSpeed row is built first. The benchmark
    does the same for torch (``_prewarm``).
    """
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return  # the rows say so themselves
    from workers.models import GPT, GPTConfig

    for row in dict.fromkeys(f"ds{r[2]}" for r in rows if r in ROWS):
        torch.manual_seed(12345)
        tiny = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)).to(device)
        runner = DeepSpeedRunner(row, tiny, {**args, "micro_batch": 2}, device)
        idx = torch.randint(0, 64, (2, 16), device=device)
        runner.step(idx, idx, measure=True)
        runner.engine.destroy()
        del runner, tiny, idx


class DeepSpeedRunner(Runner):
    """A DeepSpeed engine at one ZeRO stage; ``measured`` its model state per rank.

    [Note: model state of a DeepSpeed row]
    DeepSpeed keeps its gradient partitions only between backward and ``step()`` (it frees them
    in step), so the state is taken twice on the measured step -- after backward and after step
    -- and each group is the larger of the two: ``params`` the module's parameters (stage 3:
    their ``ds_tensor`` partitions, and whole parameters under the persistence threshold),
    ``grads`` their ``.grad`` and the fp32 gradient partitions, ``optimizer`` the master fp32
    partitions the torch optimizer steps and its state; ``buffers`` (apart, as zerotrain's) every
    other tensor DeepSpeed's ZeRO optimizer holds (reduce buckets, contiguous gradient buffers).
    Shared storage counts once, in the first group that holds it.
    """

    def __init__(self, row: str, model: torch.nn.Module, args: dict, device: torch.device):
        try:
            import deepspeed
        except ImportError as exc:
            raise RuntimeError(INSTALL_HINT) from exc
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl")
        self.stage, self.row, self.args = int(row[2]), row, args
        optimizer = torch.optim.AdamW(model.parameters(), lr=args["lr"], weight_decay=0.1)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(row, args))
        self.measured: dict[str, int] = {}
        self.buffers = 0

    def close(self) -> None:
        """DeepSpeed leaves its NVMe swap folder behind: ds3-nvme removes it."""
        path = ds_config(self.row, self.args)["zero_optimization"].get("offload_param", {}).get("nvme_path")
        if path:
            shutil.rmtree(path, ignore_errors=True)

    def step(self, x, y, measure):
        loss = self.engine(x, y)
        self.engine.backward(loss)
        after_backward = self._state() if measure else None
        self.engine.step()
        if measure:
            after_step = self._state()
            self.measured = {k: max(after_backward[k], after_step[k]) for k in ("params", "grads", "optimizer")}
            self.measured["total"] = sum(self.measured.values())
            self.buffers = max(after_backward["buffers"], after_step["buffers"])
        return float(loss.detach()), None

    def _state(self) -> dict[str, int]:
        zero = self.engine.optimizer  # DeepSpeed's ZeRO optimizer, wrapping the torch AdamW
        base = getattr(zero, "optimizer", zero)
        module_params = list(self.engine.module.parameters())
        params = [getattr(p, "ds_tensor", None) for p in module_params] + module_params
        masters = [p for group in base.param_groups for p in group["params"]]
        grads = [p.grad for p in module_params + masters]
        for name in ("averaged_gradients", "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"):
            grads.extend(_tensors_held(getattr(zero, name, None), 3, set()))
        opt_state = [v for state in base.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        held = _tensors_held(zero, 4, set())
        return tensor_bytes({"params": params, "grads": grads, "optimizer": masters + opt_state, "buffers": held})
