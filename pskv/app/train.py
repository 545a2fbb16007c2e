"""``pskv train``: the tutorials' job. ResNet-18 trained by several workers through parameter servers.

Started by hand, it launches a job on this machine (2 workers and 2 servers by default) and shows
worker 0's progress; started as a worker of a job (``pskv launch -n 4 -s 2 -- pskv train``) it is
that worker's program; with ``--kv-store local`` or ``device`` it trains in this process alone.

What a worker does, top to bottom:

1. join the job through the store (``pskv.kv.create``): this gives its rank and the worker count;
2. read its part of the training data (``SplitSampler``: worker ``r`` of ``W`` reads the ``r``-th
   contiguous slice, reshuffled each epoch with a seed all workers share);
3. build the model (one replica per ``--devices`` entry) and a ``Trainer`` on the store: the
   servers hold the weights and run SGD on the summed gradients;
4. every batch: split it over the replicas, forward, backward, ``trainer.step(batch)``;
5. every epoch: evaluate on its share of the test set, then gather everyone's numbers
   (``kv.allgather``) so worker 0 reports loss and accuracy over all workers' data.

Batch size is per worker, as in the tutorials: W workers take W batches per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from pskv import data as core_data
from pskv.app import datasets as data
from pskv.app import models
from pskv.errors import PSKVError
from pskv.kv import KVStore, create
from pskv.trainer import Trainer

DEFAULTS = {
    "servers": 2,
    "kv_store": "dist_sync",
    "dataset": "digits",
    "model": "resnet18",
    "epochs": 4,
    "batch_size": 32,
    "lr": 0.01,
    "momentum": 0.9,
    "wd": 5e-4,
    "image_size": 16,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pskv train",
        description="Train ResNet-18 (or another of pskv.models) with several workers and parameter servers.",
        epilog="examples:\n  pskv train\n  pskv train --kv-store local --workers 1\n"
        "  pskv launch -n 4 -s 2 -- pskv train --epochs 10\n  pskv train --dataset cifar10 --data-dir ~/data/cifar-10-batches-py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = DEFAULTS
    p.add_argument("--workers", type=int, help="workers to launch when started by hand (2 for dist stores, 1 otherwise)")
    p.add_argument("--servers", type=int, default=d["servers"], help="servers to launch when started by hand (%(default)s)")
    p.add_argument("--kv-store", default=d["kv_store"], help="store type: local, device, dist_sync, dist_device_sync, dist_async (%(default)s)")
    p.add_argument("--dataset", default=d["dataset"], choices=data.DATASET_NAMES, help="%(default)s: ships with scikit-learn, no download")
    p.add_argument("--data-dir", help="directory of the cifar10 or folder data set")
    p.add_argument("--model", default=d["model"], choices=models.MODEL_NAMES, help="%(default)s")
    p.add_argument("--epochs", type=int, default=d["epochs"], help="%(default)s")
    p.add_argument("--batch-size", type=int, default=d["batch_size"], help="per worker (%(default)s)")
    p.add_argument("--lr", type=float, default=d["lr"], help="learning rate (%(default)s)")
    p.add_argument("--lr-schedule", default="cosine", choices=["none", "step", "cosine"], help="%(default)s")
    p.add_argument("--momentum", type=float, default=d["momentum"], help="%(default)s")
    p.add_argument("--wd", type=float, default=d["wd"], help="weight decay (%(default)s)")
    p.add_argument("--image-size", type=int, default=d["image_size"], help="%(default)s")
    p.add_argument("--devices", default="cpu", help="comma-separated devices of this worker, e.g. cuda:0,cuda:1 (%(default)s)")
    p.add_argument("--seed", type=int, default=0, help="%(default)s")
    p.add_argument("--threads", type=int, help="torch threads per worker (default: OMP_NUM_THREADS or all cores)")
    p.add_argument("--report", type=Path, help="write a JSON report here (worker 0)")
    p.add_argument("--plot", type=Path, help="write a PNG of loss and accuracy per epoch here (worker 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# -- one worker -----------------------------------------------------------------------------------


def lr_scheduler(kind: str, epochs: int, steps_per_epoch: int) -> Optional[dict[str, Any]]:
    if kind == "none":
        return None
    if kind == "step":  # x0.1 at 50% and 75% of the run
        return {"name": "multifactor", "step": [max(1, steps_per_epoch * epochs // 2), max(2, steps_per_epoch * epochs * 3 // 4)], "factor": 0.1}
    total = max(2, steps_per_epoch * epochs)
    return {"name": "cosine", "max_update": total, "final_lr": 0.0, "warmup_steps": min(steps_per_epoch, total // 10)}


def evaluate(nets: list[nn.Module], dataset: data.ArrayDataset, part: range, transform: Any, devices: list[torch.device]) -> tuple[int, int]:
    """Correct predictions and count on ``part`` of the test set (replica 0's BatchNorm statistics)."""
    net, device = nets[0], devices[0]
    net.eval()
    correct = 0
    with torch.no_grad():
        for x, y in data.batches(dataset, part, 256, transform):
            correct += int((net(x.to(device)).argmax(1).cpu() == y).sum())
    net.train()
    return correct, len(part)


def run_worker(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    kv: Optional[KVStore] = create(args.kv_store)  # joins the job (a server/scheduler process serves here and exits)
    assert kv is not None
    rank, workers = kv.rank, kv.num_workers
    devices = [torch.device(d.strip()) for d in args.devices.split(",")]
    torch.manual_seed(args.seed)

    train_set = data.get_dataset(args.dataset, args.data_dir, train=True, image_size=args.image_size)
    test_set = data.get_dataset(args.dataset, args.data_dir, train=False, image_size=args.image_size)
    train_tf, test_tf = data.transforms_for(args.dataset, args.image_size)
    sampler = core_data.SplitSampler(len(train_set), workers, rank, shuffle=True, seed=args.seed)
    test_part = range(len(test_set) * rank // workers, len(test_set) * (rank + 1) // workers)
    steps_per_epoch = math.ceil(len(sampler) / args.batch_size)
    classes = int(train_set.labels.max()) + 1

    nets = [models.get_model(args.model, classes, train_set.images.shape[-1], args.image_size).to(d) for d in devices]
    hyper = {"learning_rate": args.lr, "momentum": args.momentum, "wd": args.wd}
    schedule = lr_scheduler(args.lr_schedule, args.epochs, steps_per_epoch)
    if schedule:
        hyper["lr_scheduler"] = schedule
    # the store makes every replica on every worker start from worker 0's weights
    trainer = Trainer([n.parameters() for n in nets], "sgd", hyper, kvstore=kv)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    generator = torch.Generator().manual_seed(args.seed + 1000 * rank)  # augmentation differs per worker

    if rank == 0:
        print(
            f"pskv train: {args.model} on {args.dataset} ({len(train_set)} train / {len(test_set)} test images), "
            f"{workers} worker(s) x {len(devices)} device(s), store {kv.type}"
            + (f" with {getattr(kv, 'num_servers', 0)} server(s)" if kv.type.startswith("dist") else "")
            + f", batch {args.batch_size} per worker, {args.epochs} epochs",
            flush=True,
        )
    epochs: list[dict[str, Any]] = []
    started = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss_sum, correct, seen = 0.0, 0, 0
        bar = _progress(rank == 0 and not args.no_progress, steps_per_epoch, f"epoch {epoch + 1}/{args.epochs}")
        t0 = time.perf_counter()
        for x, y in data.batches(train_set, sampler, args.batch_size, train_tf, generator):
            xs = core_data.split_and_load(x, devices, even_split=False)
            ys = core_data.split_and_load(y, devices, even_split=False)
            for net in nets:
                net.zero_grad()
            for net, xi, yi in zip(nets, xs, ys):
                out = net(xi)
                loss = loss_fn(out, yi)
                loss.backward()
                loss_sum += loss.item()
                correct += int((out.detach().argmax(1) == yi).sum())
            trainer.step(len(x))
            seen += len(x)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_sum / seen:.3f}", acc=f"{correct / seen:.3f}")
        seconds = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        test_correct, test_seen = evaluate(nets, test_set, test_part, test_tf, devices)
        mine = {"loss": loss_sum, "correct": correct, "seen": seen, "seconds": seconds, "test_correct": test_correct, "test_seen": test_seen}
        everyone = kv.allgather(mine)
        row = {
            "epoch": epoch + 1,
            "loss": sum(e["loss"] for e in everyone) / sum(e["seen"] for e in everyone),
            "train_acc": sum(e["correct"] for e in everyone) / sum(e["seen"] for e in everyone),
            "test_acc": sum(e["test_correct"] for e in everyone) / max(1, sum(e["test_seen"] for e in everyone)),
            "seconds": max(e["seconds"] for e in everyone),
            "samples_per_sec": sum(e["seen"] / e["seconds"] for e in everyone),
            "samples_per_sec_per_worker": seen / seconds,
            "lr": trainer.learning_rate,
        }
        epochs.append(row)
        if rank == 0:
            print(
                f"epoch {row['epoch']}, loss {row['loss']:.4f}, train acc {row['train_acc']:.4f}, test acc {row['test_acc']:.4f}, "
                f"time {row['seconds']:.1f} s, {row['samples_per_sec_per_worker']:.1f} samples/s per worker, "
                f"{row['samples_per_sec']:.1f} samples/s total",
                flush=True,
            )
    total = time.perf_counter() - started
    if rank == 0:
        report = {
            "model": args.model,
            "dataset": args.dataset,
            "kv_store": kv.type,
            "workers": workers,
            "servers": getattr(kv, "num_servers", 0),
            "devices": [str(d) for d in devices],
            "batch_size_per_worker": args.batch_size,
            "epochs": epochs,
            "final": {
                "test_acc": epochs[-1]["test_acc"] if epochs else None,
                "train_acc": epochs[-1]["train_acc"] if epochs else None,
                "loss": epochs[-1]["loss"] if epochs else None,
                "seconds": total,
                "samples_per_sec": sum(e["samples_per_sec"] * e["seconds"] for e in epochs) / max(1e-9, sum(e["seconds"] for e in epochs)),
            },
        }
        print(
            f"done: test acc {report['final']['test_acc']:.4f} after {args.epochs} epochs in {total:.1f} s "
            f"({report['final']['samples_per_sec']:.1f} samples/s in total)",
            flush=True,
        )
        if args.report:
            args.report.parent.mkdir(parents=True, exist_ok=True)
            args.report.write_text(json.dumps(report, indent=2) + "\n")
        if args.plot:
            plot(epochs, args.plot, f"{args.model} on {args.dataset}: {workers} workers, {report['servers']} servers ({kv.type})")
    kv.close()
    return 0


def _progress(enabled: bool, total: int, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="batch", leave=False, file=sys.stderr, dynamic_ncols=False, ncols=100)


def plot(epochs: list[dict[str, Any]], path: Path, title: str) -> None:
    """Loss and accuracy per epoch, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [e["epoch"] for e in epochs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(x, [e["loss"] for e in epochs], marker="o")
    ax1.set(xlabel="epoch", ylabel="training loss", title="loss")
    ax2.plot(x, [e["train_acc"] for e in epochs], marker="o", label="train")
    ax2.plot(x, [e["test_acc"] for e in epochs], marker="s", label="test")
    ax2.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0, 1))
    ax2.legend()
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.set_xticks(x)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- started by hand: launch the job --------------------------------------------------------------


def main(argv: Sequence[str]) -> int:
    """``pskv train ARGS``: a worker's program inside a job, else launch one (or train alone)."""
    args = build_parser().parse_args(list(argv))
    dist = args.kv_store.startswith("dist")
    try:
        if args.workers is not None and args.workers < 1:
            raise PSKVError(f"--workers must be >= 1, got {args.workers}")
        if not dist and (args.workers or 1) != 1:
            raise PSKVError(f"--kv-store {args.kv_store} trains in this one process: use --workers 1 or a dist store")
        if os.environ.get("DMLC_ROLE") or not dist:
            return run_worker(args)
        from pskv.launch.local import launch_local

        workers = int(args.workers or 2)
        print(f"pskv train: launching {workers} workers and {args.servers} servers on this machine", file=sys.stderr, flush=True)
        return launch_local(workers, args.servers, [sys.executable, "-m", "pskv", "train", *argv], quiet=True)
    except PSKVError as exc:
        print(f"pskv train: {exc}", file=sys.stderr)
        return 2
