"""Whole lines out of byte streams: the one line pump of the launcher.

The process context (a job's local processes), ``pskv.launch.guard`` (a command's output on a
remote host) and the follower of batch jobs' output files all copy output line by line, so that
lines of different processes never mix. Standard library only: the guard imports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO


class LineBuffer:
    """Bytes in, whole lines out. A line ends with ``\\n``, ``\\r\\n`` or ``\\r`` (progress bars)
    and keeps its ending; bytes after the last ending wait for the next chunk."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines that ``chunk`` completes."""
        lines = (self._rest + chunk).splitlines(keepends=True)
        self._rest = lines.pop() if lines and not lines[-1].endswith((b"\n", b"\r")) else b""
        return lines

    def end(self) -> list[bytes]:
        """What is left at the end of the stream, as one line with ``\\n`` added (or none)."""
        rest, self._rest = self._rest, b""
        return [rest + b"\n"] if rest else []


def pump(pipe: IO[bytes], emit: Callable[[list[bytes]], None]) -> None:
    """Read ``pipe`` until EOF, handing each batch of whole lines to ``emit``; then close it.

    Blocks until the writer closes the pipe: run it in a thread of its own per pipe.
    """
    buffer = LineBuffer()
    while True:
        try:
            chunk = os.read(pipe.fileno(), 65536)
        except OSError:
            chunk = b""
        lines = buffer.feed(chunk) if chunk else buffer.end()
        if lines:
            emit(lines)
        if not chunk:
            break
    pipe.close()
