"""``pskv train``: the tutorials' job. ResNet-18 trained by several workers through parameter servers.

Started by hand, it launches a job on this machine (2 workers and 2 servers by default) and shows
worker 0's progress; as a worker of a job (``pskv launch -n 4 -s 2 -- pskv train``) it is that
worker's program (:func:`run_worker`, five numbered steps); with ``--kv-store local`` or ``device``
it trains in this process alone. The batch size is per worker, as in the tutorials.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pickle
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from tqdm import tqdm

from pskv import checkpoint
from pskv.app import datasets, models
from pskv.data import SplitSampler, split_and_load
from pskv.errors import PSKVError
from pskv.kv import create
from pskv.trainer import Trainer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pskv train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train ResNet-18 (or the lab's small CNN) with several workers and parameter servers.",
        epilog="examples:\n  pskv train\n  pskv train --kv-store local --workers 1\n"
        "  pskv launch -n 4 -s 2 -- pskv train --epochs 10\n"
        "  pskv train --dataset cifar10 --data-dir ~/data/cifar-10-batches-py",
    )
    add = p.add_argument
    add("--workers", type=int, help="workers to launch when started by hand (2 for dist stores, 1 otherwise)")
    add("--servers", type=int, default=2, help="servers to launch when started by hand (%(default)s)")
    add("--kv-store", default="dist_sync", help="%(default)s (default), dist_device_sync, dist_async: started by hand, a job on this machine; local, device: this process only")
    add("--dataset", default="digits", choices=datasets.DATASET_NAMES, help="%(default)s (no download needed); cifar10 and folder read --data-dir")
    add("--data-dir", help="directory of the cifar10 or folder data set")
    add("--model", default="resnet18", choices=models.MODEL_NAMES, help="the network (%(default)s)")
    add("--epochs", type=int, default=4, help="epochs to train (%(default)s)")
    add("--batch-size", type=int, default=32, help="per worker (%(default)s)")
    add("--lr", type=float, default=0.01, help="learning rate (%(default)s)")
    add("--lr-schedule", default="cosine", choices=["none", "step", "cosine"], help="cosine (default: an epoch's warm-up, at most a tenth of the run, then down to 0), step (x0.1 at 50%% and 75%%), none")
    add("--momentum", type=float, default=0.9, help="SGD momentum (%(default)s)")
    add("--wd", type=float, default=5e-4, help="weight decay (%(default)s)")
    add("--image-size", type=int, default=16, help="images are resized to this many pixels square (%(default)s)")
    add("--devices", default="cpu", help="this worker's devices, e.g. cuda:0,cuda:1 (%(default)s)")
    add("--seed", type=int, default=0, help="of the initial weights, the data order and augmentation (%(default)s)")
    add("--amp", choices=["bf16", "fp16"], help="mixed precision: bf16 (gradients travel as bf16), or fp16 with a loss scale")
    add("--tensorboard", type=Path, help="write TensorBoard curves here (worker 0; needs the tensorboard package)")
    add("--threads", type=int, help="torch threads per worker (default: OMP_NUM_THREADS, which pskv launch sets to cores / workers; else all cores)")
    add("--checkpoint-dir", type=Path, help="after each epoch, save weights, optimizer states and progress here")
    add("--resume", action="store_true", help="go on from the last checkpoint in --checkpoint-dir, if any")
    add("--report", type=Path, help="write a JSON report here (worker 0, or the next while it is lost)")
    add("--plot", type=Path, help="write a PNG of loss and accuracy per epoch here (as --report)")
    add("--no-progress", action="store_true", help="no progress bar")
    return p


def run_worker(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    # 1. Join the job. A process started as a server or the scheduler serves inside create() and exits.
    kv = create(args.kv_store)
    rank, workers, servers = kv.rank, kv.num_workers, getattr(kv, "num_servers", 0)
    devices = [torch.device(d.strip()) for d in args.devices.split(",")]
    torch.manual_seed(args.seed)

    # 2. This worker's part of the data: worker r of W reads the r-th contiguous slice of the training
    # set, reshuffled each epoch with a seed all workers share (every worker loads the same data set).
    # When a worker is lost (pskv launch --min-workers) or back (--max-restarts), the data is shared anew.
    try:  # a data set missing or unreadable: one line that names it, not a traceback from every worker
        train_set, test_set = (datasets.get_dataset(args.dataset, args.data_dir, split, args.image_size) for split in (True, False))
    except (OSError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        raise PSKVError(f"--dataset {args.dataset}: {exc}") from None
    train_tf, test_tf = datasets.transforms_for(args.dataset, args.image_size)

    def share(everyone: list[dict[str, Any]]) -> tuple[SplitSampler, range, int]:
        """This worker's data among the live ones; who reports: of those with every epoch's row, the lowest rank."""
        live = [e["rank"] for e in everyone]
        i, n, leader = live.index(rank), len(live), min((e["since"], e["rank"]) for e in everyone if "since" in e)[1]
        return SplitSampler(len(train_set), n, i, shuffle=True, seed=args.seed), range(len(test_set) * i // n, len(test_set) * (i + 1) // n), leader

    def evaluate(part: range) -> dict[str, int]:  # test images `part` by replica 0 (its own BatchNorm statistics)
        net, right = nets[0].eval(), 0
        with torch.no_grad():
            for x, y in datasets.batches(test_set, part, 256, test_tf):
                right += int((net(x.to(devices[0])).argmax(1).cpu() == y).sum())
        net.train()
        return {"test_correct": right, "test_seen": int((test_set.labels[part.start : part.stop] >= 0).sum())}  # (-1: no label)

    sampler, test_part, leader = share([{"rank": r, "since": 0} for r in range(workers)])
    per_epoch = (steps_per_epoch := math.ceil(len(sampler) / args.batch_size)) * (workers if kv.type == "dist_async" else 1)  # the servers' updates: dist_async applies every push

    # 3. One replica per device; all start from worker 0's weights, updated by SGD on the servers.
    classes, channels = len(train_set.classes) or int(train_set.labels.max()) + 1, train_set.images.shape[-1]  # (a class may have no image)
    nets = [models.get_model(args.model, classes, channels, args.image_size).to(d) for d in devices]
    resumed = checkpoint.latest(args.checkpoint_dir) if args.resume and not kv.rejoined else None  # (one back: the job's own)
    progress = checkpoint.load_weights(resumed, nets) if resumed else {}  # before the Trainer sends them
    hyper: dict[str, Any] = {"learning_rate": args.lr, "momentum": args.momentum, "wd": args.wd}
    steps = max(2, per_epoch * args.epochs)
    if args.lr_schedule == "step":  # x0.1 at 50% and at 75% of the run
        milestones = [max(1, steps // 2), max(2, steps * 3 // 4)]
        hyper["lr_scheduler"] = {"name": "multifactor", "step": milestones, "factor": 0.1}
    elif args.lr_schedule == "cosine":  # warm up for an epoch (at most a tenth of the run), then decay to 0
        warmup = min(per_epoch, steps // 10)
        hyper["lr_scheduler"] = {"name": "cosine", "max_update": steps, "final_lr": 0.0, "warmup_steps": warmup}
    # --amp: forward in bf16/fp16, fp32 weights; bf16 gradients travel as bf16, fp16 ones are scaled (LossScale)
    dist, amp = kv.type.startswith("dist"), {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp or "")
    scale = LossScale() if args.amp == "fp16" else None
    trainer = Trainer([net.parameters() for net in nets], "sgd", hyper, kvstore=kv, update_on_kvstore=False if scale else None,
                      compression_params={"type": "bf16"} if args.amp == "bf16" and dist else None)  # fmt: skip
    board: Any = tensorboard(args.tensorboard) if rank == 0 and not kv.rejoined and args.tensorboard else None
    loss_fn = nn.CrossEntropyLoss(reduction="sum")  # summed: trainer.step(n) divides by the batch size
    if resumed:
        checkpoint.load_states(resumed, trainer, updates=progress["epoch"] * per_epoch if progress.get("per_epoch") != per_epoch else None)  # (W may differ now)
        vars(scale).update(progress.get("loss_scale", {})) if scale else None  # fp16: the scale and its count of good steps go on

    store = f"{kv.type} with {servers} server(s)" if dist else kv.type  # (the plot's title too: no "0 servers" for local)
    if rank == 0 and not kv.rejoined:
        print(f"pskv train: {args.model} on {args.dataset} ({len(train_set)} train / {len(test_set)} test "
              f"images), {workers} worker(s) x {len(devices)} device(s), store {store}, "
              f"batch {args.batch_size} per worker, {args.epochs} epochs", flush=True)
        if args.resume:
            print(f"pskv train: resuming from {resumed}, {progress['epoch']} epochs done" if resumed else f"pskv train: no checkpoint in {args.checkpoint_dir} yet; starting", flush=True)
    history: list[dict[str, Any]] = progress.get("history", [])
    first, steps = progress.get("epoch", 0), progress.get("steps", progress.get("epoch", 0) * steps_per_epoch)  # steps: this worker's batches so far
    if kv.rejoined:  # in a lost worker's place (pskv launch --max-restarts): in from the others' next epoch
        everyone = kv.allgather({"rank": rank})
        first, steps = max((e.get("epoch", 0), e.get("steps", 0)) for e in everyone)
        sampler, test_part, leader = share(everyone)
        trainer.pull_weights()
        if args.checkpoint_dir:  # the others save the epoch they have finished: its barrier counts this worker in
            checkpoint.save(args.checkpoint_dir, first, nets[0], trainer, {}, writer=leader)
    for epoch in range(first, args.epochs):
        # 4. Train: split each batch over the replicas, forward, backward, then trainer.step, which
        # sums the gradients over devices and workers and waits for the servers' new weights.
        sampler.set_epoch(epoch)
        generator = torch.Generator().manual_seed(args.seed + 1000 * rank + 1_000_003 * epoch)  # augmentation: per worker and epoch, as a resumed run draws it
        loss_sum, correct, seen = 0.0, 0, 0
        bar = tqdm(
            datasets.batches(train_set, sampler, args.batch_size, train_tf, generator), unit="batch", leave=False,
            total=math.ceil(len(sampler) / args.batch_size), desc=f"epoch {epoch + 1}/{args.epochs}",
            file=sys.stderr, ncols=100, disable=rank != leader or args.no_progress,
        )  # fmt: skip
        t0, exchange = time.perf_counter(), 0.0
        for i, (x, y) in enumerate(bar, steps):
            t1, before = time.perf_counter(), (loss_sum, correct)
            for net in nets:  # (all: a short last batch leaves some without rows, and no gradient to push)
                net.zero_grad()
            for net, xi, yi in zip(nets, *(split_and_load(t, devices[: len(x)], 0, False) for t in (x, y))):
                with torch.autocast(xi.device.type, amp or torch.float32, enabled=amp is not None):
                    out = net(xi)
                    loss = loss_fn(out.float(), yi)
                (loss * scale.value if scale else loss).backward()
                loss_sum += loss.item()
                correct += int((out.argmax(1) == yi).sum())
            t2 = time.perf_counter()
            scale.step(trainer, nets[0], len(x)) if scale else trainer.step(len(x), ignore_stale_grad=True)
            t3, seen = time.perf_counter(), seen + len(x)
            exchange += t3 - t2
            bar.set_postfix(loss=f"{loss_sum / seen:.3f}", acc=f"{correct / seen:.3f}")
            for name, value in (dict(loss=(loss_sum - before[0]) / len(x), accuracy=(correct - before[1]) / len(x), lr=trainer.learning_rate,
                                     samples_per_s=len(x) / (t3 - t1), exchange_share=(t3 - t2) / (t3 - t1)) if board else {}).items():  # fmt: skip
                board.add_scalar(f"step/{name}", value, i)  # this worker's batches before it (epoch * steps_per_epoch + i repeated some after a lost worker)
        seconds, steps = time.perf_counter() - t0, i + 1

        # 5. Measure this worker's test share; gather everyone's numbers (kv.allgather) for a report over all data.
        mine = {"loss": loss_sum, "correct": correct, "seen": seen, "seconds": seconds, **evaluate(test_part)}
        everyone = kv.allgather({**mine, "rank": rank, "epoch": epoch + 1, "since": first, "steps": steps})  # the workers in the job now
        sampler, test_part, leader = share(everyone)
        everyone = [e for e in everyone if "seen" in e]  # not a worker that rejoins here
        total = {key: sum(e[key] for e in everyone) for key in mine}
        if total["test_seen"] < (test_set.labels >= 0).sum():  # a worker lost in this epoch measured no share: all here
            total.update(evaluate(range(len(test_set))))
        row = {
            "epoch": epoch + 1,
            "loss": total["loss"] / total["seen"],
            "train_acc": total["correct"] / total["seen"],
            "test_acc": total["test_correct"] / total["test_seen"] if total["test_seen"] else math.nan,  # (Kaggle's test: no labels)
            "seconds": max(e["seconds"] for e in everyone),  # an epoch ends when its slowest worker is done
            "samples_per_sec": (rates := sum(e["seen"] / e["seconds"] for e in everyone)), "samples_per_sec_per_worker": rates / len(everyone),
            "lr": trainer.learning_rate,
            "workers": len(everyone),
            "exchange_share": exchange / seconds,  # of this worker's epoch: the time in trainer.step
            **({"loss_scale": scale.value} if scale else {}),
        }
        history.append(row)
        board = board or (tensorboard(args.tensorboard) if rank == leader and args.tensorboard else None)  # (worker 0 lost)
        for name, value in row.items() if board else ():
            board.add_scalar(f"epoch/{name}", value, epoch + 1)
        if rank == leader:
            print(f"epoch {row['epoch']}, loss {row['loss']:.4f}, train acc {row['train_acc']:.4f}, "
                  f"test acc {row['test_acc']:.4f}, time {row['seconds']:.1f} s, "
                  f"{row['samples_per_sec_per_worker']:.1f} samples/s per worker, "
                  f"{row['samples_per_sec']:.1f} samples/s total", flush=True)
        if args.checkpoint_dir:
            checkpoint.save(args.checkpoint_dir, epoch + 1, nets[0], trainer, {"history": history, "per_epoch": per_epoch, "steps": steps, "loss_scale": vars(scale) if scale else {}}, writer=leader)
    if rank == leader and history:  # the run's time: its epochs' (a resumed run's before too); samples/s: their rates by time
        last, seconds = history[-1], sum(r["seconds"] for r in history)
        rate = sum(r["samples_per_sec"] * r["seconds"] for r in history) / seconds
        print(f"done: test acc {last['test_acc']:.4f} after {last['epoch']} epochs in {seconds:.1f} s "
              f"({rate:.1f} samples/s in total)", flush=True)
        if args.report:
            final = {key: last[key] for key in ("test_acc", "train_acc", "loss")}
            report = {
                "model": args.model, "dataset": args.dataset, "kv_store": kv.type,
                "workers": workers, "servers": servers, "devices": [str(d) for d in devices],
                "batch_size_per_worker": args.batch_size, "epochs": history,
                "final": {**final, "seconds": seconds, "samples_per_sec": rate},
            }  # fmt: skip
            args.report.parent.mkdir(parents=True, exist_ok=True)
            args.report.write_text(json.dumps(report, indent=2).replace("NaN", "null") + "\n")  # (NaN is not JSON; no free text in it)
        if args.plot:
            plot(history, args.plot, f"{args.model} on {args.dataset}: {workers} worker(s), store {store}")
    board.close() if board else None
    kv.close()
    return 0


class LossScale:
    """fp16 loss scaling through the store (torch's GradScaler rules): the summed gradients, the same
    on every worker, are checked; a step with Inf/NaN is skipped everywhere and halves the scale,
    2000 good steps double it. The update divides by the scale (``Trainer.update``'s batch size)."""
    value, good = 2.0**16, 0

    def step(self, trainer: Trainer, net: nn.Module, batch: int) -> None:
        trainer.allreduce_grads(ignore_stale_grad=True)  # (a short last batch: replicas without rows)
        if bool(torch.stack([p.grad.isfinite().all() for p in net.parameters() if p.grad is not None]).all()):
            trainer.update(batch * self.value)
            self.good = (self.good + 1) % 2000
            self.value *= 1 if self.good else 2
        else:
            self.value, self.good = self.value / 2, 0


def tensorboard(path: Optional[Path]) -> Any:
    """A writer of TensorBoard event files into ``path`` (None: only check that tensorboard is there)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise PSKVError("--tensorboard needs the tensorboard package: pip install tensorboard (or 'pskv[tensorboard]')")
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(str(path)) if path else None


def plot(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """Loss and accuracy per epoch, one PNG."""
    from matplotlib.figure import Figure  # pyplot's global state and display are not needed

    x = [row["epoch"] for row in history]
    fig = Figure(figsize=(10, 4), layout="tight")
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(x, [row["loss"] for row in history], marker="o")
    ax1.set(xlabel="epoch", ylabel="training loss", title="loss")
    ax2.plot(x, [row["train_acc"] for row in history], marker="o", label="train")
    ax2.plot(x, [row["test_acc"] for row in history], marker="s", label="test")
    ax2.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0, 1))
    ax2.legend()
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.set_xticks(x)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: Sequence[str]) -> int:
    """``pskv train ARGS``: a worker's program inside a job, else launch one (or train alone)."""
    args = build_parser().parse_args(list(argv))
    dist = args.kv_store.startswith("dist")
    try:
        if (args.workers is not None and args.workers < 1) or min(args.epochs, args.batch_size, args.image_size - (13 if args.model == "small_cnn" else 8), args.servers if dist else 1) < 1:
            raise PSKVError("--workers, --epochs, --batch-size, --image-size and (with a dist store) --servers must be >= 1 (--image-size >= 9 with resnet18, whose BatchNorm fails on a 1x1 batch of 1; >= 14 with small_cnn)")
        if args.dataset in ("cifar10", "folder") and not (args.data_dir and Path(args.data_dir).expanduser().is_dir()):
            raise PSKVError(f"--dataset {args.dataset} reads files: --data-dir must be a folder, got {args.data_dir}")
        if "cuda" in args.devices and not torch.cuda.is_available():  # here, not in every worker once the job started
            raise PSKVError(f"--devices {args.devices}: this torch sees no CUDA device")
        if args.resume and not args.checkpoint_dir:
            raise PSKVError("--resume needs --checkpoint-dir (where the checkpoints are)")
        if args.tensorboard:
            tensorboard(None)  # missing: said before anything starts
        if args.amp == "fp16":  # an fp16 step may overflow: the servers sum it as it is, the workers skip it
            if args.kv_store == "dist_async":
                raise PSKVError("--amp fp16 checks the summed gradients before updating; dist_async updates on the servers")
            os.environ["PSKV_NONFINITE"] = os.environ.get("PSKV_NONFINITE", "").strip() or "allow"  # (it goes with the pushes)
        if not dist and (args.workers or 1) != 1:
            raise PSKVError(f"--kv-store {args.kv_store} trains in this one process: use --workers 1 or a dist store")
        if os.environ.get("DMLC_ROLE") or not dist:
            return run_worker(args)
        from pskv.launch.local import launch_local  # only the process started by hand launches

        workers = args.workers or 2
        print(f"pskv train: launching {workers} workers and {args.servers} servers on this machine", file=sys.stderr)
        return launch_local(workers, args.servers, [sys.executable, "-m", "pskv", "train", *argv], quiet=True)
    except PSKVError as exc:
        print(f"pskv train: {exc}", file=sys.stderr)
        return 2
