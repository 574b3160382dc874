"""Where a webhook may point: a check made when one is registered and again before each delivery.

A webhook makes the control plane send requests on a user's behalf, from inside the service's
network. So a target must resolve only to global addresses. Private, loopback, link-local
(the cloud metadata service at 169.254.169.254), shared, multicast and reserved addresses are refused,
unless the operator lists the host in ``ZEROTRAIN_WEBHOOK_ALLOWED_HOSTS``
(``Settings.webhook_allowed_hosts``: host names, addresses or networks, comma-separated).

[Note: names are resolved, not trusted] A name is judged by every address it resolves to, so a
DNS name that points at 127.0.0.1 is refused like 127.0.0.1 itself. The check is repeated before
each delivery because a name can be re-pointed after registration. Redirects are never followed
(``service.webhooks``), so a global target cannot bounce a delivery inward.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Collection
from urllib.parse import urlsplit

from service.settings import env_var

SCHEMES = ("http", "https")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class TargetRefused(ValueError):
    """Why a URL cannot be a webhook's target; the message is shown to the user."""


def parse_allowed(entries: Collection[str]) -> tuple[frozenset[str], tuple[Network, ...]]:
    """The allow-list split into host names (lower case) and networks (an address is a /32 or /128)."""
    names: set[str] = set()
    networks: list[Network] = []
    for entry in (entry.strip() for entry in entries):
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            names.add(entry.lower().rstrip("."))
    return frozenset(names), tuple(networks)


def check_target(url: str, allowed: Collection[str] = ()) -> None:
    """Raise ``TargetRefused`` unless ``url`` is an http(s) URL the service may send to."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise TargetRefused(f"the scheme must be http or https, not {parts.scheme or 'none'!r}")
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("credentials in the URL are not accepted: sign with the secret instead")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise TargetRefused("the URL names no host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as error:
        raise TargetRefused(f"bad port: {error}") from None
    names, networks = parse_allowed(allowed)
    if host.lower() in names:
        return
    for address in resolve(host, port):
        if any(address in network for network in networks):
            continue
        if not address.is_global or address.is_multicast:
            raise TargetRefused(
                f"{host} resolves to {address}, a private, loopback, link-local or reserved address; "
                f"an operator can allow it with {env_var('webhook_allowed_hosts')}")


def resolve(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Every address ``host`` resolves to (an address literal is itself)."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        raise TargetRefused(f"{host} does not resolve: {error}") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
    if not addresses:
        raise TargetRefused(f"{host} does not resolve")
    return addresses
