"""Run real jobs through ``pskv launch`` with a hard timeout, and show their output on failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]


@dataclass
class JobResult:
    code: int
    stdout: str
    stderr: str
    seconds: float

    def __repr__(self) -> str:
        return f"exit {self.code} after {self.seconds:.1f} s\n--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"


def run(
    argv: Sequence[str],
    timeout: float = 180,
    env: Optional[dict[str, str]] = None,
    cwd: Optional[Path] = None,
) -> JobResult:
    """Run ``argv`` in a session of its own; on timeout SIGTERM it (the launcher stops its job), then SIGKILL."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    start = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout} s\n--- stdout ---\n{out}\n--- stderr ---\n{err}"
        ) from None
    return JobResult(proc.returncode, out, err, time.monotonic() - start)


def launch(
    tmp: Path,
    script: str,
    workers: int,
    servers: int,
    args: Sequence[str] = (),
    env: Optional[dict[str, str]] = None,
    timeout: float = 180,
    launch_args: Sequence[str] = (),
) -> JobResult:
    """Write ``script`` to ``tmp`` and run it as the workers of ``pskv launch -n W -s S``."""
    path = tmp / "job.py"
    path.write_text(textwrap.dedent(script))
    argv = [
        sys.executable,
        "-m",
        "pskv",
        "launch",
        "-n",
        str(workers),
        "-s",
        str(servers),
        *launch_args,
        "--",
        sys.executable,
        str(path),
        *args,
    ]
    return run(argv, timeout=timeout, env=env, cwd=tmp)
