"""Bytes a server's Rounds keeps per (worker x part). N one-element keys, W workers; every worker inits
them and runs ROUNDS complete rounds (push, then pull). Then the state a server holds during a round:
workers 0..W-2 push round ROUNDS+1 as a worker does through shared memory (acknowledged once merged, each
push its own view of one buffer) and pull it, and the pulls wait for worker W-1. Reported per
(worker x part): 'steady' = (W workers - 1 worker) / (N*(W-1)) after the complete rounds; 'in a round' =
(the waiting state - the steady state) / (N*(W-1)). MODE=trace: tracemalloc (Python objects only),
MODE=rss: the process's RSS (one fresh process per run: python benchmarks/server_memory.py rss N W ROUNDS).
Usage: python benchmarks/server_memory.py [trace|rss] [N] [W] [ROUNDS]"""
import gc
import sys
import tracemalloc

import torch

from pskv.ps.rounds import InitEntry, PullEntry, PushEntry, Rounds

MODE = sys.argv[1] if len(sys.argv) > 1 else "trace"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
W = int(sys.argv[3]) if len(sys.argv) > 3 else 8
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 2
one = torch.ones(1)
shm = torch.ones(N * W, 1)  # stands for the workers' shared memory: pushes are views of it


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def used() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0] if MODE == "trace" else rss()


def run(workers: int) -> tuple[int, int]:
    """(steady, in a round) bytes over an empty Rounds."""
    if MODE == "trace":
        tracemalloc.start()
    base = used()
    r = Rounds(workers, timeout=300.0)
    for rank in range(workers):
        r.init(f"init {rank}", rank, "sync", [InitEntry(k, 0, f"k{k}", torch.float32, 1, 1, one if rank == 0 else None) for k in range(N)])
    parts = [r.part(k, 0) for k in range(N)]
    for rnd in range(1, ROUNDS + 1):
        for rank in range(workers):
            r.push(f"push {rank}", rank, [PushEntry(p, rnd, shm[rank * N + i:rank * N + i + 1], True) for i, p in enumerate(parts)])
        for rank in range(workers):
            r.pull(f"pull {rank}", rank, [PullEntry(p, rnd) for p in parts])
    steady = used() - base
    for rank in range(workers - 1):  # the last worker has not pushed yet: every push and pull waits
        assert r.push(f"push {rank}", rank, [PushEntry(p, ROUNDS + 1, shm[rank * N + i:rank * N + i + 1], True) for i, p in enumerate(parts)]) == []
        assert r.pull(f"pull {rank}", rank, [PullEntry(p, ROUNDS + 1) for p in parts]) == []
    waiting = used() - base
    if MODE == "trace":
        tracemalloc.stop()
    return steady, waiting


if __name__ == "__main__":
    if len(sys.argv) > 5:  # one run, in its own process (rss)
        print(*run(int(sys.argv[5])))
        sys.exit()
    if MODE == "rss":
        import subprocess
        out = [subprocess.run([sys.executable, *sys.argv[:5], str(w)], check=True, capture_output=True, text=True).stdout.split() for w in (1, W)]
        (s1, _), (sw, ww) = [[int(x) for x in o] for o in out]
    else:
        (s1, _), (sw, ww) = run(1), run(W)
    units = N * (W - 1)
    print(f"{MODE}: N={N} parts, W={W}, {ROUNDS} rounds: a part with 1 worker {s1 / N:.0f} B; per worker x part: "
          f"steady {(sw - s1) / units:.0f} B, in a round (W-1 pushes and pulls waiting) {(ww - sw) / units:.0f} B")
