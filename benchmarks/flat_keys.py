#!/usr/bin/env python3
"""Per-parameter keys against flat keys: the ResNet-18 payload (42 arrays, 44.7 MB) through the servers.

The Trainer gives the store one key per parameter; DDP (and so ``pskv.ddp_hook``) gives it one flat
bucket per ~25 MB. This job times both layouts of the same bytes, rounds alternating in one job:

- ``per parameter``: one key per array, as the Trainer's;
- ``flat``: the arrays concatenated into keys of about ``--flat-bytes`` (4 MB: the Trainer's runs).

A round is what a step of the Trainer sends: ``push`` of every key without waiting, then ``pull`` of
every key, then a wait for the answers. No optimizer, so every pulled value is the sum of the workers'
pushes (SPEC section 3), and that is checked each round. Printed: per round, the worker's CPU time in
the calls, in the wait, and the wall time (medians), and flat / per parameter.

    .venv/bin/python benchmarks/flat_keys.py [-n 1] [-s 1] [--rounds 30] [--flat-bytes 4194304] [--device cuda] [--json PATH]

With ``--device cuda`` the pushes leave from, and the pulls land in, GPU tensors (the Trainer's on a
GPU: its copies staged through page-locked memory), and a round ends once the GPU has the values.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(args: argparse.Namespace) -> None:
    import torch

    import pskv
    from pskv.app.models import parameter_shapes

    sizes = [math.prod(s) for s in parameter_shapes("resnet18")]
    flat: list[int] = [0]
    for n in sizes:
        if flat[-1] * 4 >= args.flat_bytes:
            flat.append(0)
        flat[-1] += n
    layouts = {"per parameter": sizes, "flat": flat}
    kv = pskv.kv.create("dist_sync")
    keys = {name: [f"{name}-{i}" for i in range(len(ns))] for name, ns in layouts.items()}
    for name, ns in layouts.items():
        kv.init(keys[name], [torch.zeros(n) for n in ns])
    grads = {name: [torch.full((n,), float(kv.rank + 1), device=args.device) for n in ns] for name, ns in layouts.items()}
    outs = {name: [torch.empty(n, device=args.device) for n in ns] for name, ns in layouts.items()}
    expected = sum(range(1, kv.num_workers + 1))
    took: dict[str, list[tuple[float, float, float]]] = {name: [] for name in layouts}
    for rnd in range(args.rounds + 2):  # two rounds warm up
        for name in layouts if rnd % 2 else reversed(layouts):
            wall, cpu = time.perf_counter(), time.thread_time()
            kv.push(keys[name], grads[name], wait=False)
            handle = kv.pull(keys[name], outs[name], wait=False)
            calls = time.thread_time() - cpu
            handle.wait()
            if args.device != "cpu":
                torch.cuda.synchronize()
            row = (calls, time.thread_time() - cpu - calls, time.perf_counter() - wall)
            if not all(bool((o == expected).all()) for o in outs[name]):
                raise SystemExit(f"{name}: a pulled value is not the sum of the pushes ({expected})")
            if rnd >= 2:
                took[name].append(row)
    if kv.rank == 0:
        med = {name: [statistics.median(r[i] for r in rows) * 1e3 for i in range(3)] for name, rows in took.items()}
        print(f"ResNet-18 payload on {args.device}, {kv.num_workers} worker(s) x {kv.num_servers} server(s), median of {args.rounds} rounds a layout")
        print(f"{'':16}{'keys':>6}{'CPU in calls, ms':>18}{'CPU in wait, ms':>17}{'wall, ms':>10}")
        for name, (a, b, c) in med.items():
            print(f"{name:16}{len(keys[name]):6d}{a:18.2f}{b:17.2f}{c:10.1f}")
        ratio = [f / p for f, p in zip(med["flat"], med["per parameter"])]
        print(f"{'flat / per par.':22}{ratio[0]:18.2f}{ratio[1]:17.2f}{ratio[2]:10.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps({"workers": kv.num_workers, "servers": kv.num_servers, "device": args.device, "ms": med}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", "--workers", type=int, default=1)
    p.add_argument("-s", "--servers", type=int, default=1)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--flat-bytes", type=int, default=4 << 20)
    p.add_argument("--device", default="cpu", help="where the pushed and pulled tensors are (cpu, cuda)")
    p.add_argument("--json", help="write the medians here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    cmd = [sys.executable, "-m", "pskv", "launch", "-n", str(args.workers), "-s", str(args.servers), "--",
           sys.executable, str(Path(__file__).resolve()), "--worker", "--rounds", str(args.rounds), "--flat-bytes", str(args.flat_bytes), "--device", args.device,
           *(["--json", str(Path(args.json).resolve())] if args.json else [])]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sys.exit(subprocess.run(cmd, env=env, cwd=HERE.parent, timeout=900).returncode)


if __name__ == "__main__":
    main()
