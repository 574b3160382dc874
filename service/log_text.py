"""What the service does to a job's log before it stores or serves it.

A job's log is the driver's output with every Ray process's lines streamed into it. Ray
colours the prefixes of those lines (``"\x1b[36m(RayTrainWorker pid=…)\x1b[0m"``) for a
terminal; stored or served, the escape codes are noise in ``zerotrain logs`` and the
dashboard's log panel. Every path that keeps or answers a job's log goes through
``plain_log`` (the Ray launcher's kept copy, the logs endpoint, a failed job's ``details``),
so this is the one place that decides what a log looks like as text.

[Note: the memory monitor's report names other jobs' processes]
When Ray's memory monitor kills a worker, the error it raises (and the raylet's message the
driver prints) carries the node's "Top 10 memory users": a table of process ids, sizes and
whole command lines of every process on the node, other users' jobs among them, and, in Ray
2.60, the "Considered workers" the killing policy weighed, each with its job id and task name.
Those reach a job's log and its ``details`` (the traceback) and so its owner. The sentence
that says how full the node was stays (``Memory on the node … was 22.45GB / 23.43GB``); the
table and the workers' entries become one line saying what was left out. Line by line, so
it holds for a tail that starts inside the table: a table row is recognised by its header on
a line above or by its own tab-separated shape; a line with the header keeps what comes
before it (a ``repr`` puts the whole report on one line, with ``\\n`` for its newlines).
"""

from __future__ import annotations

import re

# CSI sequences: colours and cursor moves ("\x1b[36m", "\x1b[0m", "\x1b[2K")
_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

MEMORY_REPORT_LEFT_OUT = ("[zerotrain: the memory monitor's list of the node's processes is left out: "
                          "it names other jobs' processes]")
# Ray's C++ raylet: "PID\tMEM(GB)\tCOMMAND"; ray/_private/memory_monitor.py: "PID\tMEM\tCOMMAND"
_TABLE_HEADER = re.compile(r"PID(?:\s|\\t)+MEM(?:\(GB\))?(?:\s|\\t)+COMMAND")
# what Ray puts before a worker's line in the driver's output: "(RayTrainWorker pid=4242, ip=…) "
_RAY_PREFIX = r"(?:\([^()\n]*pid=\d+[^()\n]*\) )?"
_TABLE_ROW = re.compile(_RAY_PREFIX + r"\s*\d+\s+[0-9.]+(?:GiB|GB)?\s+\S")
_TAB_SEPARATED_ROW = re.compile(_RAY_PREFIX + r"\s*\d+\t[0-9.]+(?:GiB|GB)?\t")
# a worker the killing policy considered (Ray 2.60) or selected (older): job id, task name, pid
_WORKER_ENTRY = "actual memory used="
_CONSIDERED_WORKERS = "Considered workers: ["


def plain_log(text: str) -> str:
    """``text`` without terminal escape codes and without the memory monitor's process table."""
    return _without_process_table(_TERMINAL_CODES.sub("", text))


def _without_process_table(text: str) -> str:
    if "MEM" not in text and _WORKER_ENTRY not in text and "\t" not in text:
        return text  # the common case: nothing to look at line by line
    kept = []
    in_table = False
    for line in text.splitlines(keepends=True):
        header = _TABLE_HEADER.search(line)
        considered = line.find(_CONSIDERED_WORKERS)
        cut = min([at for at in (header.start() if header else -1, considered) if at >= 0], default=-1)
        if cut >= 0:
            kept.append(line[:cut] + MEMORY_REPORT_LEFT_OUT + ("\n" if line.endswith("\n") else ""))
            in_table = header is not None
            continue
        if _WORKER_ENTRY in line or _TAB_SEPARATED_ROW.match(line) or (in_table and _TABLE_ROW.match(line)):
            continue
        in_table = False
        kept.append(line)
    return "".join(kept)
