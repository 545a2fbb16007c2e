#!/usr/bin/env python3
"""Peer benchmark: MXNet 1.9.1's distributed kvstore, push all arrays then pull all arrays.

Runs under any Python 3 (standard library only at the top level) as an orchestrator: it starts one
scheduler, ``-s`` servers and ``-n`` workers on 127.0.0.1 by re-executing this file under the MXNet
interpreter (``--mxnet-python``) with the ``DMLC_*`` environment, because MXNet's own
``tools/launch.py`` does not work on Python 3.9+. Every role gets ``OMP_NUM_THREADS=1`` and
``MXNET_CPU_WORKER_NTHREADS=1``.

Each worker ``init``s every key (list form), then each round pushes a fresh gradient array per key
(``(rank + 1) * ones``), pulls every key into separate output arrays and waits for all of it
(``mx.nd.waitall()``); the round's wall time is recorded. With no optimizer the servers store the
merged sum, so the last round's pulled values must equal ``W * (W + 1) / 2``.

    python benchmarks/mxnet_kvstore.py --shapes-json SHAPES.json -n 2 -s 2 --rounds 20 --warmup 3 \\
        [--kv-store dist_sync] [--json OUT.json]
    python benchmarks/mxnet_kvstore.py --demo-bug

``SHAPES.json`` is a JSON list of shapes (lists of ints). ``--demo-bug`` shows MXNet 1.9.1 overwriting a
pushed CPU array with the pulled result on ``dist_sync`` (2 workers, 1 server, the same array pushed
in each of 3 rounds: its value doubles every round).

Fresh gradient arrays are used each round precisely because of that bug: re-pushing one array would
push the previous round's pulled sum.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MXNET_PYTHON = "/tmp/mxnet-venv/bin/python"
DEMO_SHAPE = [4]
DEMO_ROUNDS = 3


# --------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time MXNet 1.9.1 dist kvstore rounds (push all arrays, then pull all) on one machine.",
    )
    parser.add_argument(
        "--shapes-json", type=Path, help="JSON file: a list of shapes (lists of ints), one per key"
    )
    parser.add_argument("-n", "--num-workers", type=int, default=2, help="number of workers (default 2)")
    parser.add_argument("-s", "--num-servers", type=int, default=2, help="number of servers (default 2)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed rounds before the timed ones (default 3)"
    )
    parser.add_argument("--kv-store", default="dist_sync", help="kvstore type (default dist_sync)")
    parser.add_argument("--json", type=Path, help="write the result as JSON to this file")
    parser.add_argument(
        "--mxnet-python",
        default=DEFAULT_MXNET_PYTHON,
        help=f"interpreter with mxnet 1.9.1 installed, used for every role (default {DEFAULT_MXNET_PYTHON})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="kill every process after this many seconds (default 600)",
    )
    parser.add_argument(
        "--demo-bug",
        action="store_true",
        help="instead of timing, show a re-pushed CPU array being overwritten by the pulled sum "
        "(2 workers, 1 server, 3 rounds, dist_sync)",
    )
    # Internal: set by the orchestrator when it re-executes this file for one role.
    parser.add_argument("--child", choices=["scheduler", "server", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is None:
        if args.demo_bug:
            args.num_workers, args.num_servers, args.kv_store = 2, 1, "dist_sync"
        elif args.shapes_json is None:
            parser.error("--shapes-json is required (unless --demo-bug)")
        if args.num_workers < 1 or args.num_servers < 1 or args.rounds < 1 or args.warmup < 0:
            parser.error("need -n >= 1, -s >= 1, --rounds >= 1 and --warmup >= 0")
        if shutil.which(args.mxnet_python) is None:
            parser.error(
                f"--mxnet-python {args.mxnet_python} not found; create it with: python3 -m venv /tmp/mxnet-venv "
                "&& /tmp/mxnet-venv/bin/pip install numpy==1.23.5 mxnet==1.9.1"
            )
    return args


def load_shapes(path: Path) -> list[list[int]]:
    shapes = json.loads(path.read_text())
    if not isinstance(shapes, list) or not shapes:
        raise SystemExit(f"{path}: expected a non-empty JSON list of shapes")
    for shape in shapes:
        if not isinstance(shape, list) or not all(isinstance(d, int) and d > 0 for d in shape):
            raise SystemExit(f"{path}: every shape must be a list of positive ints, got {shape!r}")
    return shapes


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# --------------------------------------------------------------------------- roles (MXNet interpreter)
def run_child(args: argparse.Namespace) -> None:
    """Entry point of one re-executed role. DMLC_ROLE in the environment decides what MXNet does."""
    if args.child in ("scheduler", "server"):
        # Importing mxnet with DMLC_ROLE=scheduler/server runs that role to completion and exits.
        import mxnet  # noqa: F401

        raise SystemExit(f"mxnet returned from its {args.child} loop without exiting")
    if args.demo_bug:
        result = worker_demo_bug(args.kv_store)
    else:
        result = worker_rounds(args.kv_store, load_shapes(args.shapes_json), args.rounds, args.warmup)
    args.result_file.write_text(json.dumps(result))


def worker_rounds(kv_store: str, shapes: list[list[int]], rounds: int, warmup: int) -> dict:
    import mxnet as mx

    kv = mx.kv.create(kv_store)
    rank, num_workers = kv.rank, kv.num_workers
    keys = list(range(len(shapes)))
    kv.init(keys, [mx.nd.zeros(shape) for shape in shapes])
    outs = [mx.nd.zeros(shape) for shape in shapes]
    mx.nd.waitall()

    times = []
    for r in range(warmup + rounds):
        grads = [mx.nd.full(shape, float(rank + 1)) for shape in shapes]  # fresh: see the module doc
        mx.nd.waitall()
        start = time.perf_counter()
        kv.push(keys, grads)
        kv.pull(keys, out=outs)
        mx.nd.waitall()
        elapsed = time.perf_counter() - start
        if r >= warmup:
            times.append(elapsed)

    expected = num_workers * (num_workers + 1) / 2
    for key, out in zip(keys, outs):
        values = out.asnumpy()
        if not (values == expected).all():
            raise SystemExit(
                f"worker rank {rank}: key {key} pulled min {values.min()} max {values.max()}, expected {expected}"
            )
    return {"rank": rank, "num_workers": num_workers, "round_s": times, "checked_value": expected}


def worker_demo_bug(kv_store: str) -> dict:
    import mxnet as mx

    kv = mx.kv.create(kv_store)
    kv.init(0, mx.nd.zeros(DEMO_SHAPE))
    pushed = mx.nd.ones(DEMO_SHAPE)  # the same array is pushed every round
    out = mx.nd.zeros(DEMO_SHAPE)
    history = []
    for _ in range(DEMO_ROUNDS):
        kv.push(0, pushed)
        kv.pull(0, out=out)
        mx.nd.waitall()
        history.append({"pushed": pushed.asnumpy().tolist(), "pulled": out.asnumpy().tolist()})
    return {"rank": kv.rank, "num_workers": kv.num_workers, "rounds": history}


# --------------------------------------------------------------------------- orchestrator (any Python)
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Role:
    """One started process, with its output captured in a file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # its own session: this role and what it started
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def launch(args: argparse.Namespace, log_dir: Path, helpers: list[Role], workers: list[Role]) -> list[Path]:
    """Start the scheduler and servers (appended to ``helpers``) and the workers (to ``workers``)."""
    base_env = dict(os.environ)
    base_env.update(
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT=str(free_port()),
        DMLC_NODE_HOST="127.0.0.1",
        DMLC_NUM_WORKER=str(args.num_workers),
        DMLC_NUM_SERVER=str(args.num_servers),
        OMP_NUM_THREADS="1",
        MXNET_CPU_WORKER_NTHREADS="1",
    )
    child_cmd = [args.mxnet_python, str(Path(__file__).resolve()), "--kv-store", args.kv_store]
    if args.demo_bug:
        child_cmd.append("--demo-bug")
    else:
        child_cmd += [
            "--shapes-json", str(args.shapes_json.resolve()),
            "--rounds", str(args.rounds),
            "--warmup", str(args.warmup),
        ]  # fmt: skip

    def start(role: str, name: str, extra: list[str]) -> Role:
        return Role(name, [*child_cmd, "--child", role, *extra], {**base_env, "DMLC_ROLE": role}, log_dir)

    helpers.append(start("scheduler", "scheduler", []))
    for i in range(args.num_servers):
        helpers.append(start("server", f"server{i}", []))
    result_files = [log_dir / f"worker{i}.json" for i in range(args.num_workers)]
    for i, path in enumerate(result_files):
        workers.append(start("worker", f"worker{i}", ["--result-file", str(path)]))
    return result_files


