"""Resharding load: any checkpoint into an engine of any world size and stage.

The target engine says, through ``state_dict_meta()``, which elements ``[a, b)`` of each
flattened parameter its rank holds (its ``shard_range``; the whole parameter at stage 0).
The manifest says where every element of every parameter and every per-parameter optimizer
state tensor lies (file, element range, byte offsets). Reading a rank's shard is therefore
interval intersection plus ranged reads: this rank fetches exactly the bytes of its new
shard, never a whole file. The result is handed to ``engine.load_state_dict`` in the
engine's own format, so the engine stays ignorant of checkpoints and of resharding.

Nothing here depends on how the saving run was sharded (stage, world size, bucket size):
those shaped the pieces, and the pieces are all a reader looks at. A stage-3 engine whose
``state_dict()`` keeps the ``zerotrain.zero/v1`` per-parameter ``shard_range`` contract
loads and saves through this unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from storage.manifest import numel, pieces_for
from .snapshot import TORCH_DTYPE
from storage.storage import Storage

READ_BATCH_BYTES = 64 << 20
log = logging.getLogger(__name__)


@dataclass
class LoadReport:
    bytes_read: int = 0
    requests: int = 0


class _RangeReader:
    """Collects (piece -> destination) copies and runs them as batched ranged reads."""

    def __init__(self, checkpoint: Storage, report: LoadReport):
        self.checkpoint, self.report = checkpoint, report
        self.pending: list[tuple[Any, np.ndarray]] = []
        self.pending_bytes = 0

    def read(self, entry: dict, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``entry``'s flattened tensor (filled at ``flush()``)."""
        out = torch.empty(hi - lo, dtype=TORCH_DTYPE[entry["dtype"]])
        raw = out.view(torch.uint8).numpy()
        size = out.element_size()
        covered = 0
        for piece in pieces_for(entry, lo, hi):
            self.pending.append((piece, raw[piece.out_start * size : piece.out_end * size]))
            self.pending_bytes += piece.end - piece.start
            covered += piece.out_end - piece.out_start
            if self.pending_bytes >= READ_BATCH_BYTES:
                self.flush()
        if covered != hi - lo:
            raise ValueError(f"the checkpoint's pieces cover {covered} of the {hi - lo} elements asked for")
        return out

    def whole(self, entry: dict) -> torch.Tensor:
        return self.read(entry, 0, numel(entry["shape"])).view(entry["shape"])

    def flush(self) -> None:
        if not self.pending:
            return
        blobs = self.checkpoint.read_ranges([(p.file, p.start, p.end) for p, _ in self.pending])
        for (_, dest), blob in zip(self.pending, blobs):
            dest[:] = np.frombuffer(blob, dtype=np.uint8)
        self.report.requests += len(blobs)
        self.report.bytes_read += self.pending_bytes
        self.pending, self.pending_bytes = [], 0


def check_compatible(manifest: dict[str, Any], meta: dict[str, Any]) -> None:
    """The checkpoint and the engine describe the same trainable parameters (names and shapes)."""
    saved = {n: e["shape"] for n, e in manifest["tensors"]["params"].items()}
    wanted = {n: e["shape"] for n, e in meta["params"].items()}
    if saved != wanted:
        missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
        reshaped = sorted(n for n in set(saved) & set(wanted) if saved[n] != wanted[n])
        raise ValueError(f"checkpoint does not fit this model: missing {missing[:5]}, unexpected {extra[:5]}, "
                         f"different shapes {reshaped[:5]}")


def _optimizer_order(meta: dict[str, Any]) -> list[str]:
    """The engine's optimizer order when its meta does not say it: held pieces by bucket, then offset
    (``FlatLayout.pieces``). A meta with ``optimizer_params`` is used as is."""
    return sorted((n for n, e in meta["params"].items() if e["shard_range"] is not None),
                  key=lambda n: (meta["params"][n]["bucket"], meta["params"][n]["offset"]))


def restore_group_hyperparameters(saved: list[dict[str, Any]], groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The engine's param ``groups`` (``state_dict_meta()``'s) with the checkpoint's hyperparameters.

    [Note: which saved group a group continues]
    Membership is by parameter name, so it survives another layout: a group continues the
    saved group its members were in (``param_names``). If the groups correspond one to one,
    each takes its saved group's hyperparameters (lr, weight_decay, betas, lr_scale, ...), as
    ``optimizer.load_state_dict`` would at the same layout. If the grouping rule changed (a
    group mixes members of two saved groups, or two groups split one), no saved group
    describes a group, so every group keeps the hyperparameters the job's factory gave it
    (the per-parameter state is restored either way). A checkpoint without names (an
    older format) is matched by position when the counts agree.
    """
    owner: dict[str, int] = {}
    for j, group in enumerate(saved):
        for name in group.get("param_names") or []:
            owner.setdefault(name, j)
    sources: list[Any] = []
    for group in groups:
        found = {owner[n] for n in group.get("param_names") or [] if n in owner}
        sources.append(found.pop() if len(found) == 1 else (None if not found else "mixed"))
    named = [s for s in sources if s is not None]
    if owner and named and "mixed" not in named and len(set(named)) == len(named):
        pairs = list(zip(groups, sources))
        if any(s is None for s in sources):  # groups without members here: the saved groups left over, in order
            left = iter(j for j in range(len(saved)) if j not in named)
            pairs = [(g, s if s is not None else next(left, None)) for g, s in pairs]
    elif not owner and len(saved) == len(groups):
        pairs = list(zip(groups, range(len(saved))))
    else:
        if saved:
            log.warning("the optimizer's param groups differ from the checkpoint's; they keep the job's "
                        "hyperparameters")
        pairs = [(g, None) for g in groups]
    return [{**g, **({k: v for k, v in saved[j].items() if k not in ("params", "param_names")} if j is not None
                     else {}), "params": g["params"], "param_names": g.get("param_names", [])}
            for g, j in pairs]


def engine_state(checkpoint: Storage, manifest: dict[str, Any], engine: Any) -> tuple[dict[str, Any], LoadReport]:
    """This rank's ``zerotrain.zero/v1`` state dict for ``engine``, read by byte range."""
    meta = engine.state_dict_meta()
    check_compatible(manifest, meta)
    report = LoadReport()
    reader = _RangeReader(checkpoint, report)
    tensors = manifest["tensors"]
    held = meta.get("optimizer_params") or _optimizer_order(meta)
    master, opt_state = {}, {}
    for i, name in enumerate(held):
        lo, hi = meta["params"][name]["shard_range"]
        master[name] = reader.read(tensors["params"][name], lo, hi)
        state: dict[str, Any] = dict(manifest["optimizer"]["values"].get(name, {}))
        for key, entry in tensors["optimizer"].get(name, {}).items():
            state[key] = reader.read(entry, lo, hi) if entry["sharded"] else reader.whole(entry)
        if state:
            opt_state[i] = state
    frozen = {n: reader.whole(e) for n, e in tensors["frozen"].items()}
    buffers = {n: reader.whole(e) for n, e in tensors["buffers"].items()}
    reader.flush()

    groups = restore_group_hyperparameters(manifest["optimizer"]["param_groups"], meta["param_groups"])
    sd = {
        "format": manifest["engine_format"],
        "shard_world_size": meta["shard_world_size"], "shard_rank": meta["shard_rank"],
        "params": meta["params"], "master": master,
        "optimizer": {"state": opt_state, "param_groups": groups},
        "optimizer_params": held,
        "loss_scaler": manifest["loss_scaler"], "frozen": frozen, "buffers": buffers,
        "step": manifest["engine_step"],
    }
    return sd, report
