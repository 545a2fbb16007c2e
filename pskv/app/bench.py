"""``pskv bench``: how fast a round of push + pull is, next to gloo all-reduce of the same tensors.

The counterpart of MXNet's kvstore bandwidth tool. A round is: every worker pushes every array
(``(rank + 1) * ones``), pulls every array, and waits; with no optimizer every worker must pull
``W(W+1)/2`` everywhere, which is checked. ``--compare gloo`` then runs ``torch.distributed``
``all_reduce`` over gloo on the same arrays, with the same number of processes, in the same
invocation (both started through ``pskv launch``), so the ratio compares like with like.

    pskv bench --model resnet18 -n 2 -s 2 --compare gloo
    pskv bench --size-mb 100 -n 4 -s 2 --json out.json

Every process of a round starts together (a barrier before each round), for both systems.
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

from pskv.errors import PSKVError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pskv bench", description="Time push+pull rounds of a model's parameters; compare with gloo all-reduce.")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", default="resnet18", choices=["resnet18", "resnet50", "vgg16"], help="the arrays of this network (%(default)s)")
    what.add_argument("--size-mb", type=float, help="one array of this many MB (fp32) instead of a model")
    p.add_argument("-n", "--num-workers", type=int, default=2, help="%(default)s")
    p.add_argument("-s", "--num-servers", type=int, default=2, help="%(default)s")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (%(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (%(default)s)")
    p.add_argument("--kv-store", default="dist_sync", choices=["dist_sync", "dist_device_sync", "dist_async"], help="%(default)s")
    p.add_argument("--compare", choices=["gloo"], help="also time torch.distributed all_reduce over gloo")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--worker", choices=["pskv", "gloo"], help=argparse.SUPPRESS)  # a process of a launched run
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p


def shapes_for(args: argparse.Namespace) -> list[tuple[int, ...]]:
    if args.size_mb is not None:
        if args.size_mb <= 0:
            raise PSKVError(f"--size-mb must be positive, got {args.size_mb}")
        return [(max(1, int(args.size_mb * 1e6 / 4)),)]
    from pskv.app.models import parameter_shapes

    return parameter_shapes(args.model)


def summarize(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "median": statistics.median(ordered),
        "p10": ordered[int(0.1 * (len(ordered) - 1))],
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
    }


# -- inside the launched processes ----------------------------------------------------------------


def pskv_worker(args: argparse.Namespace, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    import torch

    from pskv import kv as kvmod
    from pskv import optim

    kv = kvmod.create(args.kv_store)
    workers, rank = kv.num_workers, kv.rank
    keys = list(range(len(shapes)))
    kv.init(keys, [torch.zeros(s) for s in shapes])
    if args.kv_store == "dist_async":
        kv.set_optimizer(optim.create("sgd", learning_rate=0.0))  # async needs one; lr 0 keeps the values
    grads = [torch.full(s, rank + 1.0) for s in shapes]
    outs = [torch.empty(s) for s in shapes]
    times = []
    for i in range(args.warmup + args.rounds):
        kv.barrier()
        t0 = time.perf_counter()
        kv.push(keys, grads)
        kv.pull(keys, outs)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    want = 0.0 if args.kv_store == "dist_async" else workers * (workers + 1) / 2
    bad = [k for k, o in zip(keys, outs) if not torch.all(o == want)]
    if bad:
        raise PSKVError(f"worker {rank}: pulled wrong values for {len(bad)} arrays (first: key {bad[0]}); expected {want}")
    mine = {"rank": rank, "seconds": times, "shm": bool(getattr(kv, "_shm_servers", None))}
    everyone = kv.allgather(mine)
    kv.close()
    return {"workers": everyone, "servers": getattr(kv, "num_servers", 0)}


def gloo_worker(args: argparse.Namespace, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, workers = dist.get_rank(), dist.get_world_size()
    times = []
    tensors = [torch.empty(s) for s in shapes]
    for i in range(args.warmup + args.rounds):
        for t in tensors:
            t.fill_(rank + 1.0)
        dist.barrier()
        t0 = time.perf_counter()
        handles = [dist.all_reduce(t, async_op=True) for t in tensors]
        for h in handles:
            assert h is not None
            h.wait()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    want = workers * (workers + 1) / 2
    if not all(bool(torch.all(t == want)) for t in tensors):
        raise PSKVError(f"gloo rank {rank}: all_reduce gave wrong sums")
    everyone: list[Any] = [None] * workers
    dist.all_gather_object(everyone, {"rank": rank, "seconds": times})
    dist.destroy_process_group()
    return {"workers": everyone, "servers": 0}


# -- started by hand ----------------------------------------------------------------------------


def _run(args: argparse.Namespace, system: str, argv: Sequence[str], servers: int) -> dict[str, Any]:
    """Launch one system's run on this machine and read what its worker 0 wrote."""
    from pskv.launch.local import launch_local

    with tempfile.TemporaryDirectory(prefix="pskv-bench-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "pskv", "bench", *argv, "--worker", system, "--out", str(out)]
        peaks: dict[str, float] = {}
        status = launch_local(args.num_workers, servers, command, quiet=True, peak_rss_mb=peaks)
        if status != 0 or not out.exists():
            raise PSKVError(f"the {system} run failed (exit status {status})")
        result: dict[str, Any] = json.loads(out.read_text())
        result["peak_rss_mb"] = peaks
        return result


def report(args: argparse.Namespace, shapes: list[tuple[int, ...]], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    nbytes = sum(math.prod(s) for s in shapes) * 4
    what = f"{args.model} payload" if args.size_mb is None else f"{args.size_mb:g} MB array"
    shm = all(w.get("shm") for w in runs["pskv"]["workers"])
    print(
        f"pskv bench: {what}, {len(shapes)} arrays, {nbytes / 1e6:.1f} MB, {args.num_workers} workers x "
        f"{args.num_servers} servers, {args.kv_store} ({'shared memory' if shm else 'TCP'}), {args.rounds} rounds"
    )
    print(f"{'':18}{'median round':>14}{'p10':>10}{'p90':>10}{'GB/s per worker':>18}")
    result: dict[str, Any] = {
        "workers": args.num_workers,
        "servers": args.num_servers,
        "bytes": nbytes,
        "arrays": len(shapes),
        "kv_store": args.kv_store,
        "rounds": args.rounds,
        "shared_memory": shm,
    }
    for system, run in runs.items():
        per_round = [max(ts) for ts in zip(*(w["seconds"] for w in run["workers"]))]  # a round ends when its last worker is done
        stats = summarize(per_round)
        gbps = 2 * nbytes / stats["median"] / 1e9  # every worker sends and receives the payload
        label = "pskv" if system == "pskv" else "gloo all_reduce"
        print(f"{label:18}{stats['median']:>12.4f} s{stats['p10']:>9.4f}{stats['p90']:>10.4f}{gbps:>18.2f}")
        result[f"{system}_round_s"] = stats["median"]
        result[f"{system}_round_p10_s"] = stats["p10"]
        result[f"{system}_round_p90_s"] = stats["p90"]
        result[f"{system}_gbps_per_worker"] = gbps
        result[f"{system}_peak_rss_mb"] = {name: round(mb, 1) for name, mb in sorted(run["peak_rss_mb"].items())}
    if "gloo" in runs:
        result["ratio"] = result["pskv_round_s"] / result["gloo_round_s"]
        print(f"ratio pskv / gloo: {result['ratio']:.2f}")
    for system in runs:
        mem = ", ".join(f"{k} {v:.0f}" for k, v in result[f"{system}_peak_rss_mb"].items())
        print(f"peak memory, MB ({system}): {mem}")
    return result


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        shapes = shapes_for(args)
        if args.worker:  # one process of a launched run
            result = (pskv_worker if args.worker == "pskv" else gloo_worker)(args, shapes)
            if int(os.environ.get("DMLC_WORKER_ID", os.environ.get("RANK", "0"))) == 0 and args.out:
                args.out.write_text(json.dumps(result))
            return 0
        if args.num_workers < 1 or args.num_servers < 1:
            raise PSKVError("pskv bench needs at least one worker and one server")
        passed = ["--rounds", str(args.rounds), "--warmup", str(args.warmup), "--kv-store", args.kv_store]
        passed += ["--model", args.model] if args.size_mb is None else ["--size-mb", str(args.size_mb)]
        runs = {"pskv": _run(args, "pskv", passed, args.num_servers)}
        if args.compare == "gloo":
            runs["gloo"] = _run(args, "gloo", passed, 0)
        result = report(args, shapes, runs)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    except PSKVError as exc:
        print(f"pskv bench: {exc}", file=sys.stderr)
        return 2
