"""``zerotrain completion bash|zsh``: a shell completion script for the whole command tree.

The script is static: ``shtab`` writes it from the argparse tree ``service.cli.main`` builds,
so completing a word runs no Python and no command needs a completion hook. It completes
commands, subcommands, flags and choices; other words fall back to the shell's own
(file names). Install it
once, e.g. ``zerotrain completion bash > ~/.local/share/bash-completion/completions/zerotrain``
or, for zsh, into a file named ``_zerotrain`` on ``$fpath``; a new version of zerotrain with new
commands needs the script written again.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

SHELLS = ("bash", "zsh")


def register(commands: Any, root: argparse.ArgumentParser) -> None:
    """Add ``completion SHELL`` to the top-level subparsers; the script covers ``root``."""
    about = "print a shell completion script (bash or zsh)"
    completion = commands.add_parser("completion", help=about, description=about)
    completion.add_argument("shell", choices=SHELLS)
    completion.set_defaults(func=lambda args: print_script(root, args.shell))


def script(root: argparse.ArgumentParser, shell: str) -> str:
    """The completion script for ``root`` in ``shell``'s language."""
    import shtab

    return shtab.complete(root, shell=shell)


def print_script(root: argparse.ArgumentParser, shell: str) -> int:
    sys.stdout.write(script(root, shell))
    return 0
