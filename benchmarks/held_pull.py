#!/usr/bin/env python3
"""How soon the first layer's weights come back in the Trainer's step (the servers run the optimizer).

The Trainer pushes each gradient during backward as a *held* round: the servers sum it, and apply
the update only when ``step(batch_size)``'s pulls bring the rescale. ``step`` pulls in runs of about
4 MB in layer order, and the next forward waits for the first run first. This script does what
``step`` does for the ResNet-18 payload (42 arrays, 44.7 MB; SGD momentum 0.9, weight decay), with
no model: push every key held (last layer first), then pull the runs with the rescale, and time when
the first run and the last are back. Median of ``--rounds``, one worker and ``-s`` servers on this machine:

    python benchmarks/held_pull.py [-s 1] [--rounds 20]

To compare two checkouts, run each from its own directory (``cd <checkout> && python
<this file>``): ``python -m pskv`` takes the package of the directory it runs in.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def worker(rounds: int) -> None:
    import torch

    import pskv
    from pskv.app.models import parameter_shapes
    from pskv.trainer import RUN_BYTES

    kv = pskv.kv.create("dist_sync")
    shapes = parameter_shapes("resnet18")
    keys = list(range(len(shapes)))
    kv.init(keys, [torch.zeros(s) for s in shapes])
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=0.1, momentum=0.9, wd=5e-4))
    runs: list[list[int]] = [[]]  # the Trainer's runs
    run_bytes = 0
    for k, s in enumerate(shapes):
        if run_bytes >= RUN_BYTES:
            runs.append([])
            run_bytes = 0
        runs[-1].append(k)
        run_bytes += torch.Size(s).numel() * 4
    grads, outs = [torch.randn(s) for s in shapes], [torch.empty(s) for s in shapes]
    first, last = [], []
    for r in range(rounds + 3):
        pushed = [kv.push(k, grads[k], priority=-k, wait=False, _held=True) for k in reversed(keys)]  # as backward makes them
        for h in pushed:  # every push is in: one worker, so every round is summed and held
            h.wait()  # type: ignore[union-attr]
        t0 = time.perf_counter()
        handles = [kv.pull(run, [outs[k] for k in run], priority=-run[0], wait=False, _rescale=1 / 128) for run in runs]
        handles[0].wait()  # type: ignore[union-attr]
        t1 = time.perf_counter()
        for h in handles[1:]:
            h.wait()  # type: ignore[union-attr]
        t2 = time.perf_counter()
        if r >= 3:  # (warm-up)
            first.append(t1 - t0)
            last.append(t2 - t0)
    if kv.rank == 0:
        print(f"runs {len(runs)}, first run back {statistics.median(first) * 1e3:.2f} ms, "
              f"all back {statistics.median(last) * 1e3:.2f} ms (median of {rounds})", flush=True)
    kv.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-s", "--servers", type=int, default=1)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.rounds)
        return 0
    cmd = [sys.executable, "-m", "pskv", "launch", "-n", "1", "-s", str(args.servers), "--",
           sys.executable, os.path.abspath(__file__), "--worker", "--rounds", str(args.rounds)]  # fmt: skip
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
