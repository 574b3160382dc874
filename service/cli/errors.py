"""User mistakes: one red line on stderr and exit status 2, never a traceback.

A handler raises ``CliError`` for a mistake of the user's (a missing file, an unknown job);
``run_command`` turns that, an SDK error (``ZerotrainError``: the server said no, or cannot
be reached) and a mistake in the environment (a bad ``ZEROTRAIN_*`` setting, a database that
is down) into one line. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from rich.markup import escape

from service.cli.output import err
from service.client import ZerotrainError

USER_ERROR_EXIT = 2
INTERRUPTED_EXIT = 130


class CliError(Exception):
    """A user mistake: printed as one line, exit status 2."""


def run_command(args: argparse.Namespace) -> int:
    """Run the handler argparse chose (``args.func``) and return the exit status."""
    try:
        return int(args.func(args) or 0)
    except (CliError, ZerotrainError) as error:
        return _fail(str(error))
    except Exception as error:
        message = _environment_problem(error)
        if message is None:
            raise
        return _fail(message)
    except KeyboardInterrupt:
        err.print("[red]interrupted[/]")
        return INTERRUPTED_EXIT


def _fail(message: str) -> int:
    err.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return USER_ERROR_EXIT


def _environment_problem(error: Exception) -> str | None:
    """One line for mistakes in the environment (bad settings, database down), else None."""
    from pydantic import ValidationError

    if isinstance(error, ValidationError):
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        return f"invalid setting ZEROTRAIN_{field.upper()}: {first['msg']}"
    if "sqlalchemy" in sys.modules:  # only a command that used the database can have failed in it
        from sqlalchemy.exc import DBAPIError

        if isinstance(error, DBAPIError):
            return f"cannot use the database: {str(error.orig or error).splitlines()[0]}"
    return None
