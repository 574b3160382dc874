"""The ``zerotrain`` command: the argparse tree and the entry point.

Each command group lives in its own module and adds its subcommands with
``register(subparsers)``: server side (``service.cli.server``: ``serve``, ``scheduler``,
``db upgrade``, ``token create``), client side through the SDK (``service.cli.jobs``:
``submit``, ``jobs``, ``show``, ``cancel``, ``logs``, ``events``), and the two that need no
server (``service.cli.plan``, ``service.cli.ckpt``), and ``completion`` (``service.cli.completion``),
whose script is made from this tree. Handlers are set with
``parser.set_defaults(func=handler)`` and raise ``CliError`` for user mistakes, which
``service.cli.errors.run_command`` prints as one red line with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse

from service.cli import ckpt, completion, jobs, plan, server, teams, webhooks
from service.cli.errors import run_command

COMMAND_GROUPS = (server, jobs, teams, webhooks, plan, ckpt)  # in the order ``--help`` lists them


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerotrain", description="Self-hostable training service.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.register(commands)
    completion.register(commands, parser)  # last: its script covers every command above
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's arguments), run the command, return its exit status."""
    return run_command(build_parser().parse_args(argv))
