#!/usr/bin/env python3
"""Training step time, pskv against plain PyTorch and DDP in the same run (GPU or CPU).

The workload of issue 8: the d2l CIFAR ResNet-18, batch ``--batch`` per worker, synthetic data
already on the device, SGD momentum 0.9. Every configuration in one invocation:

- ``plain``: one process, ``torch.optim.SGD`` (foreach);
- ``pskv local``: one process, ``pskv.Trainer`` without a store;
- ``pskv 1x1`` and ``pskv WxS``: ``pskv launch`` of W workers and S servers (``dist_device_sync``,
  the Trainer's overlap as it chooses, or ``--overlap on|off``); every worker on the same device;
  ``pskv 1x1 sum``, ``pskv WxS sum``: the same with ``update_on_kvstore=False`` (the servers sum, each worker's
  optimizer updates on the device); with overlap these rows have flat keys (runs of parameters as one
  tensor, the Trainer's default with overlap on a GPU: ``pskv.trainer.FLAT_KEYS``), and the ``... keys``
  rows a store key per parameter;
- ``ddp``: W processes of DistributedDataParallel over gloo on the same device;
- ``ddp hook``: the same DDP, its buckets exchanged through S servers by ``pskv.ddp_hook`` under
  ``pskv launch`` (``dist_device_sync``; gloo only for DDP's setup);
- ``torch opt``: ``pskv.DistributedOptimizer`` around the same ``torch.optim.SGD`` under ``pskv launch``
  (the servers sum, the optimizer runs on each worker), beside the pskv Trainer's row.

For each: samples/s (all workers), ms per step, and for the Trainer's rows the time after backward
(``after bwd``: from ``loss.backward()``'s return to the step's end, the GPU's tail of backward
included, as no row waits for the GPU between backward and its optimizer; ``--sync-backward`` waits
there first, as this script did before 2026-11-28, so that only the exposed time is counted; the next
forward's waits for weights are not in it: the JSON has them apart, ``waits_per_step_s``, from the
Trainer's timeline spans).

    python benchmarks/train_step.py --device cuda --batch 128 [-n 2 -s 2] [--steps 30]
    python benchmarks/train_step.py --device cpu --batch 16 --steps 5      # a quick check of the script

``TRAIN_STEP_PROFILE=prefix`` writes a torch.profiler table of 5 steps after warm-up, by CPU time,
from rank 0 of each configuration (``prefix.<config><workers>.txt``), and its Chrome trace (``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent


def worker(args: argparse.Namespace) -> None:
    """One training process of configuration ``args.config``; rank 0 writes its numbers to ``args.out``."""
    import torch
    import torch.nn.functional as F

    import pskv
    import pskv.trainer as trainer_module
    from pskv.app.models import resnet18
    from pskv.ps import timeline

    device = torch.device(args.device)
    torch.manual_seed(0)
    net = resnet18(10).to(device)
    x = torch.randn(args.batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    rank, world = 0, 1
    if args.config in ("ddp", "ddphook"):
        import torch.distributed as dist

        kv = pskv.kv.create("dist_device_sync") if args.config == "ddphook" else None
        dist.init_process_group("gloo", **({"rank": kv.rank, "world_size": kv.num_workers} if kv is not None else {}))
        rank, world = dist.get_rank(), dist.get_world_size()
        model: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(net)
        if kv is not None:
            model.register_comm_hook(None, pskv.ddp_hook(kv))
    else:
        model = net
    hyper = {"learning_rate": 0.01, "momentum": 0.9}
    if args.config in ("plain", "ddp", "ddphook", "torchopt"):
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, foreach=True)
        trainer = None
        if args.config == "torchopt":
            kv = pskv.kv.create("dist_device_sync")
            opt = pskv.DistributedOptimizer(opt, kv)  # ("average": its exchange overlaps backward on a GPU; "sum" sends in step)
            rank, world = kv.rank, kv.num_workers
    else:
        kv = pskv.kv.create("dist_device_sync") if args.config in ("pskv", "pskvsum", "pskvkeys") else None
        trainer_module.FLAT_KEYS = args.config != "pskvkeys"
        overlap = {"on": True, "off": False}.get(args.overlap) if kv is not None else None
        on_kv = False if args.config == "pskvsum" else None  # "pskvsum": the servers sum, the worker's optimizer updates
        trainer = pskv.Trainer(net.parameters(), "sgd", hyper, kvstore=kv, overlap=overlap, update_on_kvstore=on_kv)
        rank, world = (kv.rank, kv.num_workers) if kv is not None else (0, 1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, exposed = [], []
    profile = os.environ.get("TRAIN_STEP_PROFILE")  # a torch.profiler table of 5 steps after warm-up, rank 0
    prof = None
    for step in range(args.warmup + args.steps):
        if profile and step == args.warmup and rank == 0:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
            prof = torch.profiler.profile(activities=acts)
            prof.__enter__()
        if prof is not None and step == args.warmup + 5:
            sync()
            prof.__exit__(None, None, None)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            Path(f"{profile}.{args.config}{world}.txt").write_text(table)
            prof.export_chrome_trace(f"{profile}.{args.config}{world}.json")  # CPU and GPU on one time axis
            prof = None
        sync()
        t0 = time.perf_counter()
        out = model(x)
        loss = F.cross_entropy(out, y)
        timeline.span("forward", t0)
        if trainer is None:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        else:
            net.zero_grad(set_to_none=True)
            tb = timeline.now()
            loss.backward()
            if args.sync_backward:  # (before 2026-11-28: the GPU idles while step's calls are made)
                sync()
            timeline.span("backward", tb)
            t1 = time.perf_counter()
            trainer.step(1)
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            if trainer is not None:
                exposed.append(time.perf_counter() - t1)
    if trainer is not None:
        trainer.synchronize()
    result = {"step_s": sorted(times)[len(times) // 2], "world": world}
    if exposed:  # step() after backward (the next forward's waits for weights are waits_per_step_s)
        result["after_backward_s"] = sorted(exposed)[len(exposed) // 2]
    if timeline.on:
        timeline._write()  # this worker's spans so far: a JSON array, its "]" left out
        events = json.loads(Path(f"{os.environ['PSKV_TIMELINE']}.worker-{rank}.json").read_text().rstrip().rstrip(",") + "]")
        waits = [e["dur"] / 1e6 for e in events if e.get("ph") == "X" and e["name"].startswith("wait ")]
        result["waits_per_step_s"] = sum(waits) / max(1, args.warmup + args.steps)
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))


def run(args: argparse.Namespace, config: str, workers: int, servers: int) -> Optional[dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        me = [sys.executable, __file__, "--worker", config, "--out", str(out), "--device", args.device,
              "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup), "--overlap", args.overlap, *(["--sync-backward"] if args.sync_backward else [])]  # fmt: skip
        env = {**os.environ, "PSKV_TIMELINE": getattr(args, "trace", None) or os.environ.get("PSKV_TIMELINE") or str(Path(tmp) / "t.json")}
        if config in ("pskv", "pskvsum", "pskvkeys", "ddphook", "torchopt"):  # (pskv launch sets MASTER_ADDR/PORT for DDP's setup)
            cmd = [sys.executable, "-m", "pskv", "launch", "-n", str(workers), "-s", str(servers), "--", *me]
        else:
            cmd = me
        if config == "ddp":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            procs = [subprocess.Popen(me, env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
                                               "WORLD_SIZE": str(workers)}) for r in range(workers)]  # fmt: skip
            status = max((p.wait() for p in procs), key=abs)
        else:
            status = subprocess.run(cmd, env=env).returncode
        # a row that failed is reported and the table goes on: with the result rank 0 wrote, if it wrote one
        # (on an H100 the ddp hook's workers aborted at exit after training: RESULTS.md section 21)
        if status:
            print(f"{config} {workers}x{servers}: exit status {status}" + ("" if out.exists() else ", no result"), file=sys.stderr)
        return {**json.loads(out.read_text()), "exit_status": status} if out.exists() else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("-n", "--workers", type=int, default=2)
    p.add_argument("-s", "--servers", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--sync-backward", action="store_true", help="wait for the GPU after backward (then `after bwd` is all exposed)")
    p.add_argument("--json", type=Path, default=HERE / "results" / "train_step.json")
    p.add_argument("--repeat", type=int, default=1, help="run the rows in turn this many times; each row's middle run is shown")
    p.add_argument("--skip", nargs="*", default=[], metavar="ROW", help='rows to leave out, by name ("pskv local" ...)')
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(argparse.Namespace(**{**vars(args), "config": args.worker}))
        return 0
    w, s = args.workers, args.servers
    table = [("plain", "plain", 1, 0), ("pskv local", "local", 1, 0), ("pskv 1x1", "pskv", 1, 1), ("pskv 1x1 keys", "pskvkeys", 1, 1), ("pskv 1x1 sum", "pskvsum", 1, 1),
             (f"pskv {w}x{s}", "pskv", w, s), (f"pskv {w}x{s} keys", "pskvkeys", w, s), (f"pskv {w}x{s} sum", "pskvsum", w, s), (f"ddp x{w} (gloo)", "ddp", w, 0),
             (f"ddp hook {w}x{s}", "ddphook", w, s), (f"torch opt {w}x{s}", "torchopt", w, s)]  # fmt: skip
    table = [row for row in table if row[0] not in args.skip]
    tries: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in table}
    for _ in range(args.repeat):  # the rows in turn, again and again: a GPU machine's rows vary by 20 % and more
        for name, config, n, m in table:
            r = run(args, config, n, m)
            tries[name] += [r] if r is not None else []
    ran = {name: sorted(rs, key=lambda r: r["step_s"])[(len(rs) - 1) // 2] if rs else None for name, rs in tries.items()}
    rows = {name: r for name, r in ran.items() if r is not None}
    base, ddp = rows.get("plain"), rows.get(f"ddp x{w} (gloo)")
    print(f"ResNet-18, batch {args.batch} per worker, {args.device}, median of {args.steps} steps"
          + (f"; the middle of {args.repeat} runs of each row, taken in turn (ms/step of every run at the right)" if args.repeat > 1 else ""))
    print(f"{'':18}{'samples/s':>11}{'ms/step':>9}{'after bwd':>11}{'/ plain':>9}{'/ ddp':>8}")
    for name, r in rows.items():
        sps = r["world"] * args.batch / r["step_s"]
        after = f"{1000 * r['after_backward_s']:.1f}" if "after_backward_s" in r else "-"
        r["samples_per_s"] = sps
        vs_plain = f"{sps / (args.batch / base['step_s']):.2f}" if base else "-"
        vs_ddp = f"{sps / (ddp['world'] * args.batch / ddp['step_s']):.2f}" if ddp else "-"
        failed = f"  (exit status {r['exit_status']})" if r.get("exit_status") else ""
        runs = "  " + " ".join(f"{1000 * t['step_s']:.1f}" for t in tries[name]) if args.repeat > 1 else ""
        print(f"{name:18}{sps:>11.0f}{1000 * r['step_s']:>9.1f}{after:>11}{vs_plain:>9}{vs_ddp:>8}{failed}{runs}")
    for name in (name for name, r in ran.items() if r is None):
        print(f"{name:18}failed: no result (its output above)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"device": args.device, "batch": args.batch, "rows": rows,
                                      "runs_step_s": {name: [t["step_s"] for t in rs] for name, rs in tries.items()}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
