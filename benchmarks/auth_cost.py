#!/usr/bin/env python3
"""What authentication costs: the `pskv bench` round (ResNet-18 payload, 2 workers x 2 servers, this
machine) with the job's secret and without, over shared memory and over TCP, alternating in one run.

A connection proves once that it holds the secret (docs/DESIGN.md, "Who may talk to a job"); the
data path adds only a dictionary lookup per received message. The ratio printed is with / without.

    .venv/bin/python benchmarks/auth_cost.py [--trials 3] [--rounds 20] [--json benchmarks/results/auth_cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from pskv.launch.local import launch_local


def bench_round(env: dict[str, str], rounds: int, secret: bool = True) -> float:
    """The median round (the slowest worker's time each round) of one 2 x 2 `pskv bench` job with
    ``env``, in seconds (also used by replication_cost.py)."""
    with tempfile.TemporaryDirectory(prefix="pskv-bench-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "pskv", "bench", "--rounds", str(rounds), "--worker", "pskv", "--out", str(out)]
        if launch_local(2, 2, command, extra_env=env, quiet=True, secret=secret) != 0:
            raise SystemExit(f"the job ({env}, secret={secret}) failed")
        workers = json.loads(out.read_text())
    return statistics.median(max(w["seconds"][i] for w in workers) for i in range(rounds))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    times: dict[str, list[float]] = {}
    for trial in range(args.trials):
        for shm, path in (("1", "shared memory"), ("0", "TCP")):
            for secret in (True, False) if trial % 2 == 0 else (False, True):  # alternate which goes first
                name = f"{path}, {'with' if secret else 'without'} a secret"
                times.setdefault(name, []).append(bench_round({"PSKV_SHM": shm}, args.rounds, secret))
                print(f"trial {trial}: {name}: {times[name][-1]:.4f} s", flush=True)
    print("\n| path | with a secret | without | ratio |\n|---|---|---|---|")
    rows = {}
    for path in ("shared memory", "TCP"):
        on, off = (statistics.median(times[f"{path}, {w} a secret"]) for w in ("with", "without"))
        rows[path] = {"with": on, "without": off, "ratio": on / off}
        print(f"| {path} | {on:.4f} s | {off:.4f} s | {on / off:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"runs": times, "medians": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
