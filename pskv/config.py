"""pskv's settings: a short list of environment variables, read through one typed helper.

========================== ======== ============================================================
variable                   default  meaning
========================== ======== ============================================================
``PSKV_TIMEOUT``           300      seconds any blocking call (pull, barrier, ...) may wait
``PSKV_START_TIMEOUT``     120      seconds for every node to register with the scheduler
``PSKV_HEARTBEAT_TIMEOUT`` 30       seconds of silence after which a node is declared dead
``PSKV_HEARTBEAT_INTERVAL`` 1       seconds between heartbeats (kept below the timeout / 3)
``PSKV_BIGARRAY_BOUND``    1000000  arrays with at least this many elements are sliced over servers
``PSKV_CHUNK_BYTES``       4194304  big slices are cut into parts of at most this many bytes
``PSKV_BATCH_BYTES``       8388608  a push goes to a TCP server in messages of about this many bytes
``PSKV_SHM``               auto     shared memory between nodes on one host: auto, 0 (off), 1 (required)
``PSKV_SERVER_THREADS``    cores/2  torch threads of a server (1 to 4)
``PSKV_VERBOSE``           0        1: log node start-up, registration and shutdown to stderr
``PSKV_TIMELINE``          (off)    a path: every process records a timeline there (:mod:`pskv.ps.timeline`)
========================== ======== ============================================================

The ``DMLC_*`` variables that say who a process is (role, scheduler address, counts) are read in
:mod:`pskv.ps.node`; they keep the names that existing parameter-server tooling sets.
"""

from __future__ import annotations

import os
from typing import TypeVar, overload

T = TypeVar("T", int, float, str, bool)


@overload
def getenv(name: str, default: bool) -> bool: ...
@overload
def getenv(name: str, default: int) -> int: ...
@overload
def getenv(name: str, default: float) -> float: ...
@overload
def getenv(name: str, default: str) -> str: ...


def getenv(name: str, default: int | float | str | bool) -> int | float | str | bool:
    """Read ``name`` from the environment, parsed as the type of ``default``.

    An unset or empty variable gives ``default``; a value that does not parse is a
    ``ValueError`` naming the variable, so a typo never silently falls back.

    >>> getenv("PSKV_TIMEOUT", 300.0)
    300.0
    """
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return default
    try:
        if isinstance(default, bool):
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        return raw
    except ValueError:
        kind = type(default).__name__
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {kind}") from None


def timeout() -> float:
    """``PSKV_TIMEOUT``: the deadline of every blocking call, in seconds."""
    return getenv("PSKV_TIMEOUT", 300.0)


def start_timeout() -> float:
    """``PSKV_START_TIMEOUT``: how long nodes wait for the whole job to register."""
    return getenv("PSKV_START_TIMEOUT", 120.0)


def heartbeat_timeout() -> float:
    """``PSKV_HEARTBEAT_TIMEOUT``: silence after which a node counts as dead."""
    return getenv("PSKV_HEARTBEAT_TIMEOUT", 30.0)


def heartbeat_interval() -> float:
    """``PSKV_HEARTBEAT_INTERVAL``, capped at a third of the heartbeat timeout."""
    return min(getenv("PSKV_HEARTBEAT_INTERVAL", 1.0), heartbeat_timeout() / 3.0)


def bigarray_bound() -> int:
    """``PSKV_BIGARRAY_BOUND``: arrays with at least this many elements are sliced."""
    bound = getenv("PSKV_BIGARRAY_BOUND", 1_000_000)
    if bound < 1:
        raise ValueError(f"PSKV_BIGARRAY_BOUND must be positive, got {bound}")
    return bound


def chunk_bytes() -> int:
    """``PSKV_CHUNK_BYTES``: the largest part a big array's slice is cut into (0: no cutting)."""
    return max(0, getenv("PSKV_CHUNK_BYTES", 4 << 20))


def batch_bytes() -> int:
    """``PSKV_BATCH_BYTES``: a push call sends a TCP server a message every this many bytes, so the
    server merges the first parts while the rest are on the wire (through shared memory a push
    is one message per server)."""
    return max(1, getenv("PSKV_BATCH_BYTES", 8 << 20))


def verbose() -> bool:
    """``PSKV_VERBOSE``: log the life of each node to stderr."""
    return getenv("PSKV_VERBOSE", False)
