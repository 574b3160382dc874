"""The cross-field rules of the ``zero`` block, written once and torch-free.

``ZeroSpec`` (contract/spec.py) calls them at submit, so a broken combination is a 422 naming
the field (``zero.offload_optimizer``); the engine's ``ZeroConfig`` (workers/zero/config.py)
calls the same functions and raises ``ValueError`` with the same sentence. A rule added here
is enforced on both sides.

[Note: rules that depend on the stage, and ``stage: "auto"``]
A rule such as "offload_optimizer needs stage 1-3" cannot be checked against ``"auto"``: the
planner picks the stage later. Instead of refusing such a spec, ``allowed_stages`` tells the
planner which stages the other fields leave open, and the planner only chooses among them
(``workers/planning.py``). So ``{stage: "auto", keep_gathered_bytes: 1e9}`` resolves to stage 3
and ``{stage: "auto", offload_optimizer: true}`` to stage 1-3, and a fixed stage the other
fields forbid is refused at submit. No combination is refused for "auto" that some stage runs.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from contract.zero_math import STAGES, stage_traits


class ZeroRuleBroken(ValueError):
    """One broken rule: the spec field it names (``zero.offload_optimizer``) and the sentence."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def _needs(stage: int, offload_optimizer: bool, keep_gathered_bytes: int, offload_params: str | None,
           quantized_weights: bool, quantized_gradients: bool,
           hpz_partition_size: int | None = None) -> ZeroRuleBroken | None:
    traits = stage_traits(stage)
    if hpz_partition_size is not None and not traits.shards_parameters:
        return ZeroRuleBroken("zero.hpz_partition_size", f"hpz_partition_size (ZeRO++'s hpZ) needs stage 3 (it keeps "
                                                         f"a secondary partition of stage 3's gathered parameters); "
                                                         f"got stage={stage}")
    for name, on in (("quantized_weights", quantized_weights), ("quantized_gradients", quantized_gradients)):
        if on and not traits.shards_parameters:  # ZeRO++ is a stage-3 feature, as DeepSpeed's
            return ZeroRuleBroken(f"zero.{name}", f"{name} (ZeRO++) needs stage 3 (it quantizes stage 3's "
                                                  f"parameter all-gather and gradient reduce-scatter); got "
                                                  f"stage={stage}")
    if offload_params is not None and not traits.shards_parameters:
        return ZeroRuleBroken("zero.offload_params",
                              f"offload_params needs stage 3 (only stage 3 shards the parameters); got stage={stage}")
    if offload_optimizer and not traits.shards_optimizer:
        return ZeroRuleBroken("zero.offload_optimizer",
                              f"offload_optimizer needs stage 1, 2 or 3 (stage {stage} keeps the whole optimizer "
                              f"on every rank); got stage={stage}")
    if keep_gathered_bytes and not traits.shards_parameters:
        return ZeroRuleBroken("zero.keep_gathered_bytes",
                              f"keep_gathered_bytes needs stage 3 (only stage 3 gathers parameters for a "
                              f"forward); got stage={stage}")
    return None


def check_stage_fields(stage: int | str, offload_optimizer: bool, keep_gathered_bytes: int,
                       offload_params: str | None, *, quantized_weights: bool, quantized_gradients: bool,
                       hpz_partition_size: int | None = None) -> None:
    """Raise ``ZeroRuleBroken`` when ``stage`` cannot run with the other fields; ``"auto"`` passes
    when some stage can (``allowed_stages`` then limits the planner's choice)."""
    if stage == "auto":
        if not allowed_stages(offload_optimizer, keep_gathered_bytes, offload_params=offload_params,
                              quantized_weights=quantized_weights, quantized_gradients=quantized_gradients,
                              hpz_partition_size=hpz_partition_size):  # pragma: no cover - every rule leaves 3
            raise ZeroRuleBroken("zero.stage", "no ZeRO stage runs with these zero fields")
        return
    broken = _needs(stage, offload_optimizer, keep_gathered_bytes, offload_params, quantized_weights,
                    quantized_gradients, hpz_partition_size)
    if broken is not None:
        raise broken


