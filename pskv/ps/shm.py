"""Shared memory between nodes on one host: arenas carved into slots, mapped by peers after a
token check (docs/DESIGN.md, "Two data paths", tells the protocol)."""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import weakref
from typing import Any, Optional

import torch

from ..errors import ProtocolError

MAGIC = b"PSKVSHM1"
HEADER = struct.Struct("<8s16s")  # magic, token
ALIGN = 64
DEFAULT_ARENA = 64 << 20


class Arena:
    """A shared region this process owns; ``used`` bytes of it are handed out as slots (never freed)."""

    def __init__(self, size: int = DEFAULT_ARENA):
        self.size = size
        self.fd = os.memfd_create("pskv", os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self.fd).atexit = False  # (the mapping has its own: the memory goes with both)
        os.ftruncate(self.fd, self.size)
        self.mm = mmap.mmap(self.fd, self.size)
        self.token = secrets.token_bytes(16)
        HEADER.pack_into(self.mm, 0, MAGIC, self.token)
        self.used = ALIGN

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.frombuffer(self.mm, dtype=dtype, count=numel, offset=offset) if numel else torch.empty(0, dtype=dtype)


class Shared:
    """One process's shared memory: its own arenas (a new one when the newest is full) and the peers' it has mapped, by (pid, fd)."""

    def __init__(self) -> None:
        self.arenas: list[Arena] = []
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}
        self.for_gpus = False  # peers' arenas are page-locked as they are mapped (pulls into GPU tensors)
        self._pins: dict[int, tuple[mmap.mmap, bool]] = {}  # id -> a mapping we page-locked, whether CUDA took it

    def pin(self, mm: mmap.mmap) -> None:
        """Page-lock a mapping for CUDA (once), so copies between it and a GPU run asynchronously."""
        if id(mm) not in self._pins:
            ptr = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
            self._pins[id(mm)] = (mm, int(torch.cuda.cudart().cudaHostRegister(ptr, len(mm), 0)) == 0)  # type: ignore[no-untyped-call]

    def pin_peers(self) -> None:
        """Page-lock the peers' arenas mapped so far and from now on: answers go from them to a GPU directly."""
        if not self.for_gpus:
            self.for_gpus = True
            for mm in self._maps.values():
                self.pin(mm)

    def close(self) -> None:
        """Unlock what :meth:`pin` locked: CUDA would refuse the addresses when later arenas are mapped there."""
        if self._pins:
            torch.cuda.synchronize()  # (no copy from them is in flight)
        for mm, ok in self._pins.values():
            if ok:
                torch.cuda.cudart().cudaHostUnregister(torch.frombuffer(mm, dtype=torch.uint8).data_ptr())  # type: ignore[no-untyped-call]
        self._pins.clear()

    def slot(self, nbytes: int) -> tuple[Arena, int]:
        """A fresh slot of ``nbytes`` in one of our arenas, and its offset."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        if not self.arenas or self.arenas[-1].used + size > self.arenas[-1].size:
            self.arenas.append(Arena(max(DEFAULT_ARENA, nbytes + 2 * ALIGN)))
        arena = self.arenas[-1]
        offset, arena.used = arena.used, arena.used + size
        return arena, offset

    def probe(self) -> dict[str, Any]:
        """What a peer needs to map our first arena: the SHM_PROBE metadata (and its answer)."""
        if not self.arenas:
            self.arenas.append(Arena())
        return {"pid": os.getpid(), "fd": self.arenas[0].fd, "token": self.arenas[0].token.hex()}

    def accept(self, probe: Any, pid: int) -> None:
        """Map the arena a peer's :meth:`probe` describes, if it comes from ``pid`` (the process
        the node table says) and holds the token; :class:`ProtocolError` otherwise."""
        try:
            if probe["pid"] != pid:
                raise ProtocolError(f"a shared-memory probe from pid {probe['pid']}, but the peer registered pid {pid}")
            self._map(pid, int(probe["fd"]), bytes.fromhex(str(probe["token"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"a malformed shared-memory probe: {exc!r}") from None

    def _map(self, pid: int, fd: int, token: Optional[bytes] = None) -> mmap.mmap:
        if (mm := self._maps.get((pid, fd))) is None:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                with open(path, "r+b", buffering=0) as f:
                    mm = mmap.mmap(f.fileno(), 0) if os.fstat(f.fileno()).st_size >= HEADER.size else None  # all of it
            except OSError as exc:
                raise ProtocolError(f"cannot open shared memory {path}: {exc}") from None
            if mm is None or HEADER.unpack_from(mm, 0)[0] != MAGIC:
                raise ProtocolError(f"{path} is not a pskv arena")
            self._maps[pid, fd] = mm
            if self.for_gpus:
                self.pin(mm)
        if token is not None and HEADER.unpack_from(mm, 0)[1] != token:
            raise ProtocolError(f"shared memory of pid {pid} fd {fd} has another token")
        return mm

    def tensor(self, pid: int, fd: int, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor over ``nbytes`` at ``offset`` of a peer's arena (bounds and alignment checked);
        kept, since slots are used again every round."""
        key = (pid, fd, offset, nbytes, dtype)
        if (view := self._views.get(key)) is None:
            mm = self._map(pid, fd)
            size = dtype.itemsize
            if offset < HEADER.size or nbytes < 0 or offset + nbytes > len(mm) or offset % size or nbytes % size:
                raise ProtocolError(f"shared-memory slot [{offset}, {offset + nbytes}) is outside pid {pid}'s arena of {len(mm)} bytes")
            view = torch.frombuffer(mm, dtype=dtype, count=nbytes // size, offset=offset) if nbytes else torch.empty(0, dtype=dtype)
            self._views[key] = view
        return view
