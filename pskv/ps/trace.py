"""Opt-in timeline of a process's data path: ``PSKV_TRACE=DIR`` (off by default, nearly free then).

Each process records ``(time, event)`` pairs with the clock every process on a host shares
(``time.perf_counter``: CLOCK_MONOTONIC on Linux) and writes them to ``DIR/<role>-<rank>.trace``
when it exits, one ``seconds event`` line each. ``benchmarks/profile_round.py`` merges the files
into one timeline per round.
"""

from __future__ import annotations

import atexit
import os
import time
from typing import Optional

_events: Optional[list[tuple[float, str]]] = None
_path: Optional[str] = None


def start(name: str) -> None:
    """Begin recording for this process, named e.g. ``server-1``, if ``PSKV_TRACE`` is set."""
    global _events, _path
    directory = os.environ.get("PSKV_TRACE", "")
    if not directory or _events is not None:
        return
    os.makedirs(directory, exist_ok=True)
    _events, _path = [], os.path.join(directory, f"{name}.trace")
    atexit.register(dump)


def event(what: str) -> None:
    """Record ``what`` now (a no-op unless tracing)."""
    if _events is not None:
        _events.append((time.perf_counter(), what))


def dump() -> None:
    if _events is not None and _path is not None:
        with open(_path, "w") as f:
            f.writelines(f"{t:.6f} {what}\n" for t, what in _events)
