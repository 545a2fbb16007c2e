"""Opt-in timeline of every process of a job: ``PSKV_TIMELINE=path`` (nearly free when off; docs/DESIGN.md),
``t0 = timeline.now(); ...; timeline.span("send PUSH", t0, parts=12)``. Each process writes its spans at exit
to ``path.<role>-<rank>.json`` with the clock its host shares; ``pskv launch`` merges them into ``path``."""

from __future__ import annotations

import atexit
import glob
import json
import os
import threading
import time
from typing import Any, Optional

on = False
_path = ""
_events: list[dict[str, Any]] = []
_lock = threading.Lock()
_pid = 0
_threads: dict[int, int] = {}


def start(role: str, rank: int) -> None:
    global on, _path, _pid
    path = os.environ.get("PSKV_TIMELINE", "")
    if not path or on:
        return
    on, _path = True, f"{path}.{role}-{rank}.json"
    _pid = {"scheduler": 0, "server": 100, "worker": 1000}.get(role, 9000) + rank
    _events.append({"name": "process_name", "ph": "M", "pid": _pid, "args": {"name": f"{role} {rank}"}})
    atexit.register(_dump)


now = time.perf_counter


def span(name: str, begin: float, **args: Any) -> None:
    """Record ``name`` from ``begin`` to now; ``args`` are shown with it."""
    if not on:
        return
    end = time.perf_counter()
    ident = threading.get_ident()
    with _lock:
        if ident not in _threads:  # a thread seen for the first time: name its row
            _threads[ident] = len(_threads)
            _events.append({"name": "thread_name", "ph": "M", "pid": _pid, "tid": _threads[ident], "args": {"name": threading.current_thread().name}})
        _events.append({"name": name, "ph": "X", "ts": begin * 1e6, "dur": (end - begin) * 1e6, "pid": _pid, "tid": _threads[ident], "args": args})


def _dump() -> None:
    with _lock, open(_path, "w") as f:
        json.dump({"traceEvents": _events}, f)


def merge(path: str) -> Optional[str]:
    """Merge the per-process files ``path.*.json`` into ``path`` (removing them); the path, or None if none."""
    if not (parts := sorted(glob.glob(f"{glob.escape(path)}.*-*.json"))):
        return None
    events: list[Any] = []
    for part in parts:
        with open(part) as f:
            events += json.load(f).get("traceEvents", [])
        os.unlink(part)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path
