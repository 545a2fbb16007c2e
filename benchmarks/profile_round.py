#!/usr/bin/env python3
"""Where the time of one round goes: a traced ``pskv bench`` run, merged into one timeline.

Runs ``pskv bench --model resnet18 -n 2 -s 2`` with ``PSKV_TRACE`` set, then prints, for the
median round, every recorded event of every process relative to the round's start.

    python benchmarks/profile_round.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pskv", "bench", "--model", "resnet18", "-n", "2", "-s", "2",
                        "--rounds", str(args.rounds), "--warmup", "3"],
                       check=True, env={**os.environ, "PSKV_TRACE": tmp})  # fmt: skip
        events = []
        for f in Path(tmp).glob("*.trace"):
            for line in f.read_text().splitlines():
                t, what = line.split(" ", 1)
                events.append((float(t), f.stem, what))
    events.sort()
    starts = [t for t, who, what in events if who == "worker-0" and what == "push starts"]
    rounds = [(a, b) for a, b in zip(starts, starts[1:])]
    ends = {a: max(t for t, who, what in events if a <= t < b and what == "pull complete") for a, b in rounds}
    lengths = sorted(rounds, key=lambda r: ends[r[0]] - r[0])
    a, _ = lengths[len(lengths) // 2]
    print(f"median round: {1000 * (ends[a] - a):.1f} ms (rounds: {statistics.median([ends[r] - r for r, _ in rounds]) * 1000:.1f} ms median)")
    for t, who, what in events:
        if a - 0.0005 <= t <= ends[a] + 0.0005:
            print(f"{1000 * (t - a):8.2f} ms  {who:9} {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
