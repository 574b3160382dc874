"""The command's two consoles: results go to stdout (``out``), messages to stderr (``err``); and
the options every command that talks to the service shares.

Both consoles are created once and shared by every command group so that what a command prints
and how a mistake is reported look the same everywhere (and pytest's ``capsys`` sees both: a
rich ``Console`` without a file writes to whatever ``sys.stdout``/``sys.stderr`` is now).

``client_options`` is the parent parser of those commands: ``--url`` and ``--token`` beside
``ZEROTRAIN_URL``/``ZEROTRAIN_TOKEN`` (the flags win), and ``-o/--output json``, which prints
exactly the API's objects (``print_json``) instead of a table, for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pydantic import BaseModel
from rich.console import Console

from service.client import Client

out = Console()
err = Console(stderr=True)

OUTPUTS = ("table", "json")


def output_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=OUTPUTS, default="table",
                        help="json: the API's objects, for scripts (default: a table)")


client_options = argparse.ArgumentParser(add_help=False)
client_options.add_argument("--url", help="the service (default: $ZEROTRAIN_URL, else the local one)")
client_options.add_argument("--token", help="an API token (default: $ZEROTRAIN_TOKEN, else the local admin's)")
output_option(client_options)


def client_for(args: argparse.Namespace) -> Client:
    """The SDK client the command's ``--url``/``--token`` (or the environment) name."""
    return Client(getattr(args, "url", None), getattr(args, "token", None))


def wants_json(args: argparse.Namespace) -> bool:
    return getattr(args, "output", "table") == "json"


def print_json(value: Any) -> None:
    """``value`` (API models, lists and dicts of them) as JSON on stdout: plain text, one document."""
    sys.stdout.write(json.dumps(_plain(value), indent=2) + "\n")
    sys.stdout.flush()


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
