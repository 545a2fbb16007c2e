"""Which server holds which elements of a key: pure functions of (key, size, servers), by the
rules of docs/DESIGN.md ("Keys, parts and placement"). Imports nothing from pskv.

>>> [p.server for p in place(key=0, numel=4_000_000, num_servers=2, bound=1_000_000)]
[0, 1]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Part:
    """Elements ``[start, stop)`` of the flattened array, held by ``server``."""

    index: int
    server: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def server_of(key: int, num_servers: int) -> int:
    """The server of a small array: Fibonacci hashing of ``key`` into ``num_servers`` buckets."""
    h = ((key + 1) * _GOLDEN) & _MASK
    return (h * num_servers) >> 64


def place(key: int, numel: int, num_servers: int, bound: int, row_numel: int = 1,
          chunk: Optional[int] = None) -> list[Part]:
    """The parts of ``key`` (``numel`` elements; rows of ``row_numel`` elements stay whole); ``chunk``
    (elements) cuts each server's slice further (``None``: one part per server)."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    if numel < bound or num_servers == 1:
        slices = [(server_of(key, num_servers), 0, numel)]
    else:
        row_numel = max(1, row_numel)
        cuts = [numel // row_numel * s // num_servers * row_numel for s in range(num_servers + 1)]  # whole rows each
        slices = [(s, cuts[s], cuts[s + 1]) for s in range(num_servers) if cuts[s + 1] > cuts[s]]
    parts: list[Part] = []
    for server, start, stop in slices:
        step = max(row_numel, chunk // row_numel * row_numel) if chunk else max(stop - start, 1)
        for pos in range(start, max(stop, start + 1), step):  # an empty slice is one empty part
            parts.append(Part(len(parts), server, pos, min(stop, pos + step)))
    return parts
