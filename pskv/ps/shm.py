"""Shared memory between nodes on one host: arenas we own, and the peers' arenas we map.

An :class:`Arena` is an anonymous memory file (``memfd_create``) mapped into this process and
carved into slots. A peer on the same host maps it through ``/proc/<pid>/fd/<fd>``: no names
in ``/dev/shm``, so nothing leaks when a process dies. Each arena starts with a header holding a
magic string and a random token; :meth:`Mappings.tensor` checks it before any slot is used, and
a probe at connection time (``SHM_PROBE``) proves both directions work, else the pair uses TCP.

Worker -> server: the worker sums its device values straight into its slot of the part, and
sends only a header (fd, offset, bytes). Server -> worker: the stored values live in the
server's arenas; a pull is answered with a header and the worker copies the bytes out.

``PSKV_SHM``: ``auto`` (default: use shared memory with every peer the probe succeeds with),
``0`` (never), ``1`` (require it: a failed probe is an error).
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
from typing import Optional

import torch

from .. import config
from ..errors import ClusterError, ProtocolError

MAGIC = b"PSKVSHM1"
HEADER = struct.Struct("<8s16s")  # magic, token
ALIGN = 64
DEFAULT_ARENA = 64 << 20


def mode() -> str:
    """``PSKV_SHM``: ``auto``, ``0`` or ``1``."""
    value = config.getenv("PSKV_SHM", "auto").lower()
    if value not in ("auto", "0", "1"):
        raise ClusterError(f"PSKV_SHM={value!r}: use auto, 0 or 1")
    return value


class Arena:
    """A shared region this process owns; slots are handed out by :meth:`alloc` (never freed)."""

    def __init__(self, size: int = DEFAULT_ARENA):
        self.size = max(size, ALIGN)
        self.fd = os.memfd_create("pskv", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.mm = mmap.mmap(self.fd, self.size)
        self.token = secrets.token_bytes(16)
        HEADER.pack_into(self.mm, 0, MAGIC, self.token)
        self.used = ALIGN

    def alloc(self, nbytes: int) -> Optional[int]:
        """The offset of a fresh slot of ``nbytes``, or None when the arena is full."""
        start = self.used
        end = start + -(-max(nbytes, 1) // ALIGN) * ALIGN
        if end > self.size:
            return None
        self.used = end
        return start

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor over the slot at ``offset``."""
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.mm, dtype=dtype, count=numel, offset=offset)


class Arenas:
    """This process's arenas: slots come from the newest one; a new arena when it is full."""

    def __init__(self) -> None:
        self.all: list[Arena] = []

    def slot(self, nbytes: int) -> tuple[Arena, int]:
        if self.all:
            offset = self.all[-1].alloc(nbytes)
            if offset is not None:
                return self.all[-1], offset
        arena = Arena(max(DEFAULT_ARENA, nbytes + 2 * ALIGN))
        self.all.append(arena)
        offset = arena.alloc(nbytes)
        assert offset is not None
        return arena, offset

    def first(self) -> Arena:
        if not self.all:
            self.all.append(Arena())
        return self.all[0]


class Mappings:
    """Other processes' arenas, mapped on first use and kept, by (pid, fd)."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._views: dict[tuple[int, int, int, int, torch.dtype], torch.Tensor] = {}  # slots are reused every round

    def map(self, pid: int, fd: int, token: Optional[bytes] = None) -> mmap.mmap:
        key = (pid, fd)
        mm = self._maps.get(key)
        if mm is None:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                handle = os.open(path, os.O_RDWR)
            except OSError as exc:
                raise ProtocolError(f"cannot open shared memory {path}: {exc}") from None
            try:
                size = os.fstat(handle).st_size
                if size < HEADER.size:
                    raise ProtocolError(f"{path} is not a pskv arena")
                mm = mmap.mmap(handle, size)
            finally:
                os.close(handle)
            magic, _ = HEADER.unpack_from(mm, 0)
            if magic != MAGIC:
                mm.close()
                raise ProtocolError(f"{path} is not a pskv arena")
            self._maps[key] = mm
        if token is not None and HEADER.unpack_from(mm, 0)[1] != token:
            raise ProtocolError(f"shared memory of pid {pid} fd {fd} has another token")
        return mm

    def tensor(self, pid: int, fd: int, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor over ``nbytes`` at ``offset`` of a peer's arena (bounds and alignment checked)."""
        key = (pid, fd, offset, nbytes, dtype)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self._tensor(pid, fd, offset, nbytes, dtype)
        return view

    def _tensor(self, pid: int, fd: int, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        mm = self.map(pid, fd)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset < HEADER.size or nbytes < 0 or offset + nbytes > len(mm) or offset % itemsize or nbytes % itemsize:
            raise ProtocolError(f"shared-memory slot [{offset}, {offset + nbytes}) is outside pid {pid}'s arena of {len(mm)} bytes")
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(mm, dtype=dtype, count=nbytes // itemsize, offset=offset)
