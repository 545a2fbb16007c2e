"""Opt-in timeline of every process of a job (docs/DESIGN.md, "Timeline"): ``PSKV_TIMELINE=path``, nearly free when off;
``t0 = timeline.now(); ...; timeline.span("send PUSH", t0, parts=12)``. Each process appends its spans to
``path.<role>-<rank>.json`` (a Chrome trace in the JSON array format, its ``]`` left out, one event a line)."""

from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import signal
import sys
import threading
import time
from typing import Any

on = False
_fd = -1
_lines: list[str] = []
_lock = threading.Lock()
_pid = 0
_wall = 0.0  # time.time() - perf_counter(): spans are timed by perf_counter and written in wall-clock time
_threads: dict[int, int] = {}


def start(role: str, rank: int) -> None:
    global on, _fd, _pid, _wall
    path = os.environ.get("PSKV_TIMELINE", "")
    if not path or on:
        return
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(21, "a directory, not a file name", path)
        _fd = os.open(f"{path}.{role}-{rank}.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as exc:
        print(f"pskv {role} {rank}: no timeline: PSKV_TIMELINE={path}: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return
    on, _pid, _wall = True, {"scheduler": 0, "server": 100, "worker": 1000}.get(role, 9000) + rank, time.time() - time.perf_counter()
    _lines.append("[\n" + json.dumps({"name": "process_name", "ph": "M", "pid": _pid, "args": {"name": f"{role} {rank}"}}) + ",\n")
    atexit.register(_write)
    os.register_at_fork(after_in_child=_off)  # a child of os.fork: the spans buffered and the process row are its parent's
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stopped)


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
            _lines.append(json.dumps({"name": "thread_name", "ph": "M", "pid": _pid, "tid": _threads[ident], "args": {"name": threading.current_thread().name}}) + ",\n")
        _lines.append(json.dumps({"name": name, "ph": "X", "ts": (begin + _wall) * 1e6, "dur": (end - begin) * 1e6, "pid": _pid, "tid": _threads[ident], "args": args}) + ",\n")
        if len(_lines) >= 1000:
            _write()


def _off() -> None:
    global on, _lines
    on, _lines = False, []


def _write() -> None:
    global _lines
    lines, _lines = _lines, []
    os.write(_fd, "".join(lines).encode())


def _stopped(signum: int, frame: Any) -> None:
    """SIGTERM (how pskv launch stops a job): write the spans, then end as SIGTERM does."""
    _write()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def merge(path: str, since: float = 0.0) -> int:
    """Merge the per-process files ``path.*.json`` written since ``since`` (``time.time()``; older ones are
    another job's, left as they are) into ``path``, removing them; how many there were."""
    if not (parts := sorted(p for p in glob.glob(f"{glob.escape(path)}.*-*.json") if os.stat(p).st_mtime >= since)):
        return 0
    with open(path, "w") as out:
        out.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        sep = ""
        for part in parts:
            with open(part) as f:
                for line in f:
                    with contextlib.suppress(ValueError):  # a line cut short (a process killed as it wrote) is left out
                        out.write(sep + json.dumps(json.loads(line.rstrip().rstrip(","))))
                        sep = ",\n"
        out.write("]}\n")
    for part in parts:
        os.unlink(part)
    return len(parts)
