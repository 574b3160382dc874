"""Stage 3's divergence check: every rank's gathers and reduce-scatters as tags, compared in order.

``ParamShardStrategy`` (``stage3.py``) sends a ``Ledger`` tag with every gather and checks the
tags every rank sent, so ranks running different units raise one clear error instead of
training on a mix of shards.

[Note: divergence check]
Ranks that run different units at the same point (rank 0 ``linears[0]``, rank 1 ``linears[1]``)
issue gathers that match in count and size, so the collectives "succeed" and every rank trains
on a mix of both units' shards. So every gather is preceded, on the same stream and group, by
an all-gather of a 6-element int64 tag (``collectives.tagged_all_gather``): the step, the
gather's number in the step, the unit, and the reduce-scatters issued so far in the step (count,
last unit, an order-sensitive digest). After the collective every rank holds every rank's tag,
so every rank finds the same first disagreement and raises the same error, naming the unit each
rank wanted -- after waiting for everything it has in flight, so no collective is left
half-issued. Tags are compared in issue order (``Ledger.check``), so an unchecked stale
prefetch is checked by the next wait. The backward's reduce-scatters are covered by the digest
in the next gather's tag and by one tag-only gather when backward ends, checked by the next
micro-step or by ``step()`` before the optimizer sees a gradient. Cost: one extra small
collective per gather (launched with it, waited with it) and one per micro-step, counted under
``control``; the step's volume stays 3Φ. A CPU rank checks each tag when its gather is waited;
a CUDA rank would have to synchronize to read one, so it checks them all in ``step()`` (one
synchronization, which ``step()``'s norm message makes anyway) -- still before any update.
Units of different sizes gathered at the same point are not caught before the gather runs
(the tag travels with it, not ahead of it, to keep the prefetch overlap): Gloo aborts the
process on such a gather (SIGABRT), NCCL hangs or fails; silent only when the sizes agree,
which is what the tag catches.
"""

from __future__ import annotations

from typing import Optional

import torch

from .collectives import Pending


_RULE = (" -- every rank must run the same units in the same order, evaluation forwards included "
         "(docs/engine.md, \"Stage 3\"); this engine cannot continue")

#: how many gathers a CUDA rank lets go unchecked before it synchronizes to check them
MAX_UNCHECKED = 256


class Ledger:
    """What this rank gathered and reduce-scattered, in order: the tags of the divergence check.

    A tag is ``[step, gather number in the step, unit, reduce-scatters so far in the step, the
    last one's unit, an order-sensitive digest of them all]`` (the note on the divergence check).
    """

    def __init__(self, names: list[str], device: torch.device):
        self.names = names
        self.device = device
        self.defer = device.type == "cuda"  # reading a tag on the host would synchronize: check at step()
        self.step, self.gathers = 1, 0
        self.rs_count, self.rs_last, self.rs_digest = 0, -1, 0
        self.unchecked: list[tuple[Pending, torch.Tensor]] = []  # issue order

    def tag(self, unit: int) -> torch.Tensor:
        return torch.tensor([self.step, self.gathers, unit, self.rs_count, self.rs_last, self.rs_digest],
                            dtype=torch.int64, device=self.device)

    def next_gather(self, unit: int) -> torch.Tensor:
        self.gathers += 1
        return self.tag(unit)

    def reduce_scattered(self, unit: int) -> None:
        self.rs_count += 1
        self.rs_last = unit
        self.rs_digest = (self.rs_digest * 1_000_003 + unit + 1) % (1 << 61)

    def next_step(self) -> None:
        self.step += 1
        self.gathers = self.rs_count = self.rs_digest = 0
        self.rs_last = -1

    def check(self, upto: Optional[Pending] = None) -> Optional[str]:
        """The first disagreement among the tags issued up to ``upto`` (every one if None), if any.

        Tags are compared in issue order, so every rank reports the same (first) disagreement
        however its waits were ordered. A CUDA rank checks only when asked for every tag
        (``upto=None``: ``step()``, or too many unchecked), since reading one synchronizes.
        """
        if upto is not None:
            if self.defer and len(self.unchecked) < MAX_UNCHECKED:
                return None
            if not self.defer and not any(p is upto for p, _ in self.unchecked):
                return None  # checked already, with an earlier one
        n = len(self.unchecked) if upto is None or self.defer else \
            next(i for i, (p, _) in enumerate(self.unchecked) if p is upto) + 1
        batch, self.unchecked = self.unchecked[:n], self.unchecked[n:]
        for p, _ in batch:
            p.wait()
        if self.defer and batch:
            torch.cuda.current_stream(self.device).synchronize()
        for _, tags in batch:
            msg = self._compare(tags.tolist())
            if msg is not None:
                return msg
        return None

    def _name(self, unit: int) -> str:
        return self.names[unit] if 0 <= unit < len(self.names) else "no unit"

    def _compare(self, rows: list[list[int]]) -> Optional[str]:
        if all(r == rows[0] for r in rows):
            return None
        step, gather = rows[0][0], rows[0][1]
        if any(r[0] != step or r[1] != gather for r in rows):
            at = ", ".join(f"rank {i} at gather #{r[1]} of step {r[0]} ({self._name(r[2])})" for i, r in enumerate(rows))
            return f"stage 3: ranks gathered different numbers of units: {at}" + _RULE
        if any(r[2] != rows[0][2] for r in rows):
            wants = ", ".join(f"rank {i} wanted {self._name(r[2])}" for i, r in enumerate(rows))
            return f"stage 3: ranks gathered different units at gather #{gather} of step {step}: {wants}" + _RULE
        did = ", ".join(f"rank {i} {r[3]}, the last {self._name(r[4])}" for i, r in enumerate(rows))
        return (f"stage 3: ranks reduce-scattered different units (by gather #{gather} of step {step}; "
                f"reduce-scatters so far: {did})" + _RULE)
