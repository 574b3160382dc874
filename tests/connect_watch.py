"""Every ``connect()`` of a process tree, as strace records it: who would have left loopback.

A Python-level patch of ``socket`` only sees Python code in the test's own process; Ray's
raylet, GCS and agents are C++ processes of their own. ``strace -f`` on the command that starts
them sees every process and thread it starts, whatever the language, and ``--seccomp-bpf``
stops only at ``connect`` so the traced processes run at full speed otherwise.

What it sees: every TCP connection and every connected UDP socket (a DNS lookup through the
resolver in ``/etc/resolv.conf`` is one), to any address; with ``dns=True`` also what is sent
(``sendto``/``sendmmsg``), so that the names a DNS lookup asked for can be read back. What it
does not see: datagrams sent with ``sendto`` on an unconnected socket without ``dns=True``
(none of Ray, glibc's resolver or the HTTP clients used here do that). It records; it does
not refuse.

[Note: torch's reverse lookups of loopback peers]
torch's c10d store names every address it listens on or connects to with ``getnameinfo()``. For
the IPv4-mapped ``::ffff:127.0.0.1`` it uses, glibc's ``files`` backend finds no entry in a default
/etc/hosts and asks the DNS server for ``1.0.0.127.in-addr.arpa``: a UDP packet off the machine
when the resolver is not on loopback. The suites run under ``scripts/loopback-names`` (``make
test``), where /etc/hosts names that address, so such a lookup is a finding like any other:
``outside_loopback`` reports every DNS socket too; ``loopback_reverse_lookups`` counts those
that asked only for loopback names, to tell this cause apart in a failure.
"""

from __future__ import annotations

import codecs
import ipaddress
import re
import shutil
from pathlib import Path

_IPV4 = re.compile(r'inet_addr\("([0-9.]+)"\)')
_IPV6 = re.compile(r'inet_pton\(AF_INET6, "([^"]+)"')
_PORT = re.compile(r"sin6?_port=htons\((\d+)\)")
_CALL = re.compile(r"^(\d+)\s+(connect|sendto|sendmmsg)\((\d+),")
_PAYLOAD = re.compile(r'"((?:[^"\\]|\\.)*)"')
DNS_PORT = 53


def available() -> bool:
    return shutil.which("strace") is not None


def traced(command: list[str], log_path: Path, *, dns: bool = False) -> list[str]:
    """``command`` run under strace, writing every ``connect()`` of its process tree to ``log_path``
    (and with ``dns``, what is sent: slower where a process sends much, as a Ray head does)."""
    calls = "connect,sendto,sendmmsg" if dns else "connect"
    return ["strace", "-f", "-qq", "--seccomp-bpf", "-e", f"trace={calls}", "-s", "200", "-o", str(log_path), *command]


def _read(log_path: Path) -> list[str]:
    try:
        return Path(log_path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def _query_name(payload: str) -> str | None:
    """The first question's name of a DNS query as strace printed its bytes, or None."""
    raw = codecs.escape_decode(payload.encode())[0]
    at, labels = 12, []
    while at < len(raw) and raw[at]:
        size = raw[at]
        labels.append(raw[at + 1: at + 1 + size].decode(errors="replace"))
        at += 1 + size
    return ".".join(labels) if labels and at < len(raw) else None


def dns_queries(log_path: Path) -> dict[tuple[int, int], list[str]]:
    """``{(pid, fd): [names asked]}`` for every socket connected to port 53 (logs traced with ``dns``)."""
    to_dns: set[tuple[int, int]] = set()
    asked: dict[tuple[int, int], list[str]] = {}
    for line in _read(log_path):
        call = _CALL.match(line)
        if not call:
            continue
        key = (int(call.group(1)), int(call.group(3)))
        if call.group(2) == "connect":
            port = _PORT.search(line)
            (to_dns.add if port and int(port.group(1)) == DNS_PORT else to_dns.discard)(key)
        elif key in to_dns:
            names = [_query_name(payload) for payload in _PAYLOAD.findall(line)]
            asked.setdefault(key, []).extend(name for name in names if name)
    return asked


def is_loopback_reverse_lookup(name: str) -> bool:
    """A PTR name of an address in 127.0.0.0/8 (``d.c.b.127.in-addr.arpa``) or of ::1."""
    return name.endswith(".127.in-addr.arpa") or name == "1" + ".0" * 31 + ".ip6.arpa"


def connects(log_path: Path) -> list[tuple[int, int, str, int, str]]:
    """``(pid, fd, address, port, line)`` for every inet ``connect()`` in a strace log."""
    found = []
    for line in _read(log_path):
        call = _CALL.match(line)
        if not call or call.group(2) != "connect":
            continue
        address = _IPV4.search(line) or _IPV6.search(line)
        port = _PORT.search(line)
        if address:
            found.append((int(call.group(1)), int(call.group(3)), address.group(1),
                          int(port.group(1)) if port else 0, line.strip()))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _only_loopback_reverse_lookups(asked: list[str] | None) -> bool:
    return bool(asked) and all(is_loopback_reverse_lookup(name) for name in asked)


def outside_loopback(log_path: Path) -> list[str]:
    """Every ``connect()`` to an address outside 127.0.0.0/8 and ::1, as its strace line, a DNS
    server's included (with what it was asked, where the log was traced with ``dns``)."""
    asked = dns_queries(log_path)
    return [f"{line}  (asked: {', '.join(asked.get((pid, fd), [])) or '?'})"
            for pid, fd, address, port, line in connects(log_path) if not is_loopback(address)]


def loopback_reverse_lookups(log_path: Path) -> int:
    """How many DNS sockets asked only for reverse lookups of loopback addresses."""
    return sum(_only_loopback_reverse_lookups(names) for names in dns_queries(log_path).values())
