"""Count the collectives a system dispatches, per kind, from the c10d ops themselves.

One mechanism for every row of the engine benchmark (DDP, FSDP2, DeepSpeed, zerotrain): a
``TorchDispatchMode`` -- as ``torch.distributed.tensor.debug.CommDebugMode`` is -- that sees each
c10d op (``c10d.allreduce_``, ``c10d._allgather_base_``, ``c10d.reduce_``, ...) and each
functional collective (``_c10d_functional.all_gather_into_tensor``, ...) as it is dispatched,
whichever library called ``torch.distributed``. It records, per kind, the number of calls and the
elements each call moves, and a volume in the convention of zerotrain's ``comm_volume()``: an
all-reduce counts twice its elements, a reduce-scatter its input, an all-gather its output, a
reduce or a broadcast its elements.

[Note: what the mode can and cannot see]
A dispatch mode is thread-local: a collective launched from another Python thread would not be
seen. None of the benchmarked systems launches collectives off the training thread on CPU
(autograd runs a CPU backward on the calling thread), and the zerotrain row shows its own
``comm_volume()`` beside the count as a check. Point-to-point ops (send/recv) and barriers are
counted under their own kinds, each its elements in the volume: zerotrain is the only system here
that sends point to point -- over two Gloo ranks a reduce-scatter is an exchange in which each
rank sends the part of its input the peer owns and receives the peer's part of its own
(``workers/zero/collectives.py``, the note on Gloo's copies) -- and a rank's sends and receives
of one exchange add up to the input it reduces, as a reduce-scatter counts.
"""

from __future__ import annotations

from typing import Any

import torch

#: kinds, in the order the table shows them
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "reduce", "broadcast", "all_to_all", "send", "recv", "other")
#: how many times its elements a kind's call counts in the volume (comm_volume()'s convention)
VOLUME_WEIGHT = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "reduce": 1, "broadcast": 1,
                 "all_to_all": 1, "send": 1, "recv": 1, "other": 0}


def numel(x: Any) -> int:
    """Elements of a tensor, or of the tensors in a (nested) list of them."""
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(numel(y) for y in x)
    return 0


def classify(name: str, args: tuple) -> tuple[str, int] | None:
    """``(kind, elements)`` of one dispatched op, or None when it is not a collective.

    ``name`` is ``str(func)`` (e.g. ``c10d._allgather_base_.default``); ``args`` its positional
    arguments. Elements: the all-gather's output, the reduce-scatter's input, the tensors of an
    all-reduce, reduce or broadcast -- what crosses the wire in a ring's worth of terms.
    """
    functional = name.startswith("_c10d_functional.")
    if not (name.startswith("c10d.") or functional):
        return None
    op = name.split(".")[1]
    if op in ("barrier", "monitored_barrier_"):
        return None
    if functional:
        if op.startswith(("wait_tensor", "_")):  # waits, and helpers such as _wrap_tensor_autograd
            return None
        if "all_gather" in op:  # (input, group_size, group_name): the output is group_size x the input
            return "all_gather", numel(args[0]) * int(args[1])
        if "reduce_scatter" in op:
            return "reduce_scatter", numel(args[0])
        if "all_reduce" in op:
            return "all_reduce", numel(args[0])
        if "broadcast" in op:
            return "broadcast", numel(args[0])
        if "all_to_all" in op:
            return "all_to_all", numel(args[0])
        return "other", numel(args[0]) if args else 0
    # c10d ops take (outputs, inputs, ...) or (tensors, ...)
    if "allgather" in op or "all_gather" in op:
        return "all_gather", numel(args[0])
    if "reduce_scatter" in op:
        return "reduce_scatter", numel(args[1])
    if "allreduce" in op:
        return "all_reduce", numel(args[0])
    if op.startswith("reduce"):
        return "reduce", numel(args[0])
    if op.startswith("broadcast"):
        return "broadcast", numel(args[0])
    if "alltoall" in op:
        return "all_to_all", numel(args[0])
    if op.startswith("send"):
        return "send", numel(args[0])
    if op.startswith("recv"):
        return "recv", numel(args[0])
    return "other", numel(args[0]) if args else 0


class CollectiveCounter:
    """``with counter.mode: ...`` counts the collectives dispatched inside, per kind.

    ``calls[kind]`` and ``elements[kind]``; ``volume`` is the weighted sum (``VOLUME_WEIGHT``).
    """

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.calls: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.elements: dict[str, int] = dict.fromkeys(KINDS, 0)
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen = classify(str(func), args)
                if seen is not None:
                    kind, n = seen
                    counter.calls[kind] += 1
                    counter.elements[kind] += n
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    @property
    def volume(self) -> int:
        return sum(VOLUME_WEIGHT[k] * n for k, n in self.elements.items())

    def report(self) -> dict[str, Any]:
        """The JSON form: the kinds that occurred, with calls and elements, and the volume."""
        kinds = {k: {"calls": self.calls[k], "elements": self.elements[k]} for k in KINDS if self.calls[k]}
        return {"kinds": kinds, "volume": self.volume}


def describe(report: dict[str, Any]) -> str:
    """``AR 1.20M (2) AG 0.60M (3)``-style summary (elements, calls) of ``report()['kinds']`` for the table."""
    short = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "reduce": "R", "broadcast": "B",
             "all_to_all": "A2A", "send": "S", "recv": "Rv", "other": "other"}

    def amount(n: int) -> str:
        return f"{n / 1e6:.2f}M" if n >= 10_000 else f"{n:,}"

    return " ".join(f"{short[k]} {amount(v['elements'])} ({v['calls']})" for k, v in report["kinds"].items()) or "none"


def check_own_volume(own: dict[str, int], report: dict[str, Any]) -> dict[str, Any]:
    """Does a system's own account (zerotrain's ``comm_volume()``) match what was dispatched?

    Compared by what the elements do, not by op name: on Gloo zerotrain runs a reduce-scatter
    as an in-place all-reduce (over two ranks: an exchange, whose sends and receives add up to
    the input) and an all-gather as one broadcast per rank
    (``workers/zero/collectives.py``, the note on Gloo's copies), counted as the collectives
    they stand for. So the reducing elements (all-reduce, reduce-scatter, reduce, sends) must equal
    the account's reduce-scatter plus half its (doubled) all-reduce, and the gathering elements
    (all-gather, broadcast) its all-gather -- each up to its ``control`` messages (the gradient
    norm, the gradient mask, buffer broadcasts, gather tags), which it keeps apart.
    """
    elements = {k: v["elements"] for k, v in report["kinds"].items()}
    reducing = sum(elements.get(k, 0) for k in ("all_reduce", "reduce_scatter", "reduce", "send", "recv"))
    gathering = sum(elements.get(k, 0) for k in ("all_gather", "broadcast"))
    own_reducing = own["reduce_scatter"] + own["all_reduce"] // 2
    slack = own.get("control", 0)
    extra = (reducing - own_reducing) + (gathering - own["all_gather"])
    agrees = reducing >= own_reducing and gathering >= own["all_gather"] and extra <= slack
    return {"agrees": agrees, "reducing": [own_reducing, reducing], "gathering": [own["all_gather"], gathering],
            "control": slack}
