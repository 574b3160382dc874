"""``zerotrain team create|list|members|add|remove|quota``: teams, their members and quotas through the API.

Who may do what is the service's rule (``contract.teams``): admins create teams and set quotas,
maintainers add and remove members, anyone leaves a team with ``remove TEAM their-own-name``.
``quota TEAM`` shows the team's quota; with options it changes the bounds named and keeps the
others (``--gpus none`` turns a bound off).
"""

from __future__ import annotations

import argparse
from typing import Any

from contract.quotas import QUOTA_FIELDS, TeamQuota, cli_option
from contract.teams import ROLES
from service.cli.output import (
    client_for,
    client_options,
    print_items,
    print_one,
    table_of,
    when,
)


def register(commands: Any) -> None:
    team = commands.add_parser("team", help="teams: who sees and manages whose jobs")
    sub = team.add_subparsers(dest="team_command", required=True, metavar="COMMAND")
    create = sub.add_parser("create", help="create a team (admins)", parents=[client_options])
    create.add_argument("name", metavar="TEAM")
    create.set_defaults(func=cmd_create)
    listing = sub.add_parser("list", help="the teams you are in, with your role", parents=[client_options])
    listing.set_defaults(func=cmd_list)
    members = sub.add_parser("members", help="a team's members and their roles", parents=[client_options])
    members.add_argument("name", metavar="TEAM")
    members.set_defaults(func=cmd_members)
    add = sub.add_parser("add", help="add a user to a team, or change their role (maintainers)",
                         parents=[client_options])
    add.add_argument("name", metavar="TEAM")
    add.add_argument("user", metavar="USER")
    add.add_argument("--role", choices=ROLES, default="member")
    add.set_defaults(func=cmd_add)
    remove = sub.add_parser("remove", help="remove a user from a team (maintainers; anyone for themselves)",
                            parents=[client_options])
    remove.add_argument("name", metavar="TEAM")
    remove.add_argument("user", metavar="USER")
    remove.set_defaults(func=cmd_remove)
    quota = sub.add_parser("quota", help="show a team's quota, or change it (admins)", parents=[client_options])
    quota.add_argument("name", metavar="TEAM")
    for field in QUOTA_FIELDS:
        info = TeamQuota.model_fields[field]
        quota.add_argument(cli_option(field), dest=field, default=UNCHANGED, metavar="N|none",
                           type=_bound(int if "int" in str(info.annotation) else float), help=info.description)
    quota.set_defaults(func=cmd_quota)


UNCHANGED = object()  # an option not given: the bound stays as it is


def _bound(kind: type) -> Any:
    """An option's parser: a number of ``kind``, or ``none`` (the bound is turned off)."""
    def parse(text: str) -> int | float | None:
        if text.strip().lower() == "none":
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'} "
                                             f"or none, got {text!r}") from None
    return parse


def cmd_create(args: argparse.Namespace) -> int:
    team = client_for(args).create_team(args.name)
    return print_one(args, team, f"team {team.name} created; add its maintainers with: zerotrain team add "
                                 f"{team.name} USER --role maintainer")


def cmd_list(args: argparse.Namespace) -> int:
    return print_items(args, client_for(args).teams(), ("team", "your role", "created by", "created"),
                       lambda team: (team.name, team.role, team.created_by, when(team.created_at)))


def cmd_members(args: argparse.Namespace) -> int:
    return print_items(args, client_for(args).team_members(args.name), ("user", "role", "added by", "added"),
                       lambda member: (member.user, member.role, member.added_by, when(member.added_at)))


def cmd_add(args: argparse.Namespace) -> int:
    member = client_for(args).set_team_member(args.name, args.user, args.role)
    return print_one(args, member, f"{member.user} is a {member.role} of team {member.team}")


def cmd_remove(args: argparse.Namespace) -> int:
    member = client_for(args).remove_team_member(args.name, args.user)
    return print_one(args, member, f"{member.user} removed from team {member.team}")


def cmd_quota(args: argparse.Namespace) -> int:
    client = client_for(args)
    changes = {field: getattr(args, field) for field in QUOTA_FIELDS if getattr(args, field) is not UNCHANGED}
    quota = client.team_quota(args.name)
    if changes:
        kept = {field: getattr(quota, field) for field in QUOTA_FIELDS}
        quota = client.set_team_quota(args.name, **(kept | changes))
    used = {"gpus": f"{quota.used.gpus:g}", "cpus": f"{quota.used.cpus:g}", "running_jobs": str(quota.used.running_jobs)}
    table = table_of(("bound", "quota", "used now"), QUOTA_FIELDS, lambda field: (
        field, "none" if getattr(quota, field) is None else f"{getattr(quota, field):g}", used.get(field, "")))
    table.title = f"team {quota.team}"
    return print_one(args, quota, table)
