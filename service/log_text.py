"""What the service does to a job's log before it stores or serves it.

A job's log is the driver's output with every Ray process's lines streamed into it. Ray
colours the prefixes of those lines (``"\x1b[36m(RayTrainWorker pid=…)\x1b[0m"``) for a
terminal; stored or served, the escape codes are noise in ``zerotrain logs`` and the
dashboard's log panel. Every path that keeps or answers a job's log goes through
``plain_log`` (the Ray launcher's kept copy, the logs endpoint), so this is the one place
that decides what a log looks like as text.
"""

from __future__ import annotations

import re

# CSI sequences: colours and cursor moves ("\x1b[36m", "\x1b[0m", "\x1b[2K")
_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def plain_log(text: str) -> str:
    """``text`` without terminal escape codes."""
    return _TERMINAL_CODES.sub("", text)
