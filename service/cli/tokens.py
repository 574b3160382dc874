"""``zerotrain token list`` and ``zerotrain token revoke ID``: through the API, so that any user
can see and revoke their own tokens from wherever they use the service (admins: anyone's)."""

from __future__ import annotations

import argparse
from typing import Any

from service.cli.output import client_for, client_options, print_items, print_one, when


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


def cmd_token_list(args: argparse.Namespace) -> int:
    return print_items(args, client_for(args).tokens(name=args.name),
                       ("id", "name", "admin", "created", "expires", "last used", "revoked"),
                       lambda token: (str(token.id), token.name, "yes" if token.is_admin else "",
                                      when(token.created_at), when(token.expires_at), when(token.last_used_at),
                                      when(token.revoked_at)))


def cmd_token_revoke(args: argparse.Namespace) -> int:
    token = client_for(args).revoke_token(args.token_id)
    return print_one(args, token, f"token {token.id} of {token.name} revoked at {when(token.revoked_at)}")
