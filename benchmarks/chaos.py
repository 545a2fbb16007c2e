"""The chaos suite: short trainings under ``pskv launch``, each with one process killed (-9) or stopped
(SIGSTOP) at a random moment; each run's end is classified (issue 13).

    python benchmarks/chaos.py --runs 50 --out benchmarks/results/chaos.json

A fault-free run first gives the reference parameters. Then every run picks a victim (the scheduler,
a server or a worker) and a moment, and ends as one of:

- ``same result``: the job finished and its parameters equal the reference (the fault came too late
  to matter, or the job recovered from it);
- ``finished without it`` (``--min-workers 1``): a worker was lost and the other finished the job;
- ``clear error``: the launcher exited non-zero naming the lost process, within 15 s of a kill or
  within the heartbeat deadline (``PSKV_HEARTBEAT_TIMEOUT``, 5 s here; ``PSKV_START_TIMEOUT``, 20 s,
  for a process stopped before it registered) + 15 s of a stop;
- ``slow error``: the same, later than that;
- ``unnamed error``: non-zero, but the lost process is not named;
- ``hang``: still running 60 s after the fault (then killed);
- ``wrong result``: exit 0 with other parameters.

Without replicas or ``--min-workers`` a lost server, worker or scheduler ends the job: the goal is 0
hangs, 0 wrong results, every error clear. With ``--replicas 1`` a killed server's run should end
with the same result; with ``--min-workers 1`` a killed worker's run should finish without it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HEARTBEAT = 5.0
START = 20.0  # PSKV_START_TIMEOUT: a process stopped before it registered is named when it passes
JOB = """
import sys, time, torch, pskv
kv = pskv.kv.create("dist_sync")
kv.set_optimizer(pskv.optim.create("sgd", learning_rate=0.1, momentum=0.9))
shapes = {"big": (300, 1000), "small": (10,)}
for k, shape in shapes.items():
    kv.init(k, torch.zeros(shape))
g = torch.Generator().manual_seed(kv.rank)
outs = {k: torch.empty(shape) for k, shape in shapes.items()}
for step in range(40):
    grads = {k: torch.randn(shape, generator=g) for k, shape in shapes.items()}
    kv.pushpull(list(shapes), list(grads.values()), list(outs.values()))
    time.sleep(0.05)
torch.save(outs, f"{sys.argv[1]}.{kv.rank}")
kv.close()
"""


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def role(pid: int) -> str:
    """``"server 1"``, ``"worker 0"``, ``"scheduler"`` from a process's environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return "?"
    name = env.get(b"DMLC_ROLE", b"?").decode()
    rank = env.get(b"DMLC_SERVER_ID" if name == "server" else b"DMLC_WORKER_ID")
    return f"{name} {rank.decode()}" if rank is not None else name


