"""Time of Rounds.expire with N parts (one element each), 2 workers, every part through one complete round,
then WAIT parts with a pull waiting (worker 0 pushed round 2 and pulls it; worker 1 has not pushed).
The first sweep is not timed (it may clear parts whose waits were answered). Usage: python benchmarks/expire_sweep.py [N] [WAIT]"""
import statistics
import sys
import time

import torch

from pskv.ps.rounds import InitEntry, PullEntry, PushEntry, Rounds

N = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
WAIT = int(sys.argv[2]) if len(sys.argv) > 2 else 0
r = Rounds(2, timeout=300.0)
for rank in range(2):
    r.init("i", rank, "sync", [InitEntry(k, 0, str(k), torch.float32, 1, 1, torch.ones(1) if rank == 0 else None) for k in range(N)])
parts = [r.part(k, 0) for k in range(N)]
for rank in range(2):
    r.push("p", rank, [PushEntry(p, 1, torch.ones(1, 1), False) for p in parts])
    r.pull("q", rank, [PullEntry(p, 1) for p in parts])
r.push("p", 0, [PushEntry(p, 2, torch.ones(1, 1), False) for p in parts[:WAIT]])
assert r.pull("q", 0, [PullEntry(p, 2) for p in parts[:WAIT]]) == []
now = time.monotonic()
r.expire(now)
times = []
for _ in range(30):
    t0 = time.perf_counter()
    assert r.expire(now) == []
    times.append(time.perf_counter() - t0)
print(f"N={N} parts, {WAIT} waiting: expire median {statistics.median(times) * 1e3:.3f} ms, min {min(times) * 1e3:.3f} ms")
