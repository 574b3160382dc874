"""``zerotrain token list`` and ``zerotrain token revoke ID``: through the API, so that any user
can see and revoke their own tokens from wherever they use the service (admins: anyone's)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from service.cli.output import client_for, client_options, out, print_json, wants_json


def register(token_commands: Any) -> None:
    """Add ``list`` and ``revoke`` to the ``token`` command's subparsers."""
    listing = token_commands.add_parser("list", help="your tokens (admins: everyone's), newest first",
                                        parents=[client_options])
    listing.add_argument("--name", help="admins: only this user's tokens")
    listing.set_defaults(func=cmd_token_list)
    revoke = token_commands.add_parser("revoke", help="revoke the token with this id (see `token list`)",
                                       parents=[client_options])
    revoke.add_argument("token_id", type=int, metavar="ID")
    revoke.set_defaults(func=cmd_token_revoke)


def _when(value: Any) -> str:
    return "" if value is None else value.strftime("%Y-%m-%d %H:%M")


def cmd_token_list(args: argparse.Namespace) -> int:
    tokens = client_for(args).tokens(name=args.name)
    if wants_json(args):
        print_json({"items": tokens})
        return 0
    table = Table("id", "name", "admin", "created", "expires", "last used", "revoked")
    for token in tokens:
        table.add_row(str(token.id), token.name, "yes" if token.is_admin else "", _when(token.created_at),
                      _when(token.expires_at), _when(token.last_used_at), _when(token.revoked_at))
    out.print(table)
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    token = client_for(args).revoke_token(args.token_id)
    if wants_json(args):
        print_json(token)
        return 0
    out.print(f"token {token.id} of {token.name} revoked at {_when(token.revoked_at)}")
    return 0
