#!/usr/bin/env python3
"""Table 1: one round (push every array, pull every array) of the ResNet-18 payload, 2 workers x 2 servers.

Runs, in this one invocation and on the same arrays: ``pskv bench --compare gloo`` (pskv and
torch.distributed all_reduce over gloo) and ``benchmarks/mxnet_kvstore.py`` (MXNet 1.9.1
dist_sync, needs /tmp/mxnet-venv: see benchmarks/README.md). Prints the table and writes JSON.

    python benchmarks/round_vs_peers.py [--rounds 30] [--json benchmarks/results/round_vs_peers.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable


def pskv_bench(rounds: int, extra_env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pskv.json"
        cmd = [PYTHON, "-m", "pskv", "bench", "--model", "resnet18", "-n", "2", "-s", "2",
               "--rounds", str(rounds), "--compare", "gloo", "--json", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True, env={**os.environ, **extra_env})
        return json.loads(out.read_text())


def mxnet(rounds: int, mxnet_python: str) -> dict:
    from pskv.app.models import parameter_shapes

    with tempfile.TemporaryDirectory() as tmp:
        shapes, out = Path(tmp) / "shapes.json", Path(tmp) / "mxnet.json"
        shapes.write_text(json.dumps([list(s) for s in parameter_shapes("resnet18")]))
        cmd = [PYTHON, str(HERE / "mxnet_kvstore.py"), "--shapes-json", str(shapes), "-n", "2", "-s", "2",
               "--rounds", str(rounds), "--mxnet-python", mxnet_python, "--json", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--mxnet-python", default="/tmp/mxnet-venv/bin/python")
    p.add_argument("--json", type=Path, default=HERE / "results" / "round_vs_peers.json")
    args = p.parse_args()
    shm = pskv_bench(args.rounds, {})
    tcp = pskv_bench(args.rounds, {"PSKV_SHM": "0"})
    mx = mxnet(args.rounds, args.mxnet_python) if Path(args.mxnet_python).exists() else None
    rows = [
        ("pskv dist_sync, shared memory", shm["pskv_round_s"]),
        ("pskv dist_sync, TCP only (PSKV_SHM=0)", tcp["pskv_round_s"]),
        ("gloo all_reduce (torch.distributed)", shm["gloo_round_s"]),
        ("gloo all_reduce, second run", tcp["gloo_round_s"]),
    ]
    if mx:
        rows.append(("MXNet 1.9.1 dist_sync", mx["round_s_median"]))
    gloo = (shm["gloo_round_s"] + tcp["gloo_round_s"]) / 2
    print(
        f"\nResNet-18 payload: {shm['arrays']} arrays, {shm['bytes'] / 1e6:.1f} MB; 2 workers x 2 servers; {args.rounds} rounds"
    )
    print(f"{'system':42}{'median round':>14}{'vs gloo':>10}{'vs MXNet':>10}")
    for name, sec in rows:
        vs_mx = f"{sec / mx['round_s_median']:.2f}" if mx else "-"
        print(f"{name:42}{sec:>12.4f} s{sec / gloo:>10.2f}{vs_mx:>10}")
    result = {"pskv_shm": shm, "pskv_tcp": tcp, "mxnet": mx, "gloo_round_s_mean_of_runs": gloo}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
