"""The command's two consoles: results go to stdout (``out``), messages to stderr (``err``); and
the options every command that talks to the service shares.

Both consoles are created once and shared by every command group so that what a command prints
and how a mistake is reported look the same everywhere (and pytest's ``capsys`` sees both: a
rich ``Console`` without a file writes to whatever ``sys.stdout``/``sys.stderr`` is now).

``client_options`` is the parent parser of those commands: ``--url`` and ``--token`` beside
``ZEROTRAIN_URL``/``ZEROTRAIN_TOKEN`` (the flags win), and ``-o/--output json``, which prints
exactly the API's objects (``print_json``) instead of a table, for scripts. ``print_items`` and
``print_one`` are that choice for a list of objects and for one, so every command makes it alike.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from pydantic import BaseModel
from rich.console import Console
from rich.table import Column, Table

from service.client import Client

T = TypeVar("T")

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


def table_of(columns: Sequence[str | Column], items: Iterable[T], row: Callable[[T], Sequence[str]]) -> Table:
    """A table with ``columns``, one ``row(item)`` (its cells, as text) per item."""
    table = Table(*columns)
    for item in items:
        table.add_row(*row(item))
    return table


def print_items(args: argparse.Namespace, items: list[T], columns: Sequence[str | Column],
                row: Callable[[T], Sequence[str]]) -> int:
    """A list command's result: ``{"items": [...]}`` with ``-o json``, else ``table_of`` them."""
    if wants_json(args):
        print_json({"items": items})
    else:
        out.print(table_of(columns, items, row))
    return 0


def print_one(args: argparse.Namespace, value: Any, message: str | Table) -> int:
    """A command's one object: as JSON with ``-o json``, else ``message`` (rich markup or a table) for people."""
    if wants_json(args):
        print_json(value)
    else:
        out.print(message)
    return 0


def when(value: datetime | None, seconds: bool = False) -> str:
    """A time as a table shows it (UTC, to the minute or the second); empty for None."""
    return "" if value is None else value.strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")