def wait_for(helpers: list[Role], workers: list[Role], timeout: float) -> str | None:
    """Wait until every worker exits 0 and the scheduler and servers follow. Returns an error or None."""
    deadline = time.monotonic() + timeout
    while any(w.proc.poll() is None for w in workers):
        for role in helpers + workers:
            code = role.proc.poll()
            if code not in (None, 0):
                return f"{role.name} exited with status {code}"
        if time.monotonic() > deadline:
            return f"timed out after {timeout:.0f} s"
        time.sleep(0.1)
    failed = [f"{w.name} ({w.proc.returncode})" for w in workers if w.proc.returncode != 0]
    if failed:
        return "workers failed: " + ", ".join(failed)
    for role in helpers:  # they exit once the workers have finalized
        try:
            role.proc.wait(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            print(
                f"warning: {role.name} still running after the workers finished; killing it", file=sys.stderr
            )
    return None


def orchestrate(args: argparse.Namespace) -> int:
    shapes = [DEMO_SHAPE] if args.demo_bug else load_shapes(args.shapes_json)
    numel = sum(math.prod(shape) for shape in shapes)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mxnet-kvstore-") as tmp:
        helpers: list[Role] = []
        workers: list[Role] = []
        try:
            result_files = launch(args, Path(tmp), helpers, workers)
            error = wait_for(helpers, workers, args.timeout)
        finally:
            for role in helpers + workers:
                role.kill()
        if error is not None:
            print(f"error: {error}", file=sys.stderr)
            for role in helpers + workers:
                print(f"----- {role.name} output (tail) -----\n{role.tail()}", file=sys.stderr)
            return 1
        results = sorted((json.loads(f.read_text()) for f in result_files), key=lambda r: r["rank"])
    wall = time.monotonic() - started

    if args.demo_bug:
        print(f"MXNet {args.kv_store}, 2 workers x 1 server: each worker pushes the SAME array of ones "
              f"{DEMO_ROUNDS} times, pulling into a separate output array")  # fmt: skip
        for res in results:
            for i, rnd in enumerate(res["rounds"]):
                print(f"  worker rank {res['rank']} after round {i + 1}: "
                      f"pushed array = {rnd['pushed']}, pulled = {rnd['pulled']}")  # fmt: skip
        print("(the pushed array should still hold 1.0; it holds the pulled sum, which doubles each round)")
        return 0

    rank0 = results[0]["round_s"]
    summary = {
        "peer": "mxnet-1.9.1",
        "kv_store": args.kv_store,
        "workers": args.num_workers,
        "servers": args.num_servers,
        "arrays": len(shapes),
        "bytes": numel * 4,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "round_s_median": statistics.median(rank0),
        "round_s_p10": percentile(rank0, 10),
        "round_s_p90": percentile(rank0, 90),
        "round_s_median_per_worker": [statistics.median(r["round_s"]) for r in results],
        "checked_value": results[0]["checked_value"],
        "wall_s": wall,
    }
    print(
        f"mxnet-1.9.1 {args.kv_store} W={args.num_workers} S={args.num_servers}: {len(shapes)} arrays, "
        f"{numel * 4 / 1e6:.1f} MB, {args.rounds} rounds: median {summary['round_s_median']:.4f} s "
        f"(p10 {summary['round_s_p10']:.4f}, p90 {summary['round_s_p90']:.4f}) on rank 0; "
        f"pulled values checked = {summary['checked_value']:g}; {wall:.0f} s wall"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        run_child(args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
