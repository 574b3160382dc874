"""Free TCP ports on loopback, chosen together so that no two of them are the same port.

[Note: why the sockets stay bound until all are chosen]
A port is "free" only while nobody holds it. Binding to port 0 and closing at once, one port
after another, lets the kernel hand the port it just gave out to the next bind: a ``ray start``
then got the same number for two of its components and exited ("is trying to use a port number
that is used by other components"). Keeping every socket bound until the last one is chosen
makes the numbers distinct; something else may still take one before its user binds it, which
is the usual race of any free-port choice and answers with that user's own error.
"""

from __future__ import annotations

import contextlib
import socket

LOOPBACK_HOST = "127.0.0.1"


def free_ports(count: int, host: str = LOOPBACK_HOST) -> list[int]:
    """``count`` distinct ports that are free on ``host`` now."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def free_port(host: str = LOOPBACK_HOST) -> int:
    """One port that is free on ``host`` now."""
    return free_ports(1, host)[0]
