"""What the cluster-launcher tests share: the job every launcher runs, and "nothing left" checks.

The job is 3 workers and 2 servers; each worker checks the dist semantics numerically (the
script of ``jobs.formulas_script``, plus its own environment) and exits non-zero on a mismatch.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from .daemons import alive, find_processes
from .jobs import REPO, JobResult, formulas_script

WORKERS, SERVERS = 3, 2

FORMULAS = formulas_script(
    """\
import os
assert os.environ["DMLC_WORKER_ID"] == str(r), (os.environ["DMLC_WORKER_ID"], r)
env = [os.environ.get(k, "-") for k in ("ALL", "ONLY_W", "ONLY_S", "DMLC_ROLE", "RANK", "WORLD_SIZE")]
print("env", r, os.getcwd(), *env, flush=True)
import hashlib, subprocess
def secret_of(env):
    path = env.get("PSKV_SECRET_FILE")
    return env.get("PSKV_SECRET") or (open(path).read().strip() if path else "")
mine, holds = secret_of(os.environ), {}
for pid in filter(str.isdigit, os.listdir("/proc")):  # this job's roles (the marker), guards aside
    try:
        with open(f"/proc/{pid}/environ", "rb") as f, open(f"/proc/{pid}/cmdline", "rb") as g:
            penv, cmd = dict(v.split("=", 1) for v in f.read().decode(errors="replace").split(chr(0)) if "=" in v), g.read()
    except OSError:
        continue
    if penv.get("PSKV_TEST_MARKER") == os.environ.get("PSKV_TEST_MARKER") and penv.get("DMLC_ROLE") and b"pskv.launch.guard" not in cmd:
        holds.setdefault(penv["DMLC_ROLE"], set()).add(secret_of(penv) == mine)
listed = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
secret_line = [hashlib.sha256(mine.encode()).hexdigest()[:16], len(mine) >= 16, mine not in listed]
print("secret", r, *secret_line, *sorted(f"{k}={all(v)}" for k, v in holds.items()), flush=True)
"""
)

# worker 1 fails after a second; the others would run for two minutes
CRASH = """\
import os, sys, time
print("pid", os.getpid(), flush=True)
if os.environ["DMLC_WORKER_ID"] == "1":
    time.sleep(1)
    print("worker 1 gives up", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(120)
"""

# every worker sleeps until stopped
SLEEP = """\
import os, time
print("pid", os.getpid(), flush=True)
time.sleep(300)
"""


def write_project(directory: Path) -> Path:
    """A project directory holding the three job scripts (the launcher's working directory)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in (("formulas.py", FORMULAS), ("crash.py", CRASH), ("sleep.py", SLEEP)):
        (directory / name).write_text(text)
    return directory


def marker() -> dict[str, str]:
    """A variable unique to one test, given to every process of its job with --env."""
    return {"PSKV_TEST_MARKER": uuid.uuid4().hex}


def marker_args(mark: dict[str, str]) -> list[str]:
    return [a for k, v in mark.items() for a in ("--env", f"{k}:{v}")]


def formulas_args(python: str = sys.executable) -> list[str]:
    return ["--", python, "formulas.py", str(WORKERS), str(SERVERS)]


def env_args() -> list[str]:
    """--env for all, --env-worker, --env-server (PSKV_VERBOSE: servers then log their start)."""
    return ["--env", "ALL:a", "--env-worker", "ONLY_W:w", "--env-server", "ONLY_S:s", "--env-server", "PSKV_VERBOSE:1"]


def check_formulas(
    res: JobResult, host: Optional[Sequence[str]] = None, server_host: Optional[Sequence[str]] = None, scheduler_here: bool = True
) -> None:
    """Every worker passed, saw its environment, and only the servers got --env-server; every role
    of the job (with the marker) holds the worker's secret, which is in no ``ps`` line and no output.

    Output lines are tagged ``[worker 1]``, or ``[worker 1@HOST]`` with ``host[1]`` (ssh)."""
    assert res.code == 0, res
    for w in range(WORKERS):
        tag = f"[worker {w}@{host[w]}]" if host else f"[worker {w}]"
        assert f"{tag} rank {w}: formulas ok" in res.stdout, res
        env_line = next((line for line in res.stdout.splitlines() if line.startswith(f"{tag} env {w} ")), "")
        assert env_line.split()[-6:] == ["a", "w", "-", "worker", str(w), str(WORKERS)], res
    out = res.stdout + res.stderr
    seen = {tuple(line.split(" secret ", 1)[1].split()[1:]) for line in res.stdout.splitlines() if " secret " in line}
    roles = ("scheduler=True", "server=True", "worker=True") if scheduler_here else ("server=True", "worker=True")
    assert len(seen) == 1, res  # every worker holds the same secret ...
    digest, *checks = seen.pop()
    assert tuple(checks) == ("True", "True", *roles), res  # ... long enough, in no ps line, held by every role
    for token in re.findall(r"[0-9a-f]{64}", out):  # the secret pskv launch makes is 64 hex digits
        assert hashlib.sha256(token.encode()).hexdigest()[:16] != digest, "the job's secret is in the output"
    for s in range(SERVERS):
        tag = f"[server {s}@{server_host[s]}]" if server_host else f"[server {s}]"
        assert f"{tag} pskv server {s}: serving on tcp://" in out, res
    assert "pskv scheduler:" not in out and "pskv worker" not in out, res


def start_launcher(argv: list[str], cwd: Path, env: Optional[dict[str, str]] = None) -> subprocess.Popen[str]:
    """``pskv launch`` in a session of its own, its output piped (for tests that signal it)."""
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**(env if env is not None else os.environ), "PYTHONPATH": str(REPO)},
        cwd=cwd,
        start_new_session=True,
    )


def read_pids(launcher: subprocess.Popen[str], n: int) -> list[int]:
    """The pids that ``n`` job processes print ("pid N"), read from the launcher's output."""
    assert launcher.stdout is not None
    pids: list[int] = []
    deadline = time.monotonic() + 90
    while len(pids) < n and time.monotonic() < deadline:
        line = launcher.stdout.readline()
        if not line:
            break
        pids += pids_in(line)
    assert len(pids) == n, f"got {pids}; launcher status {launcher.poll()}"
    return pids


def pids_in(text: str) -> list[int]:
    return [int(line.split()[-1]) for line in text.splitlines() if " pid " in f" {line}"]


def wait_gone(
    mark: dict[str, str],
    pids: Sequence[int] = (),
    timeout: float = 20.0,
    cwd_under: Optional[Path] = None,
    cmdline_contains: Optional[str] = None,
) -> list[int]:
    """PIDs still alive after ``timeout``: processes with the marker, the listed ones, and those
    whose working directory is under ``cwd_under`` or whose command line holds ``cmdline_contains``."""
    deadline = time.monotonic() + timeout
    while True:
        left = set(find_processes(environ=mark)) | {p for p in pids if alive(p)}
        if cwd_under is not None:
            left |= set(find_processes(cwd_under=cwd_under))
        if cmdline_contains is not None:
            left |= set(find_processes(cmdline_contains=cmdline_contains))
        if not left or time.monotonic() > deadline:
            return sorted(left)
        time.sleep(0.2)
