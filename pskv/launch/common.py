"""What every cluster launcher shares: the job's description, hostfiles, placement, the
environment of each process, the scheduler's address, and the guarded local scheduler.

The environment contract is SPEC.md section 8: every process gets ``DMLC_ROLE``,
``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``, ``DMLC_NUM_WORKER``, ``DMLC_NUM_SERVER``, and servers
and workers a stable ``DMLC_SERVER_ID`` / ``DMLC_WORKER_ID``. Remote processes get exactly the
variables built here (never the launcher's whole environment, which belongs to this machine):
those, ``PYTHONUNBUFFERED=1``, the launcher's ``PSKV_*`` settings and ``DMLC_INTERFACE``, then
``--env`` for every process and ``--env-server`` / ``--env-worker`` for one role.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Optional

from .. import config
from ..errors import LaunchError
from .local import command_argv, start_scheduler
from .process import Proc, ProcessContext

ROLES = ("server", "worker")
#: variables of the launcher's own environment that every remote process gets as well
FORWARDED_PREFIXES = ("PSKV_",)
FORWARDED_NAMES = ("DMLC_INTERFACE",)
#: launcher-side variables that mean nothing elsewhere
NOT_FORWARDED = ("PSKV_PORT_FD", "PSKV_SSH")
DEFAULT_PORT = 9091
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# --------------------------------------------------------------------------------------------
# hostfiles and placement


@dataclass(frozen=True)
class Host:
    """One line of a hostfile: ``host``, ``user@host``, ``host:port``, ``host slots=N``."""

    name: str
    port: Optional[int] = None
    slots: int = 1

    def __str__(self) -> str:
        return self.name if self.port is None else f"{self.name}:{self.port}"


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """The hosts of a hostfile, in order; a host listed twice counts once with the slots added.

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
            if opt in ("slots", "max_slots", "max-slots") and sep:
                try:
                    n = int(value)
                except ValueError:
                    raise LaunchError(f"{where}: {item!r}: slots must be a whole number") from None
                if n < 1:
                    raise LaunchError(f"{where}: {item!r}: slots must be at least 1")
                if opt == "slots":
                    slots = n
            else:
                raise LaunchError(f"{where}: unexpected {item!r} (expected 'host', 'host:port' or 'host slots=N')")
        name, port = _split_host_port(first, where)
        key = (name, port)
        if key in hosts:
            slots += hosts[key].slots
        hosts[key] = Host(name, port, slots)
    if not hosts:
        raise LaunchError(f"{source} lists no host")
    return list(hosts.values())


def _split_host_port(text: str, where: str) -> tuple[str, Optional[int]]:
    if text.startswith("["):  # [ipv6] or [ipv6]:port
        close = text.find("]")
        if close < 0:
            raise LaunchError(f"{where}: {text!r}: missing ']'")
        name, rest = text[1:close], text[close + 1 :]
        if not rest:
            return name, None
        if not rest.startswith(":"):
            raise LaunchError(f"{where}: {text!r}: expected [address]:port")
        port_text = rest[1:]
    elif text.count(":") == 1:
        name, port_text = text.split(":")
    else:
        return text, None  # a plain name, or a bare IPv6 address
    if not name:
        raise LaunchError(f"{where}: {text!r}: no host name")
    try:
        port = int(port_text)
    except ValueError:
        raise LaunchError(f"{where}: {text!r}: the port must be a number") from None
    if not 0 < port < 65536:
        raise LaunchError(f"{where}: {text!r}: port out of range")
    return name, port


def read_hostfile(path: str) -> list[Host]:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise LaunchError(f"cannot read the hostfile {path}: {exc.strerror or exc}") from None
    return parse_hostfile(text, path)


def host_cycle(hosts: Sequence[Host]) -> list[Host]:
    """One round of placement: every host once per slot, interleaved (a:2, b:1 -> a, b, a)."""
    order: list[Host] = []
    for k in range(max((h.slots for h in hosts), default=0)):
        order.extend(h for h in hosts if h.slots > k)
    return order


def place(count: int, hosts: Sequence[Host]) -> list[Host]:
    """The host of each of ``count`` processes: round robin over :func:`host_cycle`.

    Servers and workers are placed separately, each starting at the first host, so with H
    hosts of one slot worker i runs on host i % H and server j on host j % H.
    """
    order = host_cycle(hosts)
    if not order:
        raise LaunchError("no host to place processes on")
    return [order[i % len(order)] for i in range(count)]


