"""Who is who: the job's environment (the ``DMLC_*`` variables, docs/SPEC.md section 8), this
node's address, joining the job, heartbeats."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from .. import config
from ..errors import ClusterError, NodeFailedError, deadline, from_reply, node_failed
from .message import Message, Type, frame_json
from .van import ROLES, PeerGone, PeerUnreachable, Van

_LOOPBACK = ("127.", "localhost", "::1")
MOST_NODES = 1 << 16  # of a role: a bigger DMLC_NUM_* is a typo (it was a traceback, or a scheduler that filled memory naming the absent)
_LAUNCH = "start the program with `pskv launch -n WORKERS -s SERVERS -- COMMAND`"


def _int(environ: Mapping[str, str], name: str, low: int, high: Optional[int] = None) -> int:
    if not (raw := environ.get(name, "").strip()):
        raise ClusterError(f"{name} is not set: a dist store needs the job's environment ({_LAUNCH})")
    try:
        value = int(raw)
    except ValueError:
        raise ClusterError(f"{name}={raw!r} is not an integer") from None
    if value < low:
        raise ClusterError(f"{name}={value} must be >= {low}")
    if high is not None and value > high:
        raise ClusterError(f"{name}={value} is more than a job can have (at most {high})")
    return value


@dataclass(frozen=True)
class JobEnv:
    """The ``DMLC_*`` contract of one process, parsed and checked."""

    role: str
    root_uri: str
    root_port: int
    num_workers: int
    num_servers: int
    worker_id: Optional[int] = None
    server_id: Optional[int] = None
    node_host: Optional[str] = None
    interface: Optional[str] = None

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> JobEnv:
        """Read and check the variables; a :class:`ClusterError` names the first bad one."""
        env = os.environ if environ is None else environ
        role = env.get("DMLC_ROLE", "").strip().lower()
        if role not in ROLES:
            shown = f"={role!r}" if role else " is not set"
            raise ClusterError(f"DMLC_ROLE{shown}; it must be one of {', '.join(ROLES)} ({_LAUNCH})")
        if not (uri := env.get("DMLC_PS_ROOT_URI", "").strip()):
            raise ClusterError("DMLC_PS_ROOT_URI (the scheduler's address) is not set")
        if role == "worker" and env.get("DMLC_NUM_SERVER", "").strip() == "0":  # (pskv launch -s 0 starts no scheduler)
            raise ClusterError("the job has no servers (DMLC_NUM_SERVER=0, `pskv launch -s 0`): a dist store needs at least "
                               "one; launch with -s 1 or more, or use a local or device store")
        port = 0 if uri.startswith("inproc://") else _int(env, "DMLC_PS_ROOT_PORT", 0)
        workers, servers = _int(env, "DMLC_NUM_WORKER", 1, MOST_NODES), _int(env, "DMLC_NUM_SERVER", 0, MOST_NODES)
        wid, sid = (_int(env, name, 0) if env.get(name, "").strip() else None for name in ("DMLC_WORKER_ID", "DMLC_SERVER_ID"))
        if port > 65535 or (port == 0 and role != "scheduler" and not uri.startswith("inproc://")):  # (0: the launcher's scheduler picks one)
            raise ClusterError(f"DMLC_PS_ROOT_PORT={port} is not a port to reach the scheduler at (1 to 65535)")
        host, interface = env.get("DMLC_NODE_HOST", "").strip() or None, env.get("DMLC_INTERFACE", "").strip() or None
        for name, value in (("DMLC_PS_ROOT_URI", uri), ("DMLC_NODE_HOST", host)):
            try:  # (a name that does not resolve waited PSKV_START_TIMEOUT for the scheduler, or was advertised)
                if value and not value.startswith("inproc://"):
                    socket.getaddrinfo(value, port)
            except socket.gaierror as exc:
                if exc.errno == socket.EAI_NONAME:  # (not a DNS server that failed for now: zmq tries again)
                    raise ClusterError(f"{name}={value!r}: cannot resolve that name ({exc.strerror})") from None
        if role == "worker" and wid is not None and wid >= workers:
            raise ClusterError(f"DMLC_WORKER_ID={wid} but the job has DMLC_NUM_WORKER={workers} workers")
        if role == "server" and sid is not None and sid >= servers:
            raise ClusterError(f"DMLC_SERVER_ID={sid} but the job has DMLC_NUM_SERVER={servers} servers")
        return cls(role, uri, port, workers, servers, wid if role == "worker" else None, sid if role == "server" else None, host, interface)

    @property
    def inproc(self) -> bool:
        return self.root_uri.startswith("inproc://")

    @property
    def scheduler_endpoint(self) -> str:
        if self.inproc:
            return self.root_uri
        host = f"[{self.root_uri}]" if ":" in self.root_uri else self.root_uri
        return f"tcp://{host}:{self.root_port}"

    def listen_endpoint(self) -> str:
        """Where this node accepts connections (port chosen by the system)."""
        if self.inproc:
            return f"{self.root_uri}/{self.role}/{uuid.uuid4().hex[:8]}"
        return f"tcp://{bind_address(self.advertised_host())}:0"

    def reachable(self, bound: str) -> str:
        """The endpoint others reach ``bound`` at: one bound to every interface (``DMLC_NODE_HOST`` is no address
        of this host: behind NAT, in a container) is at the advertised host, as ps-lite's (it said tcp://0.0.0.0)."""
        host = self.advertised_host()
        return bound if ":" in host else bound.replace("//0.0.0.0:", f"//{host}:", 1)  # (an IPv6 host: bound to IPv4's 0.0.0.0)

    def advertised_host(self) -> str:
        """The address other nodes use to reach this node."""
        if self.node_host:
            return self.node_host
        if self.interface:
            return interface_address(self.interface)
        if self.root_uri.startswith(_LOOPBACK):
            return "127.0.0.1"
        return route_address(self.root_uri)


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux)."""
    import fcntl
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        except OSError as exc:
            raise ClusterError(f"DMLC_INTERFACE={name!r}: no IPv4 address on that interface ({exc})") from None
    return socket.inet_ntoa(packed[20:24])


def route_address(remote: str) -> str:
    """This host's address on the route to ``remote`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((remote, 9))
            return str(s.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def bind_address(host: str) -> str:
    """An address to bind for ``host``: its IP if this machine has it, else all interfaces."""
    try:
        ip = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return ip
    except OSError:
        return "0.0.0.0"


def host_identity() -> str:
    """Equal for processes that can share memory: same boot and the same pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{ns}"


class Node:
    """This process's seat in a job: its van, rank, the node table, heartbeats to the scheduler. Owned
    by one thread (the server's loop or the worker client's I/O thread)."""

    def __init__(self, env: JobEnv):
        self.env = env
        self.role = env.role
        self.van = Van(env.role)
        watch_launcher(self.van)
        self.asked = env.worker_id if env.role == "worker" else env.server_id  # the rank asked for (None: any)
        self.van.identity = (env.role, -1 if self.asked is None else self.asked)
        self.rank, self.rejoined = -1, False  # rejoined: in a lost worker's place, in a running job
        self.servers: list[dict[str, Any]] = []
        self.workers: list[dict[str, Any]] = []
        self.hb_interval, self.hb_timeout = config.heartbeat_interval(), config.heartbeat_timeout()
        self._next_hb = 0.0
        self.last_heard = time.monotonic()  # from the scheduler

    @property
    def across_hosts(self) -> bool:
        """The job's nodes (in the table ``join`` got) are on more than one host."""
        return len({n.get("host") for n in [*self.servers, *self.workers]}) > 1

    def join(self, endpoint: Optional[str]) -> list[tuple[str, Message]]:
        """Register and wait for the node table (``PSKV_START_TIMEOUT``); what came meanwhile and with it."""
        env = self.env
        self.van.connect("scheduler", env.scheduler_endpoint, watch=True)
        meta: dict[str, Any] = {
            "role": self.role, "endpoint": endpoint, "host": "inproc" if env.inproc else env.advertised_host(),
            "hostname": socket.gethostname(), "pid": os.getpid(), "shm_host": host_identity(), "id": self.asked,
            "counts": [env.num_servers, env.num_workers],  # the scheduler's must be the same
            # every worker's must be the same (the scheduler compares); the biggest frame a server takes, for the workers
            **({"placement": config.placement()} if self.role == "worker" else {"max_frame": config.max_frame_bytes()}),
        }
        self.van.send("scheduler", Message(Type.REGISTER, meta=meta))
        say(self.role, f"registering with the scheduler at {env.scheduler_endpoint} (pid {os.getpid()}); waiting for the node table")
        wait = config.start_timeout()
        until = time.monotonic() + wait + 2.0  # the scheduler's error, naming who is missing, comes first
        early: list[tuple[str, Message]] = []
        heard = False  # from the scheduler: one that never answers may drop what we send (docs/DESIGN.md, "Who may talk to a job")
        ours = "it ignores a process with another PSKV_SECRET or PSKV_ENCRYPT"
        while (left := until - time.monotonic()) > 0:
            if time.monotonic() >= self._next_hb:  # alive while it waits: a closed connection is then a process gone
                self._next_hb = time.monotonic() + self.hb_interval
                self.van.send("scheduler", Message(Type.HEARTBEAT))
            for peer, msg in self.van.recv(min(left, 0.5, self.hb_interval)):
                if isinstance(msg, PeerGone):
                    raise self.lost(peer) if heard or peer != "scheduler" else NodeFailedError(
                        f"the scheduler at {env.scheduler_endpoint} closed its connection before it answered this {self.role}: it exited or "
                        f"was killed, or {ours}")
                if isinstance(msg, Exception):
                    continue
                heard = heard or peer == "scheduler"
                if peer != "scheduler":
                    early.append((peer, msg))
                elif msg.type == Type.ERROR:
                    raise from_reply(msg.meta, f"the scheduler refused this {self.role}: ")
                elif msg.type == Type.NODE_FAILED:  # after the table: this node, declared lost while it was stopped
                    raise failure(msg)
                elif msg.type == Type.NODES:
                    table = {**(msg.meta or {}), **frame_json(msg.frames[0] if msg.frames else b"")}
                    self.rank, self.rejoined = int(table["rank"]), bool(table.get("rejoined"))
                    self.van.identity = (self.role, self.rank)
                    self.servers, self.workers = list(table["servers"]), list(table["workers"])
                    if (beat := float(table.get("heartbeat") or self.hb_interval)) < self.hb_interval:  # the scheduler's timeout is shorter
                        self.hb_interval, self._next_hb = beat, 0.0
                    self.last_heard = time.monotonic()
                elif msg.type != Type.HEARTBEAT_ACK:  # news sent right after the table (SERVER_LOST, WORKER_LEFT): the caller's
                    early.append((peer, msg))
            if self.rank >= 0:  # (once the rest of the table's batch is read)
                return early
        missing = (f"the node table from the scheduler at {env.scheduler_endpoint}: is it running, and did every server and worker start?"
                   if heard else f"any answer from the scheduler at {env.scheduler_endpoint}: is it running there? ({ours})")
        raise deadline(f"this {self.role}, joining the job,", wait, "PSKV_START_TIMEOUT", wait, missing)

    @property
    def name(self) -> str:
        return f"{self.role} {self.rank}"

    def beat(self, now: float) -> None:
        """Send a heartbeat when due (a server, also between the requests of a long batch)."""
        if now >= self._next_hb:
            self._next_hb = now + self.hb_interval
            with contextlib.suppress(PeerUnreachable):  # silence is judged by tick
                self.van.send("scheduler", Message(Type.HEARTBEAT))

    def tick(self, now: float) -> None:
        """Send a heartbeat when due; :class:`NodeFailedError` if the scheduler went silent."""
        self.beat(now)
        silent = self.van.polled - self.last_heard  # not ``now``: what waits unread is not silence
        if silent > self.hb_timeout:
            raise NodeFailedError(f"the scheduler at {self.env.scheduler_endpoint} has not answered for {silent:.1f} s "
                                  f"(PSKV_HEARTBEAT_TIMEOUT={self.hb_timeout:g}); it is presumed dead")

    def lost(self, peer: str) -> NodeFailedError:
        """The error for the end of a watched connection (the scheduler's) or of the launcher's lifeline."""
        if peer != "scheduler":
            return lost_launcher(peer, f"this {self.role}")
        return NodeFailedError(f"the scheduler at {self.env.scheduler_endpoint} closed its connection: it exited or was killed")


def watch_launcher(van: Van) -> None:
    """Stop when ``pskv launch`` is gone (``PSKV_LIFELINE``), as its processes' parent pipe ends."""
    if (fd := config.lifeline()) is not None:
        van.watch_pipe(fd, f"launcher (pid {os.getppid()})")


def lost_launcher(peer: str, who: str) -> NodeFailedError:
    return NodeFailedError(f"the {peer} that started this job is gone (killed?); {who} stops, so the job ends")


def say(who: str, text: str) -> None:
    """Log to stderr when ``PSKV_VERBOSE`` is set."""
    if config.verbose():
        print(f"pskv {who}: {text}", file=sys.stderr, flush=True)


def failure(msg: Message) -> NodeFailedError:
    """The error a NODE_FAILED message announces."""
    meta = msg.meta or {}
    return node_failed(meta, str(meta.get("reason", "unknown reason")))
