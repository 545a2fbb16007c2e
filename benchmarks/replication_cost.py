#!/usr/bin/env python3
"""What a replica costs: the `pskv bench` round (ResNet-18 payload, 2 workers x 2 servers, this
machine) with ``PSKV_REPLICAS=1`` and without, alternating in one run.

With a replica every push also goes to the part's backup (the next server), which runs the same
rounds (docs/DESIGN.md, "A lost server"): the workers upload twice and every server merges and
updates twice the parts. Replicas travel over TCP (no shared memory), so the plain job is timed over
TCP and over shared memory; the ratios printed are replicated / plain.

    .venv/bin/python benchmarks/replication_cost.py [--trials 3] [--rounds 20] [--json benchmarks/results/replication_cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from auth_cost import bench_round  # (this directory is on sys.path when a script here runs)

SETUPS = {"R=0, shared memory": {"PSKV_SHM": "1"}, "R=0, TCP": {"PSKV_SHM": "0"}, "R=1 (TCP)": {"PSKV_REPLICAS": "1"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    times: dict[str, list[float]] = {name: [] for name in SETUPS}
    for trial in range(args.trials):
        for name in list(SETUPS) if trial % 2 == 0 else list(SETUPS)[::-1]:  # alternate which goes first
            times[name].append(bench_round(SETUPS[name], args.rounds))
            print(f"trial {trial}: {name}: {times[name][-1]:.4f} s", flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print("\n| job | round (median) | R=1 / this |\n|---|---|---|")
    for name, t in medians.items():
        print(f"| {name} | {t:.4f} s | {medians['R=1 (TCP)'] / t:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"runs": times, "medians": medians}, indent=2) + "\n")


if __name__ == "__main__":
    main()
