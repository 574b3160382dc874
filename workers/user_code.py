"""Errors of the user's code, told apart from a lost worker so that they are not retried.

A restart is for a worker or a node that failed: the same code on a new process may well get
through. An import error, a model factory that raises, a weights file that does not fit the
model or a first forward that fails will fail the same way on every attempt, each restart
costing a worker group's start (tens of seconds to minutes). So the training loop runs those
parts inside ``user_code(what)``, which turns what they raise into ``UserCodeError``; the Ray
runtime's failure policy ends the run on it at once (``workers.runtime.ray_train``) and the job
fails ``user_code_error`` in its first attempt, whatever ``max_failures`` says.

Communication errors (``torch.distributed.DistError``: a peer that died, a store that went
away) are not the user's and pass through unchanged, so a node lost during the first step is
still restarted.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Iterator

import torch
import torch.distributed as dist

#: lines of the user's innermost frames kept in the message (the full traceback is in the log)
USER_FRAMES = 3
MAX_MESSAGE_CHARS = 1500

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("workers", "contract", "service"))
_LIBRARIES = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, contextlib))  # torch, stdlib


class UserCodeError(RuntimeError):
    """The user's code raised while the job was set up or in its first step; retrying would not help.

    Its one argument is the whole message (it travels pickled from a worker to Ray's controller):
    what was being done, the exception's type and message, and the innermost frames of the
    user's code.
    """


def _user_frames(error: BaseException) -> list[str]:
    """The innermost frames outside this project, torch and the standard library (at most USER_FRAMES)."""
    frames = traceback.extract_tb(error.__traceback__)
    theirs = [f for f in frames if not os.path.abspath(f.filename).startswith(_OURS + _LIBRARIES)]
    return [f'  File "{f.filename}", line {f.lineno}, in {f.name}' + (f"\n    {f.line}" if f.line else "")
            for f in theirs[-USER_FRAMES:]]


def describe(what: str, error: BaseException) -> str:
    """``"<what> failed: Type: message"`` and the user's innermost frames, bounded."""
    text = str(error).strip()
    first = f"{what} failed: {type(error).__name__}" + (f": {text}" if text else "")
    message = "\n".join([first] + _user_frames(error))
    return message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 1] + "…"


@contextlib.contextmanager
def user_code(what: str) -> Iterator[None]:
    """Run a part of the job that executes the user's code or reads the user's inputs."""
    try:
        yield
    except (UserCodeError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as error:  # noqa: BLE001 - classified, then raised on
        if isinstance(error, dist.DistError):
            raise
        print(f"zerotrain: {what} failed; this is an error of the job's code or inputs, not retried",
              file=sys.stderr, flush=True)
        raise UserCodeError(describe(what, error)) from error


def is_user_code_error(error: BaseException) -> bool:
    """Whether ``error`` is (or, as Ray wraps a worker's error, derives from or carries) a UserCodeError."""
    seen: list[BaseException] = []
    while error is not None and not any(error is e for e in seen):
        if isinstance(error, UserCodeError):
            return True
        seen.append(error)
        error = getattr(error, "cause", None) or error.__cause__
    return False
