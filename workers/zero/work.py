"""What the collectives hand back and count: ``Pending`` (a launched collective, waited once),
the work objects it may wrap (a CUDA side stream's, several as one, one then a local step),
and ``CommCounter`` (elements sent, time blocked). ``collectives.py`` makes them; the stages
hold and wait ``Pending``s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements (what a collective of it puts on the wire, per copy)."""
    return tensor.numel() * tensor.element_size()


@dataclass
class CommCounter:
    """Elements passed to collectives, the bytes that carried them (and time blocked on them)
    since the last ``reset``.

    Elements count what a collective stands for (a quantized all-gather of Φ parameters counts
    Φ); ``nbytes`` what it actually put on the wire per kind, in the same convention (an
    all-gather its output, a reduce-scatter its input, an all-reduce twice): int8 codes and
    their fp32 scales under ZeRO++'s quantization (``quantized_comm.py``), else elements times
    the element size.
    """

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0  # already doubled
    control: int = 0  # scalars/masks; not part of "total"
    inter_group: int = 0  # of the above (not control): across shard groups (hybrid sharding, ``hybrid.py``)
    exposed_s: float = 0.0
    calls: int = 0
    nbytes: dict = field(default_factory=dict)  # kind -> bytes, the kinds above
    groups: dict = field(default_factory=dict)  # group -> kind -> bytes (``by_group``)

    def add(self, kind: str, elements: int, nbytes: int, group: Optional[str] = None) -> None:
        """Count ``elements`` under ``kind`` and ``nbytes`` bytes that carried them; also under
        ``group``, the process group they were sent over, when given."""
        setattr(self, kind, getattr(self, kind) + elements)
        self.nbytes[kind] = self.nbytes.get(kind, 0) + nbytes
        if group is not None:
            per_kind = self.groups.setdefault(group, {})
            per_kind[kind] = per_kind.get(kind, 0) + nbytes

    def by_group(self) -> dict:
        """Bytes by the process group they were sent over and by kind: ``"world"`` (the whole
        data-parallel world), ``"shard"`` and ``"replicate"`` (hybrid sharding, ``hybrid.py``),
        ``"hpz"`` (ZeRO++'s hpZ groups, ``hpz.py``)."""
        return {group: dict(kinds) for group, kinds in self.groups.items()}

    def snapshot(self, unit: str = "elements") -> dict:
        """The counts by kind: ``unit`` "elements" (``comm_volume()``'s historical unit) or "bytes"."""
        if unit == "elements":
            c = {k: getattr(self, k) for k in ("all_gather", "reduce_scatter", "all_reduce", "control", "inter_group")}
        elif unit == "bytes":
            c = {k: self.nbytes.get(k, 0) for k in ("all_gather", "reduce_scatter", "all_reduce", "control",
                                                    "inter_group")}
        else:
            raise ValueError(f"unit must be 'elements' or 'bytes', got {unit!r}")
        total = c["all_gather"] + c["reduce_scatter"] + c["all_reduce"]
        return {"all_gather": c["all_gather"], "reduce_scatter": c["reduce_scatter"], "all_reduce": c["all_reduce"],
                "total": total, "control": c["control"], "intra_group": total - c["inter_group"],
                "inter_group": c["inter_group"]}


@dataclass
class Pending:
    """A launched collective. ``wait()`` once; the result is valid afterwards."""

    work: Optional[object]
    label: str
    seq: int
    owner: Any  # the Collectives that launched it: its _timed_wait times the wait
    done: bool = False
    tensors: tuple = field(default_factory=tuple)  # kept alive until waited on
    watch: Optional[int] = None  # the watchdog's token (watchdog.py, the note on the watchdog)

    def is_completed(self) -> bool:
        return self.done or self.work is None or self.work.is_completed()

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        if self.work is not None:
            self.owner._timed_wait(self.work, self.watch)
        self.tensors = ()

    def let_go(self) -> None:
        """Drop the work unwaited (``teardown.release_dead_groups``, at exit, its group destroyed): its
        handle holds the Gloo context, whose transport thread would outlive the group; the group's
        destructor still lets the work finish. A later ``wait()`` returns at once."""
        self.work, self.tensors, self.done = None, (), True


class _StreamWork:
    """A collective queued on a CUDA side stream: complete when the event after it is; ``wait()``
    makes the compute stream wait for it (collectives.py, the note on CUDA streams)."""

    def __init__(self, event: "torch.cuda.Event", device: torch.device):
        self.event = event
        self.device = device

    def is_completed(self) -> bool:
        with torch.cuda.device(self.device):  # the watchdog's thread asks too
            return self.event.query()

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


class _Then:
    """Works waited on as one, then a local step on their result, once (a two-rank exchange's sum)."""

    def __init__(self, works, then: Callable[[], object]):
        self.works = list(works)
        self.then: Optional[Callable[[], object]] = then

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        if self.then is not None:
            then, self.then = self.then, None
            then()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class _AllOf:
    """Several works waited on as one (a tag gather and the gather it describes; broadcasts)."""

    def __init__(self, works):
        self.works = list(works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)
