"""The chart's bucket of a step, as docs/contracts.md states it: a job of ``steps`` train steps
(steps 0…steps) is cut into ``min(max_points, steps + 1)`` buckets, step ``s`` falling in
bucket ``s × buckets // (steps + 1)``; written here apart from the service's code, so a test
that reads its answer through this checks the contract, not the code against itself."""

from __future__ import annotations


def bucket(step: int, steps: int, max_points: int) -> int:
    span = steps + 1
    return step * min(max_points, span) // span
