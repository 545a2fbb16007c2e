#!/usr/bin/env python3
"""Where the time of one round goes: a ``pskv bench`` run with ``PSKV_TIMELINE``, as one timeline.

Runs ``pskv bench --model resnet18 -n 2 -s 2`` (or ``--size-mb``, ``-n``, ``-s``) with every
process recording its timeline (:mod:`pskv.ps.timeline`), merges the files into one Chrome trace
(``--trace``, open it in https://ui.perfetto.dev), and prints, for the median round, every span of
every process relative to the round's start; then the memcpy bound of this machine for the same
payload: the copies and the sum a round cannot avoid (each worker copies its push into shared
memory and its pull out of it; the servers read every worker's push and write the sum), timed
here with one thread each and spread over the cores.

    python benchmarks/profile_round.py [--rounds 20] [--size-mb MB] [-n W] [-s S] [--trace round.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pskv.app.models import parameter_shapes
from pskv.ps import timeline


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--size-mb", type=float, help="one array of this size instead of the ResNet-18 payload")
    p.add_argument("-n", "--workers", type=int, default=2)
    p.add_argument("-s", "--servers", type=int, default=2)
    p.add_argument("--trace", type=Path, help="keep the merged Chrome trace here")
    args = p.parse_args()
    payload = ["--size-mb", str(args.size_mb)] if args.size_mb else ["--model", "resnet18"]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(args.trace or Path(tmp) / "round.json")
        subprocess.run([sys.executable, "-m", "pskv", "bench", *payload, "-n", str(args.workers), "-s", str(args.servers),
                        "--rounds", str(args.rounds), "--warmup", "3"],
                       check=True, env={**os.environ, "PSKV_TIMELINE": path})  # fmt: skip
        timeline.merge(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans = sorted((e["ts"] / 1e6, e["dur"] / 1e6, names.get(e["pid"], "?"), e["name"]) for e in events if e["ph"] == "X")
    rounds = [(t, d) for t, d, who, what in spans if who == "worker 0" and what == "round"][3:]
    a, length = sorted(rounds, key=lambda r: r[1])[len(rounds) // 2]
    median = statistics.median(d for _, d in rounds)
    print(f"median round: {1000 * length:.1f} ms (rounds: {1000 * median:.1f} ms median); every span in it, from its start:")
    for t, d, who, what in spans:
        if a - 0.0005 <= t <= a + length:
            print(f"{1000 * (t - a):8.2f} ms  {1000 * d:7.2f} ms  {who:9} {what}")
    n = int(args.size_mb * 1e6 / 4) if args.size_mb else sum(math.prod(s) for s in parameter_shapes("resnet18"))
    memcpy_bound(n, args.workers, median)
    return 0


def memcpy_bound(n: int, workers: int, median_round: float) -> None:
    """The least time the round's unavoidable memory traffic (``n`` floats) takes on this machine.

    Per worker one copy in (push) and one out (pull); on the servers one pass summing the
    workers' pushes. Two limits: the CPU time of that work at one core's speed spread over the
    cores (and one worker's copies in a row), and the memory bus: the same passes made with
    every core at once, one after another.
    """
    src, dst, other = torch.rand(n), torch.empty(n), torch.rand(n)

    def best(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(9):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    cores = os.cpu_count() or 1
    rates = {}
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        rates[threads] = (best(lambda: dst.copy_(src)), best(lambda: torch.add(src, other, out=dst)))
    copy, add = rates[1]
    work = workers * 2 * copy + (workers - 1) * add
    chain = 2 * copy + (workers - 1) * add / 2  # one worker's copies and its share of the sum
    copy_all, add_all = rates[cores]
    bus = workers * 2 * copy_all + (workers - 1) * add_all
    bound = max(work / cores, chain, bus)
    print(f"\nmemcpy bound, {4 * n / 1e6:.1f} MB payload, {workers} workers, {cores} cores:")
    for threads, (c, a) in rates.items():
        print(
            f"  {threads} thread(s): copy {1000 * c:.1f} ms ({4 * n / c / 1e9:.1f} GB/s), sum of two {1000 * a:.1f} ms"
        )
    print(
        f"  CPU: {1000 * work:.1f} ms of work / {cores} cores = {1000 * work / cores:.1f} ms; one worker's chain {1000 * chain:.1f} ms"
    )
    print(f"  memory bus: {2 * workers} copies + {workers - 1} sum(s) with all cores = {1000 * bus:.1f} ms")
    print(
        f"  bound {1000 * bound:.1f} ms; median round {1000 * median_round:.1f} ms = {median_round / bound:.2f} x the bound"
    )


if __name__ == "__main__":
    sys.exit(main())
