"""This rank's piece of a checkpoint, copied to host memory: the only part that blocks training.

``take_snapshot`` turns the engine's ``state_dict()`` (format ``zerotrain.zero/v1``: fp32
master pieces and optimizer state covering each parameter's ``shard_range``) into

- the tensors of this rank's shard file, named ``params/{name}``, ``optimizer/{name}/{key}``,
  ``frozen/{name}``, ``buffers/{name}``, in their stored dtypes;
- this rank's part of the manifest's ``tensors`` index (one piece per entry; rank 0 merges
  the ranks' pieces);
- rank 0 only: what is the same on every rank (step, stage, hyper-parameters, the
  ``model.state_dict()`` key map, data position, loss scaler);
- the names of the parameters in each optimizer param group, as this rank sees them (rank 0
  merges them into each group's ``param_names``: membership by name survives resharding);
- this rank's RNG states.

[Note: who writes what]
At stage 0 every rank holds the same full state (``shard_world_size == 1``); only rank 0
writes tensors and the others write an empty shard, so the checkpoint holds each value once.
In general rank ``r`` writes tensors iff ``r < shard_world_size``. Frozen parameters and
buffers are identical on every rank (the engine broadcasts them) and live in rank 0's shard.
The same rule covers hybrid sharding (``ZeroConfig.shard_group_size`` G): ``shard_world_size``
is G and rank r holds shard r % G, so ranks 0..G-1 (replica 0) write the one copy of every
shard and the replicas write empty files, as stage 0's ranks do.
"""

from __future__ import annotations

import base64
import datetime as dt
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from storage.manifest import shard_name
from workers.zero.swap_checkpoint import checkpoint_state

from .file_tensor import FileTensor

SAFETENSORS_DTYPE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPE = {v: k for k, v in SAFETENSORS_DTYPE.items()}


@dataclass
class ShardSnapshot:
    step: int
    rank: int
    world_size: int
    file: str
    tensors: dict[str, torch.Tensor | FileTensor]  # shard-file name -> contiguous host tensor, or its bytes on disk
    entries: dict[str, dict]  # shard-file name -> its manifest ENTRY (offsets filled when written)
    index: dict[str, dict]  # {"params": {name: ENTRY}, "optimizer": {name: {key: ENTRY}}, ...}
    values: dict[str, dict[str, Any]]  # non-tensor optimizer state
    rng: dict[str, Any]
    common: Optional[dict[str, Any]] = None  # rank 0 only
    group_names: list[list[str]] = field(default_factory=list)  # this rank's members of each param group
    release: Callable[[], None] = lambda: None  # removes what the FileTensors point at, once written
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())


def _entry(tensor: torch.Tensor, file: str, lo: int, hi: int, shape: list[int], sharded: bool) -> dict:
    return {"dtype": SAFETENSORS_DTYPE[tensor.dtype], "shape": list(shape), "sharded": sharded,
            "pieces": [{"file": file, "range": [lo, hi], "offsets": None}]}


def _host(t: torch.Tensor | FileTensor) -> torch.Tensor | FileTensor:
    if isinstance(t, FileTensor):
        return t
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def take_snapshot(engine: Any, loader: Any, step: int, rank: int, world_size: int,
                  copy: bool = True) -> ShardSnapshot:
    """Copy this rank's state to host memory and describe where each piece will lie.

    ``copy=False`` (the manager's choice when nothing trains until the upload ends: the run's last
    checkpoint) takes the live tensors that are in host memory already instead of copying them,
    so a CPU rank's last checkpoint costs no memory (see the note on the host copy).

    [Note: the host copy]
    The copy is what lets training go on while the shard uploads, and it is the largest transient
    a CPU rank has besides the backward pass: its fp32 master and optimizer state again, (4 + 4K)
    bytes per element of its shard (the planner's ``buffers.snapshot_bytes``). A save that is
    waited for needs none of it; device tensors are copied to the host either way. What an NVMe
    engine keeps in swap files is snapshotted on disk instead, and read in chunks as it is written
    (``workers.zero.swap_checkpoint``: ``FileTensor``s, removed by ``release()``).
    """
    if rank != 0 and rank >= engine.state_dict_meta()["shard_world_size"]:
        return _replica_snapshot(step, rank, world_size)  # stage 0: rank 0 writes the one copy
    # host copies (copy=True): training may continue while they upload
    sd, release = checkpoint_state(engine, copy=copy)
    try:
        return _describe(engine, loader, sd, step, rank, world_size, release)
    except BaseException:
        release()
        raise


