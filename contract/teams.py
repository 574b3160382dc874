"""Teams: the roles a member can hold and what each allows (docs/contracts.md, Teams).

A job may belong to a team (the spec's ``team``). Every member of that team sees it -- its
page, metrics, events, logs and checkpoints -- and nobody else does, save admins. Roles are
ordered; each allows what the ones below it do:

- ``viewer``: read the team's jobs;
- ``member``: also submit jobs to the team, and cancel their own;
- ``maintainer``: also cancel any of the team's jobs and manage its members.

Admins (``zerotrain token create --admin``) create teams and act as maintainers of every one.
API tokens stay per user: a team is never a principal.
"""

from __future__ import annotations

from typing import Literal, Optional

ROLES = ("viewer", "member", "maintainer")  # lowest first
Role = Literal["viewer", "member", "maintainer"]
SUBMIT_ROLE: Role = "member"  # the least role that may submit to the team
MANAGE_ROLE: Role = "maintainer"  # the least role that may cancel any team job and manage members


def allows(role: Optional[str], needed: str) -> bool:
    """Whether ``role`` (None: not a member) is at least ``needed``."""
    return role is not None and ROLES.index(role) >= ROLES.index(needed)
