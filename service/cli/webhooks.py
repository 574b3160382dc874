"""``zerotrain webhook create|list|delete|deliveries``: your webhooks, and your teams', through the API.

``create`` makes a signing secret when none is given (``--secret-file`` reads one) and prints it
once, as ``token create`` does with a token: a secret on the command line would show in ``ps``.
"""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path
from typing import Any

from contract.webhooks import EVENTS
from service.cli.errors import CliError
from service.cli.output import (client_for, client_options, out, print_items, print_json, print_one, wants_json,
                                when)
from service.schemas import WebhookDeliveryOut

SECRET_BYTES = 32


def register(commands: Any) -> None:
    webhook = commands.add_parser("webhook", help="tell a URL about your jobs' transitions (signed)")
    sub = webhook.add_subparsers(dest="webhook_command", required=True, metavar="COMMAND")
    create = sub.add_parser("create", help="register URL; prints the signing secret once", parents=[client_options])
    create.add_argument("target", metavar="URL", help="where to send the events")
    create.add_argument("--event", dest="events", action="append", choices=EVENTS,
                        help="an event to send (repeatable; default: every job transition)")
    create.add_argument("--secret-file", type=Path, help="read the signing secret from this file")
    create.add_argument("--team", help="a webhook of this team, told about all its jobs (maintainers and admins)")
    create.set_defaults(func=cmd_create)
    listing = sub.add_parser("list", help="your webhooks and those of the teams you manage", parents=[client_options])
    listing.set_defaults(func=cmd_list)
    delete = sub.add_parser("delete", help="delete the webhook with this id", parents=[client_options])
    delete.add_argument("webhook_id", type=int, metavar="ID")
    delete.set_defaults(func=cmd_delete)
    deliveries = sub.add_parser("deliveries", help="a webhook's newest deliveries", parents=[client_options])
    deliveries.add_argument("webhook_id", type=int, metavar="ID")
    deliveries.add_argument("--limit", type=int, default=20)
    deliveries.set_defaults(func=cmd_deliveries)


def cmd_create(args: argparse.Namespace) -> int:
    if args.secret_file is not None:
        try:
            secret = args.secret_file.read_text().strip()
        except OSError as error:
            raise CliError(f"cannot read --secret-file: {error}") from None
    else:
        secret = secrets.token_urlsafe(SECRET_BYTES)
    events = args.events or [event for event in EVENTS if event != "job.preempted"]
    hook = client_for(args).create_webhook(args.target, events, secret, team=args.team)
    if wants_json(args):
        print_json({**hook.model_dump(mode="json"), "secret": None if args.secret_file else secret})
        return 0
    whose = f" for team {hook.team}" if hook.team else ""
    out.print(f"webhook {hook.id}{whose} → {hook.url} ({', '.join(hook.events)})")
    if args.secret_file is None:
        out.print(f"signing secret (shown once): {secret}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    return print_items(args, client_for(args).webhooks(), ("id", "team", "url", "events", "created"),
                       lambda hook: (str(hook.id), hook.team or "", hook.url, ", ".join(hook.events),
                                     when(hook.created_at)))


def cmd_delete(args: argparse.Namespace) -> int:
    hook = client_for(args).delete_webhook(args.webhook_id)
    return print_one(args, hook, f"webhook {hook.id} deleted")


def cmd_deliveries(args: argparse.Namespace) -> int:
    return print_items(args, client_for(args).webhook_deliveries(args.webhook_id, limit=args.limit),
                       ("delivery", "job", "event", "status", "attempts", "last answer", "created"), _delivery_row)


def _delivery_row(item: WebhookDeliveryOut) -> tuple[str, ...]:
    answer = item.last_error or (str(item.last_status_code) if item.last_status_code else "")
    return (item.id, item.job_id, item.event, item.status, str(item.attempts), answer,
            when(item.created_at, seconds=True))
