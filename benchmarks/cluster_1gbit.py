#!/usr/bin/env python3
"""An emulated cluster on this machine: W worker hosts and S server hosts, every link 1 Gbit/s.

Each host is a network namespace this script creates (``pskvb-h0`` ..., addresses 10.79.0.1 ...,
on one bridge in ``pskvb-sw``); every host's link is shaped in both directions with ``tc tbf``,
as ``../shared/tools/netns_cluster.sh`` does. Traffic goes only to those hosts; the namespaces
are removed at the end. Needs root, ``ip`` and ``tc`` (iproute2); without them it says so and
exits with status 0.

In the same run, with the ResNet-18 payload (42 arrays, 44.7 MB) per round:

- pskv ``dist_sync``: scheduler and workers on the worker hosts, servers on their own hosts,
  ``PSKV_SHM=0`` (the namespaces share one kernel); a round is ``kv.pushpull`` of all keys; then,
  as the Trainer pushes during backward, one ``pushpull`` per key from the last layer to the first
  with priority -layer: the time until layer 0's value is back (the next forward's first wait),
  also counted from its own push, and until all are (``PSKV_WINDOW_BYTES`` lets it pass the others);
- gloo ``all_reduce`` over the worker hosts: one flat 44.7 MB tensor, and the 42 tensors.

The bound of a parameter server with servers on their own hosts is M/B (each link is full duplex:
pulls stream down while pushes stream up); a ring all-reduce's is 2M(N-1)/(N B).

With ``--ddp``, training steps instead: DistributedDataParallel on ResNet-18 (``--batch`` CIFAR-size
images per worker, SGD), its buckets all-reduced by gloo, or exchanged through the servers by
``pskv.ddp_hook``; the time of a step (forward, backward with the exchange overlapped, optimizer).

    sudo .venv/bin/python benchmarks/cluster_1gbit.py [--workers 4] [--servers 4] [--rounds 10] [--ddp]
        [--try PSKV_WINDOW_BYTES=8388608 --try PSKV_CHUNK_BYTES=524288,PSKV_BATCH_BYTES=1048576 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SUBNET = "10.79.0"
PREFIX = "pskvb"
PORT = 9391


def shapes() -> list[tuple[int, ...]]:
    try:
        from pskv.app.models import parameter_shapes
    except ImportError:  # before the application moved under pskv.app
        from pskv.models import parameter_shapes  # type: ignore[no-redef]
    return parameter_shapes("resnet18")


# -- the namespaces ---------------------------------------------------------------------------------


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def up(n: int, rate: str) -> None:
    sw = f"{PREFIX}-sw"
    sh("ip", "netns", "add", sw)
    sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", sw, "link", "set", "br0", "up")
    for i in range(n):
        host = f"{PREFIX}-h{i}"
        sh("ip", "netns", "add", host)
        sh("ip", "link", "add", f"{PREFIX}{i}", "type", "veth", "peer", "name", "eth0", "netns", host)
        sh("ip", "link", "set", f"{PREFIX}{i}", "netns", sw)
        sh("ip", "-n", sw, "link", "set", f"{PREFIX}{i}", "master", "br0", "up")
        sh("ip", "-n", host, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
        sh("ip", "-n", host, "link", "set", "eth0", "up")
        sh("ip", "-n", host, "link", "set", "lo", "up")
        for ns, dev in ((host, "eth0"), (sw, f"{PREFIX}{i}")):
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "512kb", "latency", "100ms")


def down(n: int) -> None:
    for name in [f"{PREFIX}-h{i}" for i in range(n)] + [f"{PREFIX}-sw"]:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def start(host: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}-h{host}", *argv], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit("a process of the benchmark hung; stopped them all") from None
        if p.returncode:
            for q in procs:
                q.kill()
            raise SystemExit(f"a process failed (status {p.returncode}):\n{out[-3000:]}")
        outs.append(out)
    return outs


# -- the two systems ----------------------------------------------------------------------------------


def run_pskv(args: argparse.Namespace, role: str = "pskv", setting: str = "") -> Any:
    w, s = args.workers, args.servers
    base = {"DMLC_PS_ROOT_URI": f"{SUBNET}.1", "DMLC_PS_ROOT_PORT": str(PORT), "DMLC_NUM_WORKER": str(w),
            "DMLC_NUM_SERVER": str(s), "PSKV_SHM": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            **dict(kv.split("=", 1) for kv in setting.split(",") if kv)}  # fmt: skip
    serve = [sys.executable, "-m", "pskv", "serve"]
    helpers = [start(0, serve, {**base, "DMLC_ROLE": "scheduler", "DMLC_NODE_HOST": f"{SUBNET}.1"})]
    time.sleep(1.0)
    for j in range(s):
        env = {**base, "DMLC_ROLE": "server", "DMLC_SERVER_ID": str(j), "DMLC_NODE_HOST": f"{SUBNET}.{w + j + 1}"}
        helpers.append(start(w + j, serve, env))
    workers = []
    for i in range(w):
        env = {**base, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(i), "DMLC_NODE_HOST": f"{SUBNET}.{i + 1}"}
        env.update(gloo_env(i, w))  # (the ddp hook's workers: DDP's own setup)
        workers.append(start(i, [sys.executable, __file__, "--role", role, "--rounds", str(args.rounds), "--batch", str(args.batch)], env))
    outs = finish(workers, 600)
    finish(helpers, 60)
    return json.loads(outs[0].strip().splitlines()[-1])


def gloo_env(rank: int, world: int) -> dict[str, str]:
    return {"MASTER_ADDR": f"{SUBNET}.1", "MASTER_PORT": str(PORT + 1), "RANK": str(rank), "WORLD_SIZE": str(world),
            "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}  # fmt: skip


def run_gloo(args: argparse.Namespace, role: str) -> list[float]:
    w = args.workers
    procs = []
    for i in range(w):
        argv = [sys.executable, __file__, "--role", role, "--rounds", str(args.rounds), "--batch", str(args.batch)]
        procs.append(start(i, argv, gloo_env(i, w)))
    outs = finish(procs, 600)
    return json.loads(outs[0].strip().splitlines()[-1])  # type: ignore[no-any-return]


def pskv_worker(rounds: int) -> None:
    import torch

    import pskv

    kv = pskv.kv.create("dist_sync")
    keys = list(range(len(shapes())))
    kv.init(keys, [torch.zeros(s) for s in shapes()])
    grads = [torch.full(s, kv.rank + 1.0) for s in shapes()]
    outs = [torch.empty(s) for s in shapes()]
    w = kv.num_workers
    times: dict[str, list[float]] = {"round": [], "first": [], "last": [], "step": []}
    for r in range(rounds + 1):
        kv.barrier()
        t0 = time.perf_counter()
        kv.pushpull(keys, grads, out=outs)
        times["round"].append(time.perf_counter() - t0)
        kv.barrier()  # (checked while no one is timed)
        if not all(torch.all(o == w * (w + 1) / 2) for o in outs):
            raise SystemExit(f"worker {kv.rank}: wrong sums in round {r}")
        # as the Trainer does in backward: the last layer's gradient first, each key its own call
        # with priority -layer; the next forward waits for layer 0 first, which is pushed last
        kv.barrier()
        t0 = time.perf_counter()
        handles = [kv.pushpull(k, grads[k], out=outs[k], priority=-k, wait=False) for k in reversed(keys[1:])]
        t1 = time.perf_counter()
        kv.pushpull(0, grads[0], out=outs[0], priority=0)
        times["first"].append(time.perf_counter() - t0)
        times["last"].append(time.perf_counter() - t1)
        for h in handles:
            h.wait()
        times["step"].append(time.perf_counter() - t0)
    everyone = kv.allgather({name: t[1:] for name, t in times.items()})
    kv.close()
    print(json.dumps({name: [max(t) for t in zip(*(e[name] for e in everyone))] for name in times}))


def gloo_worker(rounds: int, flat: bool) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, w = dist.get_rank(), dist.get_world_size()
    n = sum(torch.Size(s).numel() for s in shapes())
    tensors = [torch.empty(n)] if flat else [torch.empty(s) for s in shapes()]
    times = []
    for _ in range(rounds + 1):
        for t in tensors:
            t.fill_(rank + 1.0)
        dist.barrier()
        t0 = time.perf_counter()
        for h in [dist.all_reduce(t, async_op=True) for t in tensors]:
            h.wait()  # type: ignore[union-attr]
        times.append(time.perf_counter() - t0)
        if not all(bool(torch.all(t == w * (w + 1) / 2)) for t in tensors):
            raise SystemExit(f"gloo rank {rank}: wrong sums")
    everyone: list[Any] = [None] * w
    dist.all_gather_object(everyone, times[1:])
    dist.destroy_process_group()
    print(json.dumps([max(t) for t in zip(*everyone)]))


def local_hook(state, bucket):  # type: ignore[no-untyped-def]  # (DDP refuses string annotations)
    """No exchange at all: what a step costs without communication (its weights then differ)."""
    import torch

    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def ddp_worker(steps: int, batch: int, hook: str) -> None:
    """DDP training steps of ResNet-18; prints the slowest worker's time of each step."""
    import torch
    import torch.distributed as dist

    import pskv
    from pskv.app.models import resnet18

    kv = pskv.kv.create("dist_sync") if hook == "ddp-hook" else None
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(resnet18(10))
    if kv is not None:
        model.register_comm_hook(None, pskv.ddp_hook(kv))
    elif hook == "ddp-none":
        model.register_comm_hook(None, local_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times[1:])
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    got = [torch.empty_like(flat) for _ in everyone]
    dist.all_gather(got, flat)
    if hook != "ddp-none" and not all(torch.equal(g, got[0]) for g in got):
        raise SystemExit("the workers' weights differ")
    if kv is not None:
        kv.close()
    dist.destroy_process_group()
    print(json.dumps([max(t) for t in zip(*everyone)]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", type=Path, default=HERE / "results" / "cluster_1gbit.json")
    p.add_argument("--ddp", action="store_true", help="time DDP training steps: gloo against pskv.ddp_hook")
    p.add_argument("--batch", type=int, default=4, help="with --ddp: images per worker and step")
    p.add_argument("--try", dest="settings", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                   help="pskv's rows again with these environment variables (PSKV_WINDOW_BYTES=8388608 ...), in the same run")
    p.add_argument("--role", choices=["pskv", "gloo", "gloo-flat", "ddp", "ddp-hook", "ddp-none"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ddp and args.json == HERE / "results" / "cluster_1gbit.json":
        args.json = HERE / "results" / "cluster_1gbit_ddp.json"
    if args.role == "pskv":
        pskv_worker(args.rounds)
        return 0
    if args.role in ("ddp", "ddp-hook", "ddp-none"):
        ddp_worker(args.rounds, args.batch, args.role)
        return 0
    if args.role:
        gloo_worker(args.rounds, args.role == "gloo-flat")
        return 0
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        print(f"cluster_1gbit: skipped: it needs root and iproute2's ip and tc (missing: {', '.join(missing) or 'root'})")
        return 0
    n = args.workers + args.servers
    down(n)
    try:
        up(n, args.rate)
        if args.ddp:
            rows = {"DDP, pskv.ddp_hook": run_pskv(args, "ddp-hook"), "DDP, gloo all-reduce": run_gloo(args, "ddp"),
                    "DDP, no exchange (compute)": run_gloo(args, "ddp-none")}  # fmt: skip
        else:
            pskv = run_pskv(args)
            rows = {
                "pskv pushpull": pskv["round"],
                "pskv by layer: layer 0 back": pskv["first"],
                "  from its push (pushed last)": pskv["last"],
                "pskv by layer: all back": pskv["step"],
                "gloo all_reduce, flat": run_gloo(args, "gloo-flat"),
                "gloo all_reduce, 42 tensors": run_gloo(args, "gloo"),
            }
            for setting in args.settings:  # (a search for the settings of jobs across hosts: one namespace setup, one gloo run)
                tried = run_pskv(args, setting=setting)
                rows[f"pskv pushpull, {setting}"], rows[f"pskv by layer: all back, {setting}"] = tried["round"], tried["step"]
    finally:
        down(n)
    nbytes = sum(4 * int(__import__("math").prod(s)) for s in shapes())
    units = {"gbit": 1e9, "mbit": 1e6}
    rate = next((float(args.rate[: -len(u)]) * f / 8 for u, f in units.items() if args.rate.endswith(u)), None)
    print(f"emulated cluster: {args.workers} worker hosts + {args.servers} server hosts, links {args.rate} both ways, "
          f"ResNet-18 payload {nbytes / 1e6:.1f} MB, {args.rounds} rounds")  # fmt: skip
    if rate:
        w = args.workers
        print(f"bounds: parameter server M/B {nbytes / rate:.3f} s, ring all-reduce 2M(N-1)/(N B) {2 * nbytes * (w - 1) / w / rate:.3f} s")
    result: dict[str, Any] = {"workers": args.workers, "servers": args.servers, "rate": args.rate, "bytes": nbytes}
    if args.ddp:
        print(f"DDP training steps, ResNet-18, batch {args.batch} per worker")
    flat = statistics.median(rows["DDP, gloo all-reduce" if args.ddp else "gloo all_reduce, flat"])
    width = max(30, *(len(name) + 1 for name in rows))
    print(f"{'':{width}}{'median':>10}{'p10':>9}{'p90':>9}{'/ gloo' if args.ddp else '/ gloo flat':>13}")
    for name, times in rows.items():
        ordered = sorted(times)
        med = statistics.median(ordered)
        p10, p90 = (ordered[round(q * (len(ordered) - 1))] for q in (0.1, 0.9))  # the nearest rank, as pskv bench
        print(f"{name:{width}}{med:>9.3f}s{p10:>9.3f}{p90:>9.3f}{med / flat:>13.2f}")
        result[name] = {"median_s": med, "p10_s": p10, "p90_s": p90, "rounds_s": times}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