# --------------------------------------------------------------------------------------------
# the job


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

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.num_servers < 0:
            raise LaunchError(
                f"need at least one worker and no negative server count, got -n {self.num_workers} -s {self.num_servers}"
            )
        if not self.command:
            raise LaunchError("no command to run: pskv launch -n 2 -s 2 -- python train.py")
        if not self.name:
            self.name = f"pskv-{secrets.token_hex(3)}"

    def worker_argv(self) -> list[str]:
        """The workers' command (a single string with spaces runs through ``/bin/sh -c``)."""
        return command_argv(self.command)

    def serve_argv(self) -> list[str]:
        return [self.python, "-m", "pskv", "serve"]

    def count(self, role: str) -> int:
        return self.num_servers if role == "server" else self.num_workers


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's own variables that every process of the job gets: ``PSKV_*`` settings
    and ``DMLC_INTERFACE`` (an interface name is usually the same on every host)."""
    return {
        k: v
        for k, v in environ.items()
        if (k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES) and k not in NOT_FORWARDED
    }


def base_env(spec: JobSpec, root_uri: str, root_port: Optional[int]) -> dict[str, str]:
    """The variables every process of the job gets (before its role)."""
    env = forwarded_env(spec.environ)
    env.update(spec.env)
    env.update(
        {
            "DMLC_PS_ROOT_URI": root_uri,
            "DMLC_NUM_WORKER": str(spec.num_workers),
            "DMLC_NUM_SERVER": str(spec.num_servers),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if root_port is not None:
        env["DMLC_PS_ROOT_PORT"] = str(root_port)
    return env


def role_env(spec: JobSpec, base: Mapping[str, str], role: str, rank: Optional[int] = None) -> dict[str, str]:
    """One role's environment: ``DMLC_ROLE``, the id when known here, then ``--env-ROLE``."""
    env = dict(base)
    env["DMLC_ROLE"] = role
    if rank is not None:
        env["DMLC_SERVER_ID" if role == "server" else "DMLC_WORKER_ID"] = str(rank)
        if role == "worker":
            env["RANK"] = str(rank)
            env["WORLD_SIZE"] = str(spec.num_workers)
    env.update(spec.role_env.get(role, {}))
    return env


# --------------------------------------------------------------------------------------------
# addresses


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def resolve(host: str) -> Optional[str]:
    """An IPv4 address of ``host``, or None if it does not resolve here."""
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError):
        return None


def scheduler_address(environ: Mapping[str, str], towards: Sequence[str] = ()) -> str:
    """The address the scheduler (on this machine) binds and every process connects to.

    ``DMLC_NODE_HOST`` if set; else the address of interface ``DMLC_INTERFACE``; else this
    machine's address on the route to the first of ``towards`` (host names or addresses of the
    job's hosts) that is not a loopback address, so other hosts can reach it; when every host is
    this machine's loopback, 127.0.0.1.
    """
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
    resolved = [ip for ip in (resolve(h) for h in towards) if ip]
    remote = [ip for ip in resolved if not is_loopback(ip)]
    if remote:
        return route_address(remote[0])
    if resolved:
        return "127.0.0.1"
    return route_address("192.0.2.1")  # no packet is sent; the default route's source address


# --------------------------------------------------------------------------------------------
# commands


def check_env_names(env: Mapping[str, str]) -> None:
    for k in env:
        if not _NAME_RE.fullmatch(k):
            raise LaunchError(f"not an environment variable name: {k!r}")


def guard_argv(
    python: str,
    *,
    rank_from: Sequence[str] = (),
    rank_offset: int = 0,
    prefix: Optional[str] = None,
    watch_stdin: bool = False,
    workers_here: Optional[int] = None,
    status_dir: Optional[str] = None,
    grace: Optional[float] = None,
) -> list[str]:
    """``python -m pskv.launch.guard [options]`` (the command and its ``--`` follow)."""
    argv = [python, "-m", "pskv.launch.guard"]
    if rank_from:
        argv += ["--rank-from", ",".join(rank_from)]
    if rank_offset:
        argv += ["--rank-offset", str(rank_offset)]
    if prefix:
        argv += ["--prefix", prefix]
    if watch_stdin:
        argv.append("--watch-stdin")
    if workers_here:
        argv += ["--workers-here", str(workers_here)]
    if status_dir:
        argv += ["--status-dir", status_dir]
    if grace is not None:
        argv += ["--grace", f"{grace:g}"]
    return argv


