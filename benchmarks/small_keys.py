#!/usr/bin/env python3
"""Many small keys: 2,000 keys of 4 floats, 2 workers x 2 servers on this machine (``-n``, ``-s``: others).

A round is every worker calling ``pushpull`` once per key, three ways, in the same job:

- ``blocking``: one call per key, each waiting for its answer (what pskv did before handles);
- ``in flight``: one call per key with ``wait=False``, then waiting for every handle;
- ``one call``: a single ``pushpull`` of all keys (the bound: one message each way per server).

Every value is checked against SPEC section 3 (no optimizer: the sum of the workers' pushes). Beside
each round, the time Python's cyclic garbage collector took in the worker (``gc.callbacks``).

    .venv/bin/python benchmarks/small_keys.py [--keys 2000] [--rounds 5] [-n 2] [-s 2] [--json benchmarks/results/small_keys.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(args: argparse.Namespace) -> None:
    import gc

    import torch

    import pskv

    in_gc = {"total": 0.0, "since": 0.0}  # seconds in collections so far; when the one under way began

    def timed(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            in_gc["since"] = time.perf_counter()
        else:
            in_gc["total"] += time.perf_counter() - in_gc["since"]

    gc.callbacks.append(timed)

    kv = pskv.kv.create("dist_sync")
    keys = list(range(args.keys))
    kv.init(keys, [torch.zeros(4)] * len(keys))
    outs = [torch.empty(4) for _ in keys]
    times: dict[str, list[float]] = {"blocking": [], "in flight": [], "one call": []}
    gc_times: dict[str, list[float]] = {m: [] for m in times}
    sent = 0
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for mode in times:
            grads = [torch.full((4,), float(kv.rank + 1 + k + rnd)) for k in keys]
            for o in outs:  # every mode of a round expects the same values: each must write them itself
                o.fill_(float("nan"))
            kv.barrier()
            t0, gc0 = time.perf_counter(), in_gc["total"]
            if mode == "blocking":
                for k, g, o in zip(keys, grads, outs):
                    kv.pushpull(k, g, out=o)
            elif mode == "in flight":
                handles = [kv.pushpull(k, g, out=o, wait=False) for k, g, o in zip(keys, grads, outs)]
                for h in handles:
                    h.wait()  # type: ignore[union-attr]
            else:
                kv.pushpull(keys, grads, out=outs)
            if rnd:
                times[mode].append(time.perf_counter() - t0)
                gc_times[mode].append(in_gc["total"] - gc0)
            sent += 1
            w = kv.num_workers
            bad = [k for k, o in zip(keys, outs) if not torch.all(o == w * (w + 1) / 2 + w * (k + rnd))]
            if bad:
                raise SystemExit(f"worker {kv.rank}: {mode}: wrong values for {len(bad)} keys, e.g. key {bad[0]}")
    everyone = kv.allgather((times, gc_times))
    kv.close()
    if kv.rank == 0:
        def slowest(i: int) -> dict[str, float]:  # per mode: the median over rounds of the slowest worker's
            return {m: statistics.median(max(r) for r in zip(*(e[i][m] for e in everyone))) for m in times}

        Path(args.out).write_text(json.dumps({"round_s": slowest(0), "gc_s": slowest(1)}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("-n", "--workers", type=int, default=2)
    p.add_argument("-s", "--servers", type=int, default=2)
    p.add_argument("--json", type=Path, default=HERE / "results" / "small_keys.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"pskv-small-keys-{os.getpid()}.json"
    cmd = [sys.executable, "-m", "pskv", "launch", "-n", str(args.workers), "-s", str(args.servers), "--", sys.executable, __file__,
           "--worker", "--keys", str(args.keys), "--rounds", str(args.rounds), "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True)
    result = json.loads(out.read_text())
    out.unlink()
    rows = result["round_s"]
    print(f"{args.keys} keys of 4 floats, {args.workers} workers x {args.servers} servers, pushpull per key; median round of {args.rounds} (in Python's GC)")
    for mode, seconds in rows.items():
        print(f"  {mode:10} {seconds:8.3f} s  ({result['gc_s'][mode]:.3f} s)")
    print(f"in flight / blocking: {rows['in flight'] / rows['blocking']:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"keys": args.keys, "workers": args.workers, "servers": args.servers, "rounds": args.rounds, **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