def allowed_stages(offload_optimizer: bool, keep_gathered_bytes: int,
                   stages: Sequence[int] = STAGES, *, offload_params: str | None, quantized_weights: bool,
                   quantized_gradients: bool, hpz_partition_size: int | None = None) -> tuple[int, ...]:
    """The stages among ``stages`` that run with these fields: what ``"auto"`` may resolve to."""
    return tuple(s for s in stages if _needs(s, offload_optimizer, keep_gathered_bytes, offload_params,
                                             quantized_weights, quantized_gradients, hpz_partition_size) is None)


#: ``zero.offload_optimizer``'s values: False, True and "cpu" (host memory; True is "cpu") or "nvme" (swap files)
OFFLOAD_OPTIMIZER = (False, True, "cpu", "nvme")


def offload_target(offload_optimizer: bool | str) -> str | None:
    """Where ``offload_optimizer`` keeps the optimizer state: None (with the parameters), "cpu" or "nvme"."""
    if offload_optimizer is True:
        return "cpu"
    return offload_optimizer or None


#: ``zero.offload_params``'s values (stage 3): None (the shard in device memory), "cpu" (host memory)
#: or "nvme" (swap files under ``nvme_path``)
OFFLOAD_PARAMS = (None, "cpu", "nvme")


def check_nvme_path(offload_optimizer: bool | str, nvme_path: str | None,
                    offload_params: str | None, stage: int | str) -> None:
    """``zero.nvme_path`` is an absolute folder, given exactly when some state goes to "nvme" or
    when ``stage`` is "auto": there it is the folder the planner may put the state in when
    nothing fits in memory (``workers/planning.py``, [Note: "auto" on NVMe])."""
    if offload_params == "nvme" and nvme_path is None:
        raise ZeroRuleBroken("zero.offload_params", "offload_params 'nvme' needs nvme_path, the local folder "
                                                    "of the swap files (on a fast disk of every worker node)")
    nvme = offload_target(offload_optimizer) == "nvme"
    if nvme and nvme_path is None:
        raise ZeroRuleBroken("zero.nvme_path", "offload_optimizer 'nvme' needs nvme_path, the local folder "
                                               "of the swap files (on a fast disk of every worker node)")
    if not nvme and offload_params != "nvme" and nvme_path is not None and stage != "auto":
        raise ZeroRuleBroken("zero.nvme_path", "nvme_path is read with offload_optimizer or offload_params "
                                               "'nvme', or with stage 'auto' (where nothing fits in memory); "
                                               f"got offload_optimizer={offload_optimizer!r}, "
                                               f"offload_params={offload_params!r}")
    if nvme_path is not None and not nvme_path.startswith("/"):
        raise ZeroRuleBroken("zero.nvme_path", f"nvme_path must be an absolute path; got {nvme_path!r}")


def check_hpz_groups(hpz_partition_size: int | None, shard_group_size: int | None) -> None:
    """``zero.hpz_partition_size`` (ZeRO++'s hpZ groups of contiguous ranks) lies within one shard
    group: with hybrid sharding it must divide ``shard_group_size`` (the world sizes are
    ``hpz_misfits``'s)."""
    if hpz_partition_size is not None and shard_group_size is not None and shard_group_size % hpz_partition_size:
        raise ZeroRuleBroken("zero.hpz_partition_size", f"hpz_partition_size ({hpz_partition_size}) must divide "
                                                        f"shard_group_size ({shard_group_size}): each hpZ group of "
                                                        "contiguous ranks lies within one shard group")


def hpz_misfits(hpz_partition_size: int | None, world_sizes: Iterable[int]) -> list[int]:
    """The world sizes that ``hpz_partition_size`` does not split into whole hpZ groups (a size
    above the world's never does)."""
    if hpz_partition_size is None:
        return []
    return [n for n in world_sizes if n % hpz_partition_size]


def shard_group_misfits(shard_group_size: int | None, world_sizes: Iterable[int]) -> list[int]:
    """The world sizes that ``shard_group_size`` does not split into whole groups of contiguous ranks."""
    if shard_group_size is None:
        return []
    return [n for n in world_sizes if n % shard_group_size]
