"""The line each rank writes to the job's log first, so that the log can be read per rank.

Why it exists: a job's log is the driver's output with every Ray worker's lines streamed into
it, each prefixed by Ray with the process that wrote it (``(RayTrainWorker pid=4242) …``,
``, ip=…`` on another node), never with its rank. Each rank announces itself once, at the
start of every attempt (``workers.runtime.ray_train``); the control plane maps a process to
its rank from that line and answers ``GET /logs?rank=N`` with that rank's lines
(``service.log_ranks``). The worker writes the line and the service parses it, so its format
is here, once.
"""

from __future__ import annotations

import re

RANK_ANNOUNCEMENT = "zerotrain: this process is rank {rank} of {world_size}"
RANK_ANNOUNCEMENT_PATTERN = re.compile(r"zerotrain: this process is rank (?P<rank>\d+) of (?P<world_size>\d+)\s*$")


def rank_announcement(rank: int, world_size: int) -> str:
    return RANK_ANNOUNCEMENT.format(rank=rank, world_size=world_size)
