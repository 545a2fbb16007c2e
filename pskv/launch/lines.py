"""Whole lines out of byte streams, so that lines of different processes never mix: the pipes of
the job's local processes, of the guard's command, and the batch jobs' output files.
Standard library only (the guard imports it)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import IO


class LineBuffer:
    """Bytes in, whole lines out; a line ends with ``\\n``, ``\\r\\n`` or ``\\r`` (progress bars) and
    keeps its ending. A partial line waits for the next chunk."""

    def __init__(self) -> None:
        self.rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        lines = (self.rest + chunk).splitlines(keepends=True)
        self.rest = lines.pop() if lines and not lines[-1].endswith((b"\n", b"\r")) else b""
        return lines

    def end(self) -> list[bytes]:
        """The partial line left at the end of the stream, with ``\\n`` added (or none)."""
        rest, self.rest = self.rest, b""
        return [rest + b"\n"] if rest else []


def pump(pipe: IO[bytes], emit: Callable[[list[bytes]], None]) -> None:
    """Hand each batch of whole lines read from ``pipe`` to ``emit`` until EOF, then close it.
    Blocks: run one thread per pipe."""
    buffer = LineBuffer()
    with pipe:
        for chunk in iter(functools.partial(os.read, pipe.fileno(), 65536), b""):
            emit(buffer.feed(chunk))
        emit(buffer.end())
