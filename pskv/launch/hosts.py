"""Hostfiles, the round-robin placement of processes over their hosts, and the address the
scheduler binds so that every host reaches it (docs/launchers/ssh.md)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ..errors import LaunchError


@dataclass(frozen=True)
class Host:
    """One line of a hostfile: ``host``, ``user@host``, ``host:port``, ``host slots=N``."""

    name: str
    port: Optional[int] = None
    slots: int = 1

    def __str__(self) -> str:
        return self.name if self.port is None else f"{self.name}:{self.port}"


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """The hosts of a hostfile, in order; a host listed twice counts once, with the slots added.

    Lines: ``host``, ``host:port`` (the ssh port), ``[ipv6]:port``, optionally followed by
    ``slots=N`` (Open MPI's ``max_slots=N`` is accepted and ignored); ``#`` starts a comment.
    """
    hosts: dict[tuple[str, Optional[int]], Host] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {lineno}"
        first, *rest = line.split()
        slots = 1
        for item in rest:
            opt, sep, value = item.partition("=")
            if opt not in ("slots", "max_slots", "max-slots") or not sep:
                raise LaunchError(f"{where}: unexpected {item!r} (expected 'host', 'host:port' or 'host slots=N')")
            if not value.isdigit():
                raise LaunchError(f"{where}: {item!r}: slots must be a whole number")
            if int(value) < 1:
                raise LaunchError(f"{where}: {item!r}: slots must be at least 1")
            if opt == "slots":
                slots = int(value)
        name, port = _split_host_port(first, where)
        if (name, port) in hosts:
            slots += hosts[name, port].slots
        hosts[name, port] = Host(name, port, slots)
    if not hosts:
        raise LaunchError(f"{source} lists no host")
    return list(hosts.values())


def _split_host_port(text: str, where: str) -> tuple[str, Optional[int]]:
    if text.startswith("["):  # [ipv6] or [ipv6]:port
        name, close, rest = text[1:].partition("]")
        if not close or rest[:1] not in ("", ":"):
            raise LaunchError(f"{where}: {text!r}: expected [address] or [address]:port")
        if not rest:
            return name, None
        port_text = rest[1:]
    elif text.count(":") == 1:
        name, port_text = text.split(":")
    else:
        return text, None  # a plain name, or a bare IPv6 address
    if not name:
        raise LaunchError(f"{where}: {text!r}: no host name")
    if not port_text.isdigit():
        raise LaunchError(f"{where}: {text!r}: the port must be a number")
    if not 0 < int(port_text) < 65536:
        raise LaunchError(f"{where}: {text!r}: port out of range")
    return name, int(port_text)


def read_hostfile(path: str) -> list[Host]:
    try:
        with open(path) as f:
            return parse_hostfile(f.read(), path)
    except OSError as exc:
        raise LaunchError(f"cannot read the hostfile {path}: {exc.strerror or exc}") from None


def host_cycle(hosts: Sequence[Host]) -> list[Host]:
    """One round of placement: every host once per slot, interleaved (a:2, b:1 -> a, b, a)."""
    return [h for k in range(max((h.slots for h in hosts), default=0)) for h in hosts if h.slots > k]


def place(count: int, hosts: Sequence[Host]) -> list[Host]:
    """The host of each of ``count`` processes, round robin over :func:`host_cycle` (servers and
    workers are placed separately, each from the first host)."""
    order = host_cycle(hosts)
    if not order:
        raise LaunchError("no host to place processes on")
    return [order[i % len(order)] for i in range(count)]


def scheduler_address(environ: Mapping[str, str], towards: Sequence[str] = ()) -> str:
    """The address the scheduler (here) binds and every process connects to: ``DMLC_NODE_HOST``;
    else the address of interface ``DMLC_INTERFACE``; else this machine's address on the route
    to the first of ``towards`` (the job's hosts) that is not a loopback address (127.0.0.1 when
    all are; the default route's source address when there are none)."""
    from ..ps.node import interface_address, route_address

    node_host = environ.get("DMLC_NODE_HOST", "").strip()
    if node_host:
        return node_host
    interface = environ.get("DMLC_INTERFACE", "").strip()
    if interface:
        try:
            return interface_address(interface)
        except Exception as exc:
            raise LaunchError(str(exc)) from None
    resolved = [ip for ip in map(_resolve, towards) if ip]
    remote = [ip for ip in resolved if not ipaddress.ip_address(ip).is_loopback]
    if remote:
        return route_address(remote[0])
    if resolved:
        return "127.0.0.1"
    return route_address("192.0.2.1")  # no packet is sent; the default route's source address


def _resolve(host: str) -> Optional[str]:
    """An IPv4 address of ``host``, or None if it does not resolve here."""
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError):
        return None
