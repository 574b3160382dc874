"""``zerotrain team create|list|members|add|remove``: teams and their members through the API.

Who may do what is the service's rule (``contract.teams``): admins create teams, maintainers
add and remove members, anyone leaves a team with ``remove TEAM their-own-name``.
"""

from __future__ import annotations

import argparse
from typing import Any

from contract.teams import ROLES
from service.cli.output import client_for, client_options, print_items, print_one, when


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
