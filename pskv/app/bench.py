"""``pskv bench``: how fast a round of push + pull is, next to gloo all-reduce of the same tensors.

MXNet's kvstore bandwidth tool: in a round every worker pushes every array (``(rank + 1) * ones``)
and pulls back ``W(W+1)/2`` (checked). ``--compare gloo`` times gloo's ``all_reduce`` of the same
arrays, started the same way (each round after a barrier), so the ratio compares like with like.
``pskv bench --model resnet18 -n 2 -s 2 --compare gloo``; ``pskv bench --size-mb 100 --json out.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pskv import kv as kvstore
from pskv import optim
from pskv.app.models import parameter_shapes
from pskv.errors import PSKVError
from pskv.ps import timeline

Shapes = list[tuple[int, ...]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pskv bench", description="Time push+pull rounds of a model's parameters; compare with gloo all-reduce.")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", default="resnet18", choices=["resnet18", "resnet50", "vgg16"], help="time the arrays of this model (%(default)s)")
    what.add_argument("--size-mb", type=float, help="one array of this many MB (fp32) instead of a model")
    p.add_argument("-n", "--num-workers", type=int, default=2, help="workers (%(default)s)")
    p.add_argument("-s", "--num-servers", type=int, default=2, help="servers (%(default)s)")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (%(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (%(default)s)")
    p.add_argument("--kv-store", default="dist_sync", choices=["dist_sync", "dist_device_sync", "dist_async"], help="the store (%(default)s)")
    p.add_argument("--compare", choices=["gloo"], help="also time torch.distributed all_reduce over gloo")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--worker", choices=["pskv", "gloo"], help=argparse.SUPPRESS)  # a launched process
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)  # where its worker 0 writes the results
    return p


def pskv_worker(args: argparse.Namespace, shapes: Shapes) -> list[dict[str, Any]]:
    kv = kvstore.create(args.kv_store)
    keys = list(range(len(shapes)))
    kv.init(keys, [torch.zeros(s) for s in shapes])
    if args.kv_store == "dist_async":
        kv.set_optimizer(optim.create("sgd", learning_rate=0.0))  # async needs one; lr 0 keeps the values
    grads = [torch.full(s, kv.rank + 1.0) for s in shapes]
    outs = [torch.empty(s) for s in shapes]
    times = []
    for i in range(args.warmup + args.rounds):
        kv.barrier()  # every round starts together
        t0 = time.perf_counter()
        kv.push(keys, grads)
        kv.pull(keys, outs)
        timeline.span("round", t0)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    want = 0.0 if args.kv_store == "dist_async" else kv.num_workers * (kv.num_workers + 1) / 2
    bad = [k for k, o in zip(keys, outs) if not torch.all(o == want)]
    if bad:
        raise PSKVError(f"worker {kv.rank}: wrong values in {len(bad)} arrays (first: key {bad[0]}), not {want}")
    everyone = kv.allgather({"rank": kv.rank, "seconds": times, "shm": bool(getattr(kv, "_shm_servers", None))})
    kv.close()
    return everyone


def gloo_worker(args: argparse.Namespace, shapes: Shapes) -> list[dict[str, Any]]:
    dist.init_process_group("gloo")
    rank, workers = dist.get_rank(), dist.get_world_size()
    tensors = [torch.empty(s) for s in shapes]
    times = []
    for i in range(args.warmup + args.rounds):
        for t in tensors:
            t.fill_(rank + 1.0)  # all_reduce sums in place: every round starts from the same values
        dist.barrier()
        t0 = time.perf_counter()
        for handle in [dist.all_reduce(t, async_op=True) for t in tensors]:
            assert handle is not None
            handle.wait()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if not all(bool(torch.all(t == workers * (workers + 1) / 2)) for t in tensors):
        raise PSKVError(f"gloo rank {rank}: all_reduce gave wrong sums")
    everyone: list[Any] = [None] * workers
    dist.all_gather_object(everyone, {"rank": rank, "seconds": times})
    dist.destroy_process_group()
    return everyone


def launch_run(args: argparse.Namespace, argv: Sequence[str], system: str, servers: int) -> dict[str, Any]:
    """Run ``pskv bench ARGV`` as the workers of a job on this machine; read what worker 0 wrote."""
    from pskv.launch.local import launch_local

    with tempfile.TemporaryDirectory(prefix="pskv-bench-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "pskv", "bench", *argv, "--worker", system, "--out", str(out)]
        peaks: dict[str, float] = {}
        status = launch_local(args.num_workers, servers, command, quiet=True, peak_rss_mb=peaks)
        if status != 0 or not out.exists():
            raise PSKVError(f"the {system} run failed (exit status {status})")
        peak_rss_mb = {name: round(mb, 1) for name, mb in sorted(peaks.items())}
        return {"workers": json.loads(out.read_text()), "peak_rss_mb": peak_rss_mb}


def report(args: argparse.Namespace, shapes: Shapes, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Print the table; return the results (the JSON file's contents)."""
    nbytes = sum(math.prod(s) for s in shapes) * 4
    what = f"{args.model} payload" if args.size_mb is None else f"{args.size_mb:g} MB array"
    shm = all(w["shm"] for w in runs["pskv"]["workers"])
    print(f"pskv bench: {what}, {len(shapes)} arrays, {nbytes / 1e6:.1f} MB, {args.num_workers} workers x "
          f"{args.num_servers} servers, {args.kv_store} ({'shared memory' if shm else 'TCP'}), "
          f"{args.rounds} rounds")
    print(f"{'':18}{'median round':>14}{'p10':>10}{'p90':>10}{'GB/s per worker':>18}")
    result: dict[str, Any] = {
        "workers": args.num_workers, "servers": args.num_servers, "bytes": nbytes, "arrays": len(shapes),
        "kv_store": args.kv_store, "rounds": args.rounds, "shared_memory": shm,
    }  # fmt: skip
    for system, run in runs.items():
        # a round ends when its last worker is done
        rounds = sorted(max(ts) for ts in zip(*(w["seconds"] for w in run["workers"])))
        median = statistics.median(rounds)
        p10, p90 = (rounds[round(q * (len(rounds) - 1))] for q in (0.1, 0.9))  # the nearest rank
        gbps = 2 * nbytes / median / 1e9  # every worker sends and receives the payload
        label = "pskv" if system == "pskv" else "gloo all_reduce"
        print(f"{label:18}{median:>12.4f} s{p10:>9.4f}{p90:>10.4f}{gbps:>18.2f}")
        result.update({f"{system}_round_s": median, f"{system}_round_p10_s": p10, f"{system}_round_p90_s": p90})
        result.update({f"{system}_gbps_per_worker": gbps, f"{system}_peak_rss_mb": run["peak_rss_mb"]})
    if "gloo" in runs:
        result["ratio"] = result["pskv_round_s"] / result["gloo_round_s"]
        print(f"ratio pskv / gloo: {result['ratio']:.2f}")
    for system, run in runs.items():
        print(f"peak memory, MB ({system}): " + ", ".join(f"{k} {v:.0f}" for k, v in run["peak_rss_mb"].items()))
    return result


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        if args.size_mb is not None and not 0 < args.size_mb < math.inf:
            raise PSKVError(f"--size-mb must be positive, got {args.size_mb}")
        if args.num_workers < 1 or args.num_servers < 1 or args.rounds < 1 or args.warmup < 0:
            raise PSKVError(f"-n, -s and --rounds must be >= 1, --warmup >= 0; got {args.num_workers}, {args.num_servers}, {args.rounds}, {args.warmup}")
        shapes: Shapes = parameter_shapes(args.model) if args.size_mb is None else [(max(1, int(args.size_mb * 1e6 / 4)),)]
        if args.worker:  # a process of a launched run
            everyone = (pskv_worker if args.worker == "pskv" else gloo_worker)(args, shapes)
            if int(os.environ.get("DMLC_WORKER_ID", os.environ.get("RANK", "0"))) == 0 and args.out:
                args.out.write_text(json.dumps(everyone))
            return 0
        runs = {"pskv": launch_run(args, argv, "pskv", args.num_servers)}
        if args.compare == "gloo":
            runs["gloo"] = launch_run(args, argv, "gloo", 0)
        result = report(args, shapes, runs)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    except (PSKVError, OSError) as exc:  # OSError: --json cannot be written
        print(f"pskv bench: {exc}", file=sys.stderr)
        return 2
