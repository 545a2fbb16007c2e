"""pskv's settings: a short list of environment variables, read through one typed helper.

variable                   default  meaning
``PSKV_TIMEOUT``           300      seconds any blocking call (pull, barrier, ...) may wait
``PSKV_START_TIMEOUT``     120      seconds for every node to register with the scheduler
``PSKV_HEARTBEAT_TIMEOUT`` 30       seconds of silence after which a node is declared dead
``PSKV_HEARTBEAT_INTERVAL`` 1       seconds between heartbeats (kept below the timeout / 3)
``PSKV_BIGARRAY_BOUND``    65536    arrays with at least this many elements are cut over all servers (MXNet: 1e6)
``PSKV_CHUNK_BYTES``       4 MB     big slices are cut into parts of at most this many bytes (0: not cut); 1 MB when the job spans hosts
``PSKV_BATCH_BYTES``       8 MB     a push goes to a TCP server in messages of about this many bytes; 256 KB when the job spans hosts
``PSKV_WINDOW_BYTES``      0        pushes handed to a TCP server's connection and not yet sent, at most (0: any); later ones wait, the highest priority first; 4 MB when the job spans hosts; below 4 MB it caps the kernel's send buffer too
``PSKV_MAX_MESSAGE_BYTES`` 64 MB    a server disconnects a client that sends a bigger frame; at least 2 x ``PSKV_CHUNK_BYTES``
``PSKV_REPLICAS``          0        R: every part is also kept by the next R servers, and the job survives R lost servers (``pskv launch --replicas``)
``PSKV_MIN_WORKERS``       0        go on while this many workers live (``pskv launch --min-workers``); 0: a lost worker ends the job
``PSKV_MAX_RESTARTS``      0        start a lost worker anew, this many times in all (``pskv launch --max-restarts``)
``PSKV_NONFINITE``         error    a pushed NaN/Inf: ``error`` (the push fails), ``skip`` (counted, pushed as 0) or ``allow``; a worker's skip/allow goes with its pushes
``PSKV_SECRET``            (none)   the job's secret (``pskv launch`` makes one); or ``PSKV_SECRET_FILE``, a file only its owner reads
``PSKV_ENCRYPT``           0        1: encrypt every connection (CURVE, keys derived from the secret; slower, docs/DESIGN.md)
``PSKV_SHM``               auto     shared memory between nodes on one host: auto, 0 (off), 1 (required)
``PSKV_SERVER_THREADS``    auto     torch threads of a server; auto (0): the host's cores shared among the job's processes on it
``PSKV_VERBOSE``           0        1: log node start-up, registration (where, what was joined) and shutdown to stderr (ps-lite's ``PS_VERBOSE`` >= 1 too)
``PSKV_TIMELINE``          (off)    a path: every process records a timeline there (:mod:`pskv.ps.timeline`)
``PSKV_LIFELINE``          (set)    ``fd:inode`` of a pipe from ``pskv launch``: its end stops every process of the job
``PSKV_SSH``               ssh      the command ``pskv launch --launcher ssh`` reaches hosts with

The ``DMLC_*`` variables that say who a process is (role, scheduler address, counts) are read in
:mod:`pskv.ps.node`; they keep the names that existing parameter-server tooling sets."""

from __future__ import annotations

import os
import re
import stat
from functools import partial
from typing import Optional, TypeVar

from .errors import ConfigError

T = TypeVar("T", int, float, str, bool)
# the settings above, and those that pskv launch sets for its processes
NAMES = frozenset([*re.findall(r"PSKV_[A-Z_]+", __doc__), "PSKV_PORT_FD", "PSKV_RESTARTS", "PSKV_RANK"]) if __doc__ else frozenset()


