#!/usr/bin/env python3
"""Peer benchmark: training throughput of PyTorch DistributedDataParallel over gloo on one machine.

Starts ``-n`` processes itself (``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``), each with one thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``). Each
process trains ``pskv.app.models.get_model(--model)`` on synthetic 32x32 RGB images with 10 classes,
generated in-process from a fixed seed (a different stream per rank), with SGD (lr 0.1, momentum
0.9) and ``CrossEntropyLoss``: ``--warmup`` untimed steps, then ``--steps`` timed steps. With
``-n 1`` the model is trained without DDP and without a process group (the single-process baseline).

    python benchmarks/ddp_train.py -n 2 --batch-size 32 --steps 30 --warmup 5 [--model resnet18] \\
        [--json OUT.json]

``samples_per_sec`` is the sum over processes of ``steps * batch_size / (time of the timed steps)``;
``samples_per_sec_per_worker`` is that sum divided by the number of processes; ``step_s_median`` is
rank 0's median step time. Run it with the interpreter that has torch (the repository root is put on
``PYTHONPATH`` for the workers, so ``pskv`` need not be installed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
DATA_BATCHES = 8  # distinct synthetic batches per process, cycled


# --------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time DistributedDataParallel (gloo) training on synthetic CIFAR-sized data, "
        "n processes x 1 thread on this machine.",
    )
    parser.add_argument("-n", "--num-workers", type=int, default=2, help="number of processes (default 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per process (default 32)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed steps before the timed ones (default 5)"
    )
    parser.add_argument(
        "--model", default="resnet18", help="name for pskv.app.models.get_model (default resnet18)"
    )
    parser.add_argument("--json", type=Path, help="write the result as JSON to this file")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="kill every process after this many seconds (default 600)",
    )
    # Internal: set by the orchestrator when it starts one training process.
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.num_workers < 1 or args.batch_size < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("need -n >= 1, --batch-size >= 1, --steps >= 1 and --warmup >= 0")
    return args


# --------------------------------------------------------------------------- one training process
def train_process(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from pskv.app.models import get_model

    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    distributed = world_size > 1
    if distributed:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

    torch.manual_seed(0)  # the same initial weights everywhere (DDP would broadcast rank 0's anyway)
    model = get_model(args.model, num_classes=NUM_CLASSES)
    if distributed:
        model = DistributedDataParallel(model)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [
        (
            torch.randn(args.batch_size, *IMAGE_SHAPE, generator=gen),
            torch.randint(0, NUM_CLASSES, (args.batch_size,), generator=gen),
        )
        for _ in range(DATA_BATCHES)
    ]

    def step(i: int) -> float:
        images, labels = batches[i % DATA_BATCHES]
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(images), labels)
        loss.backward()  # under DDP the gradient all-reduce runs here, overlapped with backward
        optimizer.step()
        return loss.item()

    for i in range(args.warmup):
        step(i)
    if distributed:
        dist.barrier()  # start the timed steps together
    step_times = []
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        t0 = time.perf_counter()
        last_loss = step(i)
        step_times.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return {
        "rank": rank,
        "elapsed_s": elapsed,
        "samples_per_sec": args.steps * args.batch_size / elapsed,
        "step_s": step_times,
        "last_loss": last_loss,
    }


# --------------------------------------------------------------------------- orchestrator
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # its own session: this process and what it started
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_processes(args: argparse.Namespace, tmp: Path) -> list[dict] | None:
    """Start the n training processes, wait for them, return their results (None on failure)."""
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(args.num_workers),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p),
    )
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--child",
        "--model", args.model,
        "--batch-size", str(args.batch_size),
        "--steps", str(args.steps),
        "--warmup", str(args.warmup),
    ]  # fmt: skip
    procs: list[subprocess.Popen] = []
    logs = [tmp / f"rank{r}.log" for r in range(args.num_workers)]
    results = [tmp / f"rank{r}.json" for r in range(args.num_workers)]
    error = None
    try:
        for rank in range(args.num_workers):
            with logs[rank].open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [*cmd, "--result-file", str(results[rank])],
                        env={**env, "RANK": str(rank)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + args.timeout
        while error is None and any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                error = f"rank {failed[0]} exited with status {procs[failed[0]].returncode}"
            elif time.monotonic() > deadline:
                error = f"timed out after {args.timeout:.0f} s"
            time.sleep(0.1)
        if error is None:
            failed = [r for r, p in enumerate(procs) if p.returncode != 0]
            if failed:
                error = f"rank {failed[0]} exited with status {procs[failed[0]].returncode}"
    finally:
        for proc in procs:
            kill(proc)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        for rank, log in enumerate(logs):
            if log.exists():
                print(
                    f"----- rank {rank} output (tail) -----\n{log.read_text(errors='replace')[-3000:]}",
                    file=sys.stderr,
                )
        return None
    return [json.loads(path.read_text()) for path in results]


def orchestrate(args: argparse.Namespace) -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ddp-train-") as tmp:
        results = run_processes(args, Path(tmp))
    if results is None:
        return 1
    wall = time.monotonic() - started
    total = sum(r["samples_per_sec"] for r in results)
    summary = {
        "peer": "ddp-gloo",
        "ddp": args.num_workers > 1,  # -n 1 trains the bare model, no process group
        "model": args.model,
        "workers": args.num_workers,
        "threads_per_worker": 1,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "samples_per_sec": total,
        "samples_per_sec_per_worker": total / args.num_workers,
        "samples_per_sec_by_rank": [r["samples_per_sec"] for r in results],
        "step_s_median": statistics.median(results[0]["step_s"]),
        "last_loss": results[0]["last_loss"],
        "wall_s": wall,
    }
    mode = f"DDP gloo, {args.num_workers} processes" if args.num_workers > 1 else "1 process, no DDP"
    print(
        f"{args.model} {mode} x 1 thread, batch {args.batch_size}/process, {args.steps} steps: "
        f"{total:.1f} samples/s total, {total / args.num_workers:.1f} per process, "
        f"median step {summary['step_s_median']:.3f} s; {wall:.0f} s wall"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        args.result_file.write_text(json.dumps(train_process(args)))
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
