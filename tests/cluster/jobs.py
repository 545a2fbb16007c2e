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


_FORMULAS_JOIN = """\
import sys, torch, pskv
kv = pskv.kv.create("dist_sync")
W, r = kv.num_workers, kv.rank
assert W == int(sys.argv[1]) and kv.num_servers == int(sys.argv[2]), (W, kv.num_servers)
"""

_FORMULAS_CHECKS = """\
tri = W * (W + 1) / 2
shapes = {"small": (5, 3), "even": (1200, 1200), "odd": (1211, 1211)}
# no optimizer: the merged sum replaces the value
for name, shape in shapes.items():
    kv.init(name, torch.ones(shape))
    grad = torch.full(shape, r + 1.0)
    out = torch.empty(shape)
    for i in range(2):
        kv.push(name, grad)
        kv.pull(name, out)
        assert torch.all(out == tri), (name, i, out.flatten()[:4])
        assert torch.all(grad == r + 1.0), "the pushed tensor was modified (MXNet's doubling bug)"
# server-side sgd: after round i every worker pulls 1 - lr*rescale*W(W+1)/2*(i+1)
kv.set_optimizer(pskv.optim.create("sgd", learning_rate=0.1, rescale_grad=0.5))
for name, shape in shapes.items():
    key = "opt-" + name
    kv.init(key, torch.ones(shape))
    grad = torch.full(shape, r + 1.0)
    out = torch.empty(shape)
    for i in range(3):
        kv.pushpull(key, grad, out=out)
        want = 1 - 0.1 * 0.5 * tri * (i + 1)
        assert torch.allclose(out, torch.full(shape, want)), (key, i, out.flatten()[:4], want)
# device lists are summed before they leave the worker
kv.init("dev", torch.zeros(4, 4))
kv.push("dev", [torch.ones(4, 4)] * 3)
out = [torch.empty(4, 4), torch.empty(4, 4)]
kv.pull("dev", out)
assert all(torch.allclose(o, torch.full((4, 4), -0.05 * 3 * W)) for o in out)
print(f"rank {r}: formulas ok", flush=True)
kv.close()
"""


def formulas_script(after_join: str = "") -> str:
    """A worker script that checks SPEC.md section 3's formulas itself and exits non-zero on a
    mismatch: sums with and without server-side sgd for small, 1200x1200 and 1211x1211 arrays,
    the pushed tensor left unchanged, device lists. Its arguments are W and S; ``after_join``
    runs once the store is joined (names ``kv``, ``W``, ``r``)."""
    return _FORMULAS_JOIN + after_join + _FORMULAS_CHECKS
