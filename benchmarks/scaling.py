#!/usr/bin/env python3
"""Table 2: round time for W in {1, 2, 4} workers, S in {1, 2} servers, payloads of 4, 44.7 and 102 MB.

Every cell is one ``pskv bench`` run (shared memory, dist_sync); the gloo all_reduce of the same
arrays with W processes is measured once per (W, payload), in the same invocation.

    python benchmarks/scaling.py [--rounds 15] [--json benchmarks/results/scaling.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAYLOADS = [
    ("4 MB", ["--size-mb", "4"]),
    ("44.7 MB (ResNet-18)", ["--model", "resnet18"]),
    ("102 MB (ResNet-50)", ["--model", "resnet50"]),
]


def bench(what: list[str], workers: int, servers: int, rounds: int, gloo: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "b.json"
        cmd = [sys.executable, "-m", "pskv", "bench", *what, "-n", str(workers), "-s", str(servers),
               "--rounds", str(rounds), "--json", str(out), *(["--compare", "gloo"] if gloo else [])]  # fmt: skip
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json", type=Path, default=HERE / "results" / "scaling.json")
    args = p.parse_args()
    cells = []
    for label, what in PAYLOADS:
        for workers in (1, 2, 4):
            for servers in (1, 2):
                r = bench(what, workers, servers, args.rounds, gloo=servers == 1 and workers > 1)
                cells.append({"payload": label, "workers": workers, "servers": servers, **r})
    print(
        f"\n{'payload':22}{'W':>3}{'S':>3}{'pskv round':>12}{'GB/s/worker':>13}{'gloo round':>12}{'pskv/gloo':>11}"
    )
    gloo_of: dict[tuple[str, int], float] = {}
    for c in cells:
        if "gloo_round_s" in c:
            gloo_of[(c["payload"], c["workers"])] = c["gloo_round_s"]
    for c in cells:
        g = gloo_of.get((c["payload"], c["workers"]))
        ratio = f"{c['pskv_round_s'] / g:.2f}" if g else "-"
        gs = f"{g:.4f}" if g else "-"
        print(
            f"{c['payload']:22}{c['workers']:>3}{c['servers']:>3}{c['pskv_round_s']:>12.4f}{c['pskv_gbps_per_worker']:>13.2f}{gs:>12}{ratio:>11}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(cells, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