def run_once(work: Path, fault: tuple[str, str, float] | None, min_workers: int = 0, replicas: int = 0) -> dict[str, object]:
    """One job; ``fault`` = (victim role, "kill" or "stop", seconds after start)."""
    result = work / "params.pt"
    for old in work.glob("params.pt.*"):
        old.unlink()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PSKV_HEARTBEAT_TIMEOUT": str(HEARTBEAT), "PSKV_START_TIMEOUT": str(START)}
    elastic = (["--min-workers", str(min_workers)] if min_workers else []) + (["--replicas", "1"] if replicas else [])
    argv = [sys.executable, "-m", "pskv", "launch", "-n", "2", "-s", "2", *elastic, "--", sys.executable, str(work / "job.py"), str(result)]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    start, hit, faulted = time.monotonic(), None, None
    stopped: list[int] = []
    try:
        while launcher.poll() is None:
            now = time.monotonic() - start
            if fault is not None and hit is None and now >= fault[2]:
                procs = {role(p): p for p in children(launcher.pid)}
                if fault[0] in procs:
                    pid = procs[fault[0]]
                    os.kill(pid, signal.SIGKILL if fault[1] == "kill" else signal.SIGSTOP)
                    stopped += [pid] if fault[1] == "stop" else []
                    hit, faulted = fault[0], time.monotonic()
                elif now > 30:
                    hit = "none"
            if faulted is not None and time.monotonic() - faulted > 60:
                break
            if faulted is None and now > 120:
                break
            time.sleep(0.01)
        hung = launcher.poll() is None
        if hung:
            os.killpg(launcher.pid, signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
    finally:
        for pid in stopped:
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    took = None if faulted is None else time.monotonic() - faulted
    return {"hung": hung, "code": launcher.returncode, "stderr": err[-3000:], "hit": hit, "after_fault_s": took,
            "params": next((str(p) for p in sorted(work.glob("params.pt.*"))), None)}  # fmt: skip


def classify(run: dict[str, object], fault: tuple[str, str, float], reference: dict[str, Any], elastic: bool) -> str:
    import torch

    if run["hung"]:
        return "hang"
    if run["code"] == 0:
        got = torch.load(str(run["params"])) if run["params"] else None
        same = got is not None and all(torch.equal(got[k], reference[k]) for k in reference)
        if not same and elastic and fault[0].startswith("worker") and got is not None and run["hit"] == fault[0]:
            return "finished without it"  # --min-workers: the later rounds summed fewer gradients
        return "same result" if same else "wrong result"
    named = str(run["hit"]) in str(run["stderr"])
    limit = 15.0 if fault[1] == "kill" else max(HEARTBEAT, START) + 15.0
    if not named:
        return "unnamed error"
    took = run["after_fault_s"]
    return "clear error" if took is not None and float(took) <= limit else "slow error"  # type: ignore[arg-type]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, help="write every run's fault and outcome here (JSON)")
    p.add_argument("--min-workers", type=int, default=0, help="pskv launch --min-workers (1: a lost worker should not end the job)")
    p.add_argument("--replicas", type=int, default=0, choices=[0, 1], help="pskv launch --replicas (1: a lost server should change nothing)")
    args = p.parse_args()
    import torch

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="pskv-chaos-") as tmp:
        work = Path(tmp)
        (work / "job.py").write_text(JOB)
        t0 = time.monotonic()
        ref_run = run_once(work, None)
        if ref_run["code"] != 0:
            print(f"the fault-free run failed:\n{ref_run['stderr']}", file=sys.stderr)
            return 1
        length = time.monotonic() - t0
        reference = torch.load(str(ref_run["params"]))
        print(f"fault-free run: {length:.1f} s (launch to exit); faults land in 1 .. {length:.1f} s", flush=True)
        victims = ["scheduler", "server 0", "server 1", "worker 0", "worker 1"]
        rows = []
        for i in range(args.runs):
            fault = (rng.choice(victims), rng.choice(["kill", "kill", "stop"]), rng.uniform(1.0, length))
            run = run_once(work, fault, args.min_workers, args.replicas)
            outcome = classify(run, fault, reference, args.min_workers > 0)
            when = "" if run["after_fault_s"] is None else f", ended {float(run['after_fault_s']):.1f} s after"  # type: ignore[arg-type]
            print(f"run {i + 1:3d}: {fault[1]:4s} {fault[0]:9s} at {fault[2]:4.1f} s -> {outcome} (exit {run['code']}{when})", flush=True)
            rows.append({"victim": fault[0], "fault": fault[1], "at_s": round(fault[2], 2), "outcome": outcome,
                         "exit": run["code"], "ended_after_fault_s": run["after_fault_s"],
                         "stderr_tail": str(run["stderr"])[-600:] if outcome != "same result" else ""})  # fmt: skip
    table = collections.Counter((r["fault"], str(r["victim"]).split()[0], r["outcome"]) for r in rows)
    print("\n| fault | victim | outcome | runs |\n|---|---|---|---|")
    for (fault_kind, victim, result), n in sorted(table.items()):
        print(f"| {fault_kind} | {victim} | {result} | {n} |")
    totals = collections.Counter(r["outcome"] for r in rows)
    print(f"\n{args.runs} runs: " + ", ".join(f"{k} {v}" for k, v in sorted(totals.items())))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"runs": rows, "totals": dict(totals)}, indent=1) + "\n")
    return 0 if totals["hang"] == 0 and totals["wrong result"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