def _describe(engine: Any, loader: Any, sd: dict, step: int, rank: int, world_size: int,
              release: Callable[[], None]) -> ShardSnapshot:
    """The snapshot of state dict ``sd``: its shard-file tensors and where each will lie."""
    file = shard_name(rank, world_size)
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    index: dict[str, dict] = {"params": {}, "optimizer": {}, "frozen": {}, "buffers": {}}
    values: dict[str, dict[str, Any]] = {}

    def add(key: str, tensor: torch.Tensor, entry: dict) -> dict:
        tensors[key] = _host(tensor)
        entries[key] = entry
        return entry

    if rank < sd["shard_world_size"]:
        opt_state = sd["optimizer"]["state"]
        for i, name in enumerate(sd["optimizer_params"]):
            meta = sd["params"][name]
            lo, hi = meta["shard_range"]
            master = sd["master"][name]
            index["params"][name] = add(f"params/{name}", master, _entry(master, file, lo, hi, meta["shape"], True))
            for key, value in opt_state.get(i, {}).items():
                if not isinstance(value, (torch.Tensor, FileTensor)):
                    values.setdefault(name, {})[key] = value
                    continue
                sharded = len(value.shape) == 1 and value.numel() == hi - lo
                entry = (_entry(value, file, lo, hi, meta["shape"], True) if sharded
                         else _entry(value, file, 0, value.numel(), list(value.shape), False))
                index["optimizer"].setdefault(name, {})[key] = add(f"optimizer/{name}/{key}", value, entry)
    if rank == 0:
        for section in ("frozen", "buffers"):
            for name, t in sd[section].items():
                index[section][name] = add(f"{section}/{name}", t, _entry(t, file, 0, t.numel(), list(t.shape), False))
    return ShardSnapshot(step=step, rank=rank, world_size=world_size, file=file, tensors=tensors, entries=entries,
                         index=index,
                         values=values, rng=rng_state(),
                         common=_common(engine, loader, sd, step, world_size) if rank == 0 else None,
                         group_names=[list(g.get("param_names", [])) for g in sd["optimizer"]["param_groups"]],
                         release=release)


def _replica_snapshot(step: int, rank: int, world_size: int) -> ShardSnapshot:
    """A rank that holds only replicas: an empty shard file, and its RNG state."""
    index: dict[str, dict] = {"params": {}, "optimizer": {}, "frozen": {}, "buffers": {}}
    return ShardSnapshot(step=step, rank=rank, world_size=world_size, file=shard_name(rank, world_size), tensors={},
                         entries={}, index=index, values={}, rng=rng_state())


def _common(engine: Any, loader: Any, sd: dict, step: int, world_size: int) -> dict[str, Any]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["optimizer"]["param_groups"]]
    return {
        "step": step, "engine_step": sd["step"], "world_size": world_size, "stage": sd["stage"],
        "precision": sd["precision"], "shard_world_size": sd["shard_world_size"], "engine_format": sd["format"],
        "config": sd["config"], "optimizer": {"param_groups": groups}, "loss_scaler": sd["loss_scaler"],
        "model_state_dict": model_state_dict_map(engine.module, frozen=sd["frozen"]),
        "data": loader.state_dict() if loader is not None else None,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(),
    }


def model_state_dict_map(module: torch.nn.Module, frozen: dict[str, Any]) -> list[list[str]]:
    """``[[state_dict key, section, name]]`` in ``module.state_dict()`` order.

    A tied weight is one parameter under several keys: every key maps to the name under which
    the engine stores it (the first in ``named_parameters()``), so a consolidated file has each
    key ``load_state_dict(strict=True)`` expects, holding the same values.
    """
    by_id: dict[int, tuple[str, str]] = {}
    for name, p in module.named_parameters():
        by_id[id(p)] = ("frozen" if name in frozen else "params", name)
    for name, b in module.named_buffers():
        by_id.setdefault(id(b), ("buffers", name))
    out = []
    for key, t in module.state_dict(keep_vars=True).items():
        if id(t) not in by_id:
            raise ValueError(f"state_dict key {key!r} is neither a parameter nor a buffer of the module")
        out.append([key, *by_id[id(t)]])
    return out


# ----------------------------------------------------------------------------- RNG


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def rng_state() -> dict[str, Any]:
    """This process's generator states, JSON-able."""
    state: dict[str, Any] = {"torch": _b64(torch.get_rng_state().numpy().tobytes())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state().numpy().tobytes())
    version, internal, gauss = random.getstate()
    state["python"] = [version, list(internal), gauss]
    np_state = np.random.get_state()
    state["numpy"] = [np_state[0], _b64(np_state[1].tobytes()), int(np_state[2]), int(np_state[3]),
                      float(np_state[4])]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.frombuffer(base64.b64decode(keys), dtype=np.uint32).copy(), pos, has_gauss, cached))