def getenv(name: str, default: T, least: Optional[T] = None, *, minimum: Optional[T] = None, choices: tuple[str, ...] = ()) -> T:
    """``name`` from the environment parsed as the type of ``default``, e.g. ``getenv("PSKV_TIMEOUT", 300.0)``.
    Unset or empty gives ``default``; a value that does not parse, is below ``minimum`` or is not one of
    ``choices`` (a str, in lower case) is a ``ValueError`` naming it; one below ``least`` is taken as ``least``."""
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return default
    try:
        if isinstance(default, bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        value = raw.lower() if isinstance(default, str) else type(default)(raw)
        if (minimum is not None and not value >= minimum) or (choices and value not in choices):  # (not >=: NaN too)
            raise ValueError(raw)
    except ValueError:
        rule = f" >= {minimum}" if minimum is not None else f": one of {', '.join(choices)}" if choices else ""
        raise ConfigError(f"environment variable {name}={raw!r} is not a valid {type(default).__name__}{rule}") from None
    return value if least is None else max(least, value)


# One reader per setting of the table above.
timeout = partial(getenv, "PSKV_TIMEOUT", 300.0, minimum=0.01)
start_timeout = partial(getenv, "PSKV_START_TIMEOUT", 120.0, minimum=0.01)
heartbeat_timeout = partial(getenv, "PSKV_HEARTBEAT_TIMEOUT", 30.0, minimum=0.01)
def verbose() -> bool:
    return getenv("PSKV_VERBOSE", False) or getenv("PS_VERBOSE", 0, minimum=0) > 0
min_workers = partial(getenv, "PSKV_MIN_WORKERS", 0, minimum=0)
replicas = partial(getenv, "PSKV_REPLICAS", 0, minimum=0)  # backups of each part
bigarray_bound = partial(getenv, "PSKV_BIGARRAY_BOUND", 65_536, minimum=1)
nonfinite = partial(getenv, "PSKV_NONFINITE", "error", choices=("error", "skip", "allow"))
encrypt = partial(getenv, "PSKV_ENCRYPT", False)
shm = partial(getenv, "PSKV_SHM", "auto", choices=("auto", "0", "1"))


def placement() -> dict[str, object]:
    """The settings that say where keys' parts go and are kept, and whether the job outlives a worker: every
    worker needs the same, and ``PSKV_REPLICAS``, ``PSKV_MIN_WORKERS`` the scheduler's too (it registers them; the scheduler compares)."""
    chunk = chunk_bytes(False) if os.environ.get("PSKV_CHUNK_BYTES", "").strip() else "unset"  # (unset: by the hosts, alike)
    return {"PSKV_BIGARRAY_BOUND": bigarray_bound(), "PSKV_CHUNK_BYTES": chunk, "PSKV_REPLICAS": replicas(), "PSKV_MIN_WORKERS": min_workers()}


def chunk_bytes(across_hosts: bool) -> int:
    """Smaller parts across hosts let answers flow down a link while pushes flow up (benchmarks/RESULTS.md, 10)."""
    return getenv("PSKV_CHUNK_BYTES", 1 << 20 if across_hosts else 4 << 20, least=0)


def batch_bytes(across_hosts: bool) -> int:
    return getenv("PSKV_BATCH_BYTES", 256 << 10 if across_hosts else 8 << 20, least=1)


KERNEL_SNDBUF = 4 << 20  # the most Linux lets a TCP send buffer grow to by default (net.ipv4.tcp_wmem)


def window_bytes(across_hosts: bool) -> int:
    """Bytes of pushes zmq holds for a server's connection (a smaller window than KERNEL_SNDBUF caps the kernel's
    send buffer too): what a later, more urgent push waits behind (benchmarks/RESULTS.md, 12 and 13)."""
    return getenv("PSKV_WINDOW_BYTES", KERNEL_SNDBUF if across_hosts else 0, least=0)


def max_frame_bytes() -> int:
    chunk = chunk_bytes(False)
    return getenv("PSKV_MAX_MESSAGE_BYTES", max(64 << 20, 2 * chunk) if chunk else 0, least=0)


def secret() -> Optional[bytes]:
    """The job's secret from ``PSKV_SECRET``, or the file ``PSKV_SECRET_FILE`` (readable by its owner only)."""
    value, path = os.environ.get("PSKV_SECRET", "").strip(), os.environ.get("PSKV_SECRET_FILE", "").strip()
    if not value and path:
        try:
            if os.stat(path).st_mode & 0o077:
                raise ConfigError(f"PSKV_SECRET_FILE={path} may be read by others; `chmod 600 {path}`")
            with open(path) as f:
                value = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"PSKV_SECRET_FILE={path}: {exc.strerror or exc}") from None
    if value and len(value) < 16:
        raise ConfigError("the job's secret (PSKV_SECRET or PSKV_SECRET_FILE) must have at least 16 characters")
    return value.encode() if value else None


def lifeline() -> Optional[int]:
    """The read end of the launcher's lifeline pipe, if this process holds it (``PSKV_LIFELINE``:
    ``fd:inode``; a process that only inherited the variable, not the pipe, has none)."""
    fd, _, inode = os.environ.get("PSKV_LIFELINE", "").partition(":")
    try:
        st = os.fstat(int(fd))
        return int(fd) if stat.S_ISFIFO(st.st_mode) and st.st_ino == int(inode) else None
    except (ValueError, OSError):
        return None


def heartbeat_interval() -> float:
    return min(getenv("PSKV_HEARTBEAT_INTERVAL", 1.0, minimum=0.01), heartbeat_timeout() / 3.0)


def server_threads(processes_here: int) -> int:
    """``PSKV_SERVER_THREADS``, or the cores this process may use shared among the job's ``processes_here``."""
    return getenv("PSKV_SERVER_THREADS", 0, minimum=0) or max(1, len(os.sched_getaffinity(0)) // max(1, processes_here))
