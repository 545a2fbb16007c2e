"""Key placement is a pure function of (key, size, servers) and follows SPEC.md section 3."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from pskv.ps.partition import place, server_of

BOUND = 1_000_000


@pytest.mark.parametrize("servers", [1, 2, 3, 4])
def test_small_arrays_live_whole_on_one_server_spread_evenly(servers: int) -> None:
    counts = Counter()
    for key in range(120):
        parts = place(key, 1000, servers, BOUND)
        assert len(parts) == 1 and (parts[0].start, parts[0].stop) == (0, 1000)
        assert parts[0].server == server_of(key, servers)
        counts[parts[0].server] += 1
    assert set(counts) == set(range(servers))
    assert max(counts.values()) - min(counts.values()) <= 2
    strided = Counter(server_of(k, 2) for k in range(0, 400, 4))  # keys a user might pick by hand
    assert min(strided.values()) >= 40


@pytest.mark.parametrize(("numel", "row", "servers"), [(1200 * 1200, 1200, 2), (1211 * 1211, 1211, 2), (1211 * 1211, 1211, 3), (3_000_001, 1, 4)])
def test_big_arrays_are_contiguous_slices_over_all_servers(numel: int, row: int, servers: int) -> None:
    parts = place(7, numel, servers, BOUND, row_numel=row)
    assert [p.server for p in parts] == list(range(servers))
    assert parts[0].start == 0 and parts[-1].stop == numel
    for a, b in itertools.pairwise(parts):
        assert a.stop == b.start
    for p in parts:
        assert p.start % row == 0 and p.stop % row == 0
    sizes = [p.numel for p in parts]
    assert max(sizes) - min(sizes) <= row


def test_bound_is_inclusive_for_slicing_and_placement_is_deterministic() -> None:
    assert len(place(1, BOUND - 1, 2, BOUND)) == 1
    assert len(place(1, BOUND, 2, BOUND)) == 2
    assert place(5, 5_000_000, 3, BOUND) == place(5, 5_000_000, 3, BOUND)


def test_chunks_cut_slices_into_parts() -> None:
    parts = place(0, 10, 2, 5, chunk=3)
    assert [(p.index, p.server, p.start, p.stop) for p in parts] == [(0, 0, 0, 3), (1, 0, 3, 5), (2, 1, 5, 8), (3, 1, 8, 10)]
    rows = place(0, 40, 2, 5, row_numel=4, chunk=6)  # a chunk keeps whole rows
    assert all(p.numel % 4 == 0 for p in rows)


def test_empty_and_bad_inputs() -> None:
    assert place(0, 0, 2, BOUND)[0].numel == 0
    with pytest.raises(ValueError, match="num_servers"):
        place(0, 10, 0, BOUND)
