"""One rank's lines of a job's log (``GET /logs?rank=N``, ``zerotrain logs JOB --rank N``).

Ray prefixes every line a worker process writes with that process: ``(RayTrainWorker
pid=4242) …`` on the driver's node, ``(RayTrainWorker pid=4242, ip=10.0.0.7) …`` on another.
A rank says which process it is in its first line (``contract.log_lines``), so reading the
log from the top maps each (pid, ip) to a rank; a restarted worker group's new processes
announce themselves again, so a reused pid takes its new rank from that line on. A line of a
process that never announced itself (Ray's own, the Ray Train controller's) is no rank's; the
driver's own lines carry no prefix and are no rank's either.
"""

from __future__ import annotations

import re

from contract.log_lines import RANK_ANNOUNCEMENT_PATTERN

# "(RayTrainWorker pid=4242) ", "(pid=4242, ip=10.0.0.7) " (see ray._private.worker.print_worker_logs)
_RAY_PREFIX = re.compile(r"\((?:[^()\n]*? )?pid=(?P<pid>\d+)(?:, ip=(?P<ip>[^)\s]+))?\) ")


def rank_lines(text: str, rank: int) -> str:
    """The lines of ``text`` (a plain job log) written by ``rank``'s processes, in order."""
    ranks: dict[tuple[str, str], int] = {}
    kept = []
    for line in text.splitlines(keepends=True):
        prefix = _RAY_PREFIX.match(line)
        if prefix is None:
            continue
        source = (prefix["pid"], prefix["ip"] or "")
        announced = RANK_ANNOUNCEMENT_PATTERN.match(line, prefix.end())
        if announced:
            ranks[source] = int(announced["rank"])
        if ranks.get(source) == rank:
            kept.append(line)
    return "".join(kept)
