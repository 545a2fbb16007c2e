#!/usr/bin/env python3
"""Table 3: training throughput, pskv train against DistributedDataParallel over gloo.

Same model (the d2l CIFAR ResNet-18), synthetic 32x32 images, batch 32 per worker, 2 workers
with one torch thread each, SGD momentum 0.9; both in this one invocation:

- ``pskv train --dataset synthetic --workers 2 --servers 2 --epochs 2`` (64 steps per worker
  per epoch); its second epoch is the steady state (the first includes start-up),
- ``benchmarks/ddp_train.py -n 2 --warmup 5 --steps 64`` (torch.distributed DDP, gloo backend),
  timed after its warm-up steps likewise.

    python benchmarks/train_throughput.py [--json benchmarks/results/train_throughput.json]
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--json", type=Path, default=HERE / "results" / "train_throughput.json")
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        rep, ddp = Path(tmp) / "pskv.json", Path(tmp) / "ddp.json"
        subprocess.run([sys.executable, "-m", "pskv", "train", "--dataset", "synthetic", "--image-size", "32",
                        "--workers", "2", "--servers", "2", "--epochs", "2", "--batch-size", "32", "--lr", "0.01",
                        "--lr-schedule", "none", "--threads", "1", "--no-progress", "--report", str(rep)],
                       check=True, env=env)  # fmt: skip
        subprocess.run([sys.executable, str(HERE / "ddp_train.py"), "-n", "2", "--batch-size", "32",
                        "--steps", str(args.steps), "--warmup", "5", "--json", str(ddp)], check=True, env=env)  # fmt: skip
        pskv_r, ddp_r = json.loads(rep.read_text()), json.loads(ddp.read_text())
    ours = pskv_r["epochs"][-1]["samples_per_sec"]
    theirs = ddp_r["samples_per_sec"]
    print(f"\n{'system':44}{'samples/s (2 workers)':>24}")
    print(f"{'pskv train, dist_sync, 2 servers (epoch 2)':44}{ours:>24.1f}")
    print(f"{'DistributedDataParallel over gloo':44}{theirs:>24.1f}")
    print(f"ratio pskv / DDP: {ours / theirs:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"pskv": pskv_r, "ddp": ddp_r, "ratio": ours / theirs}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