def shell_command(argv: Sequence[str], env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> str:
    """``cd DIR && exec env A=1 ... argv`` for a remote POSIX shell, every piece quoted."""
    parts: list[str] = []
    if cwd:
        parts.append(f"cd {shlex.quote(cwd)} &&")
    parts.append("exec")
    if env:
        check_env_names(env)
        parts.append("env")
        parts.extend(shlex.quote(f"{k}={v}") for k, v in env.items())
    parts.extend(shlex.quote(a) for a in argv)
    return " ".join(parts)


def export_lines(env: Mapping[str, str]) -> str:
    """``export NAME=value`` lines for a POSIX shell script."""
    check_env_names(env)
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def require_tool(name: str, launcher: str, hint: str = "") -> str:
    """The path of ``name`` on PATH, or a :class:`LaunchError` that says what is missing."""
    path = shutil.which(name)
    if path is None:
        more = f"; {hint}" if hint else ""
        raise LaunchError(f"the {launcher} launcher needs `{name}`, which is not on PATH{more}")
    return path


def run_quiet(argv: Sequence[str], timeout: float = 60.0, env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess[str]:
    """Run a short helper command, output captured; a hang is a :class:`LaunchError`."""
    try:
        return subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env),
        )
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{shlex.join(argv)}` did not finish within {timeout:g} s") from None
    except OSError as exc:
        raise LaunchError(f"cannot run `{shlex.join(argv)}`: {exc.strerror or exc}") from None


def last_lines(text: str, n: int = 5) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:])


def print_plan(title: str, body: str) -> None:
    sys.stdout.write(f"# {title}\n{body.rstrip()}\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------------------------
# running


def start_guarded_scheduler(
    ctx: ProcessContext, spec: JobSpec, root_uri: str, extra: Optional[Mapping[str, str]] = None
) -> tuple[list[Proc], Optional[int]]:
    """Start the scheduler here, as the local launcher does (it reports its port through a
    pipe), bound to ``root_uri``, under the guard with its stdin watched: it stops with the
    launcher even when the launcher is killed with SIGKILL. Returns the processes started and
    the port: none and None for a job without servers (``-s 0``), which has no scheduler."""
    if not spec.num_servers:
        return [], None
    env = {**spec.environ, **base_env(spec, root_uri, None), **(extra or {})}
    argv = [*guard_argv(sys.executable, watch_stdin=True), "--", sys.executable, "-m", "pskv", "serve"]
    sched, port = start_scheduler(ctx, env, config.start_timeout(), argv=argv, stdin="pipe")
    return [sched], port


def finish_timeout() -> float:
    return max(30.0, config.heartbeat_timeout() * 2)


def supervise(ctx: ProcessContext, body: Callable[[], int]) -> int:
    """Run ``body`` (which starts and waits for the job) so that any error, Ctrl-C or SIGTERM
    stops everything it started, local processes and (through ``ctx.on_stop``) cluster jobs."""
    from .local import _StopOnSignal

    stop = _StopOnSignal(ctx)
    try:
        return body()
    except FileNotFoundError as exc:
        ctx.stop_all()
        raise LaunchError(f"cannot start {exc.filename}: {exc.strerror}") from None
    except BaseException:
        ctx.stop_all()
        raise
    finally:
        stop.restore()


class Follower(threading.Thread):
    """Copy the whole lines appended to the files ``paths()`` names (asked again every 0.2 s:
    files may appear late) to ``sink`` until :meth:`finish`. For the output files of batch
    jobs, whose lines are prefixed already (``[worker 1] ...``)."""

    def __init__(self, paths: Callable[[], Sequence[str]], sink: IO[str]):
        super().__init__(daemon=True, name="pskv-follow")
        self.paths = paths
        self.sink = sink
        self._done = threading.Event()
        self._pos: dict[str, int] = {}
        self._pending: dict[str, bytes] = {}

    def _read(self, path: str) -> None:
        try:
            with open(path, "rb") as f:
                f.seek(self._pos.get(path, 0))
                chunk = f.read()
                self._pos[path] = f.tell()
        except OSError:
            return
        if not chunk:
            return
        *lines, rest = (self._pending.get(path, b"") + chunk).split(b"\n")
        self._pending[path] = rest
        if lines:
            self.sink.write("".join(line.decode(errors="replace") + "\n" for line in lines))
            self.sink.flush()

    def run(self) -> None:
        while True:
            done = self._done.is_set()
            for path in self.paths():
                self._read(path)
            if done:
                for rest in self._pending.values():
                    if rest:
                        self.sink.write(rest.decode(errors="replace") + "\n")
                self.sink.flush()
                return
            self._done.wait(0.2)

    def finish(self) -> None:
        if self.is_alive():
            self._done.set()
            self.join(timeout=10)
