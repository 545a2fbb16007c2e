"""The job (:class:`JobSpec`), the one builder of each process's environment (:meth:`JobSpec.process_env`),
and the hosts: hostfiles, placement, the scheduler's address (docs/launchers/README.md)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from ..errors import LaunchError

ROLES = ("server", "worker")
DEFAULT_PORT = 9091
#: variables of the launcher's own environment that every remote process gets as well ...
FORWARDED = ("PSKV_", "DMLC_INTERFACE", "PS_VERBOSE")
#: ... except these, which mean something only here (and ``PSKV_SECRET``, which :meth:`JobSpec.process_env` drops)
NOT_FORWARDED = ("PSKV_PORT_FD", "PSKV_SSH")
# what pskv launch sets for each process (from -n, -s and its role): never from --env
SET_HERE = {"DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER",
            "DMLC_SERVER_ID", "DMLC_WORKER_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}
SERVE = [sys.executable, "-m", "pskv", "serve"]
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a portable shell variable name: ASCII only


@dataclass(frozen=True)
class Host:
    """One line of a hostfile: ``host``, ``user@host``, ``host:port``, ``host slots=N``."""

    name: str
    port: Optional[int] = None
    slots: int = 1

    def __str__(self) -> str:
        return self.name if self.port is None else f"{self.name}:{self.port}"


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """The hosts of a hostfile, in order (a host listed twice counts once, with the slots added):
    lines ``host``, ``host:port``, ``[ipv6]:port``, each optionally followed by ``slots=N``
    (Open MPI's ``max_slots=N`` is ignored); ``#`` starts a comment."""
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


def place(count: int, hosts: Sequence[Host]) -> list[Host]:
    """The host of each of ``count`` processes: round robin over every host once per slot,
    interleaved (a:2, b:1 -> a, b, a, a, b, ...)."""
    order = [h for k in range(max((h.slots for h in hosts), default=0)) for h in hosts if h.slots > k]
    if not order:
        raise LaunchError("no host to place processes on")
    return [order[i % len(order)] for i in range(count)]


def scheduler_address(environ: Mapping[str, str], towards: Sequence[str] = ()) -> str:
    """The address the scheduler (here) binds and every process connects to; ``towards``: the job's
    hosts (docs/launchers/README.md, "Where the scheduler runs")."""
    from ..ps.node import interface_address, route_address

    if node_host := environ.get("DMLC_NODE_HOST", "").strip():
        return node_host
    if interface := environ.get("DMLC_INTERFACE", "").strip():
        try:
            return interface_address(interface)
        except Exception as exc:
            raise LaunchError(str(exc)) from None
    resolved = []
    for host in towards:
        with contextlib.suppress(OSError, UnicodeError):
            resolved.append(socket.gethostbyname(host))
    remote = [ip for ip in resolved if not ipaddress.ip_address(ip).is_loopback]
    if remote:
        return route_address(remote[0])
    return "127.0.0.1" if resolved else route_address("192.0.2.1")  # no packet sent: the default route's address


@dataclass
class JobSpec:
    """Everything a launcher needs to know about the job, from ``pskv launch``'s options."""

    num_workers: int
    num_servers: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    role_env: dict[str, dict[str, str]] = field(default_factory=lambda: {"server": {}, "worker": {}})
    python: str = "python3"
    hosts: list[Host] = field(default_factory=list)
    sync_dst_dir: Optional[str] = None
    timeout: Optional[float] = None
    launcher_args: list[str] = field(default_factory=list)
    ssh_command: list[str] = field(default_factory=lambda: ["ssh"])
    name: str = ""
    image: Optional[str] = None
    port: int = DEFAULT_PORT
    cpus: Optional[float] = None
    memory_mb: Optional[int] = None
    output: Optional[str] = None
    dry_run: bool = False
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    #: the job's secret (``PSKV_SECRET`` if set, else a new one); None when ``PSKV_SECRET_FILE`` names it,
    #: "" for none. Never on a command line: each launcher hands it over in an environment, a pipe or a private file
    secret: Optional[str] = None

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.num_servers < 0:
            raise LaunchError(f"need at least one worker and no negative server count, got -n {self.num_workers} -s {self.num_servers}")
        if self.timeout is not None and not self.timeout > 0:
            raise LaunchError(f"--timeout must be a positive number of seconds, got {self.timeout:g}")
        if taken := sorted(SET_HERE & set(self.env).union(*self.role_env.values())):
            raise LaunchError(f"--env {', '.join(taken)}: pskv launch sets these for each process, from -n, -s and its role")
        if not self.command:
            raise LaunchError("no command to run: pskv launch -n 2 -s 2 -- python train.py")
        if not self.name:
            self.name = f"pskv-{secrets.token_hex(3)}"
        if self.secret is None and not self.environ.get("PSKV_SECRET_FILE", "").strip():
            self.secret = self.environ.get("PSKV_SECRET", "").strip() or secrets.token_hex(32)

    def secret_env(self) -> dict[str, str]:
        """``PSKV_SECRET``, for the environment of a process started here."""
        return {"PSKV_SECRET": self.secret} if self.secret else {}

    def roles(self) -> list[str]:
        """The roles that have processes: servers (unless ``-s 0``) and workers."""
        return [r for r in ROLES if self.count(r)]

    def count(self, role: str) -> int:
        return self.num_servers if role == "server" else self.num_workers

    def argv(self, role: str) -> list[str]:
        """What a server (``pskv serve``) or a worker (the command) runs on a cluster's host; a
        single string with spaces runs through ``/bin/sh -c``, as MXNet's launcher did."""
        if role == "server":
            return [self.python, "-m", "pskv", "serve"]
        if len(self.command) == 1 and " " in self.command[0]:
            return ["/bin/sh", "-c", self.command[0]]
        return list(self.command)

    def guarded(self, role: str, *options: str) -> list[str]:
        """``python3 -m pskv.launch.guard OPTIONS -- ...``: :meth:`argv` under the guard."""
        return [self.python, "-m", "pskv.launch.guard", *options, "--", *self.argv(role)]

    def process_env(
        self, role: str, root_uri: str, port: Optional[int], rank: Optional[int] = None, *,
        base: Optional[Mapping[str, str]] = None, torch: Optional[Mapping[str, str]] = None,
    ) -> dict[str, str]:  # fmt: skip
        """The environment of one process of ``role``, from ``base`` (default: the forwarded ``PSKV_*``
        and ``DMLC_INTERFACE``); its id if ``rank`` is given; no ``DMLC_PS_ROOT_PORT`` if ``port`` is
        None; ``torch`` (``LOCAL_RANK``, ...) for a worker; ``--env-ROLE`` last, so it wins."""
        if base is None:
            base = {k: v for k, v in self.environ.items() if k.startswith(FORWARDED) and k not in NOT_FORWARDED}
        env = {**base, **self.env, "DMLC_ROLE": role, "DMLC_PS_ROOT_URI": root_uri, "PYTHONUNBUFFERED": "1"}
        env.update(DMLC_NUM_WORKER=str(self.num_workers), DMLC_NUM_SERVER=str(self.num_servers))
        if port is not None:
            env["DMLC_PS_ROOT_PORT"] = str(port)
        if rank is not None:
            env["DMLC_SERVER_ID" if role == "server" else "DMLC_WORKER_ID"] = str(rank)
        if role == "worker":
            if rank is not None:
                env.update(RANK=str(rank), WORLD_SIZE=str(self.num_workers))
            env.update({**(torch or {}), **self.env})  # (--env MASTER_PORT:N wins over the launcher's pick too)
        env.update(self.role_env.get(role, {}))
        env.pop("PSKV_SECRET", None)  # never in a plan, a script or on a command line
        return env


def free_port() -> int:
    """A port of 127.0.0.1 that was free a moment ago (for ``MASTER_PORT`` only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_env_names(env: Mapping[str, str]) -> None:
    for k in env:
        if not ENV_NAME.fullmatch(k):
            raise LaunchError(f"not an environment variable name: {k!r}")


def shell_command(argv: Sequence[str], env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> str:
    """``cd DIR && exec env A=1 ... argv`` for a remote POSIX shell, every piece quoted."""
    parts = [f"cd {shlex.quote(cwd)} &&"] if cwd else []
    parts.append("exec")
    if env:
        check_env_names(env)
        parts += ["env", *(shlex.quote(f"{k}={v}") for k, v in env.items())]
    return " ".join([*parts, *map(shlex.quote, argv)])


def export_lines(env: Mapping[str, str]) -> str:
    """``export NAME=value`` lines for a POSIX shell script."""
    check_env_names(env)
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
