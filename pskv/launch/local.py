"""``pskv launch --launcher local``: the whole job on this machine.

One scheduler (``pskv serve``), S servers (``pskv serve``) and W workers running COMMAND, each
with the ``DMLC_*`` environment of SPEC.md section 8. The scheduler binds a free port itself and
reports it through a pipe, so no port is ever guessed. Workers also get the variables
``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) so
code written for ``torch.distributed`` runs under ``pskv launch`` too.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Optional

from .. import config
from ..errors import LaunchError
from .process import Proc, ProcessContext

SERVE = (sys.executable, "-m", "pskv", "serve")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for ``MASTER_PORT`` only; pskv's own ports never guess)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def worker_threads(num_workers: int) -> str:
    """``OMP_NUM_THREADS`` for workers sharing this machine: its cores divided among them."""
    return str(max(1, (os.cpu_count() or 1) // max(1, num_workers)))


def start_scheduler(
    ctx: ProcessContext,
    env: Mapping[str, str],
    timeout: float,
    show: str = "prefix",
    argv: Sequence[str] = SERVE,
    stdin: str = "devnull",
) -> tuple[Proc, int]:
    """Start the scheduler on a port of its choosing; the process and that port.

    ``argv`` runs ``pskv serve`` (the cluster launchers wrap it in ``pskv.launch.guard``,
    which passes the port pipe on); ``stdin`` as for :meth:`ProcessContext.start`.
    """
    read_fd, write_fd = os.pipe()
    try:
        proc = ctx.start(
            "scheduler",
            "scheduler",
            argv,
            {**env, "DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_PORT": "0", "PSKV_PORT_FD": str(write_fd)},
            pass_fds=(write_fd,),
            show=show,
            stdin=stdin,
        )
    finally:
        os.close(write_fd)
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"the scheduler did not report its port within {timeout:g} s")
            ready, _, _ = select.select([read_fd], [], [], min(left, 0.2))
            if ready:
                chunk = os.read(read_fd, 64)
                if not chunk:  # it closed the pipe without a port: it failed to start
                    proc.popen.wait(timeout=5)
                    raise LaunchError(f"the scheduler exited with status {proc.returncode} before reporting its port")
                data += chunk
    finally:
        os.close(read_fd)
    return proc, int(data.strip())


def job_env(base: Mapping[str, str], num_workers: int, num_servers: int, host: str) -> dict[str, str]:
    """The environment every process of a job shares."""
    env = dict(base)
    env.update(
        {
            "DMLC_PS_ROOT_URI": host,
            "DMLC_NUM_WORKER": str(num_workers),
            "DMLC_NUM_SERVER": str(num_servers),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def role_env(env: Mapping[str, str], role: str, rank: int, num_workers: int, master_port: int) -> dict[str, str]:
    """The environment of one process: its role, id and (for workers) the torchrun variables."""
    out = dict(env)
    out["DMLC_ROLE"] = role
    if role == "server":
        out["DMLC_SERVER_ID"] = str(rank)
    if role == "worker":
        out["DMLC_WORKER_ID"] = str(rank)
        out.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(num_workers),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(num_workers),
                "MASTER_ADDR": out["DMLC_PS_ROOT_URI"],
                "MASTER_PORT": str(master_port),
            }
        )
        out.setdefault("OMP_NUM_THREADS", worker_threads(num_workers))
    return out


def command_argv(command: Sequence[str]) -> list[str]:
    """A single string with spaces runs through the shell, as MXNet's launcher did."""
    if len(command) == 1 and " " in command[0]:
        return ["/bin/sh", "-c", command[0]]
    return list(command)


def launch_local(
    num_workers: int,
    num_servers: int,
    command: Sequence[str],
    extra_env: Optional[Mapping[str, str]] = None,
    role_extra: Optional[Mapping[str, Mapping[str, str]]] = None,
    timeout: Optional[float] = None,
    quiet: bool = False,
    peak_rss_mb: Optional[dict[str, float]] = None,
) -> int:
    """Run the job on this machine; the exit status (0 when every worker succeeded).

    ``quiet``: show worker 0's output as it is and keep the others' for the failure report
    (what ``pskv train`` started by hand does); otherwise every line is shown, prefixed.
    ``peak_rss_mb``, if given, receives every process's peak resident memory by name.
    """
    if num_workers < 1 or num_servers < 0:
        raise LaunchError(f"need at least one worker and no negative server count, got -n {num_workers} -s {num_servers}")
    if not command:
        raise LaunchError("no command to run: pskv launch -n 2 -s 2 -- python train.py")
    role_extra = role_extra or {}
    env = job_env({**os.environ, **(extra_env or {})}, num_workers, num_servers, "127.0.0.1")
    ctx = ProcessContext()
    stop = _StopOnSignal(ctx)
    try:
        helpers: list[Proc] = []
        if num_servers:
            sched, port = start_scheduler(ctx, env, config.start_timeout(), show="tail" if quiet else "prefix")
            env["DMLC_PS_ROOT_PORT"] = str(port)
            helpers.append(sched)
            for s in range(num_servers):
                senv = {**role_env(env, "server", s, num_workers, 0), **role_extra.get("server", {})}
                helpers.append(ctx.start(f"server {s}", "server", SERVE, senv, show="tail" if quiet else "prefix"))
        master = free_port()
        argv = command_argv(command)
        workers = [
            ctx.start(
                f"worker {w}",
                "worker",
                argv,
                {**role_env(env, "worker", w, num_workers, master), **role_extra.get("worker", {})},
                show=("raw" if w == 0 else "tail") if quiet else "prefix",
            )
            for w in range(num_workers)
        ]
        status = ctx.wait(workers, helpers, finish_timeout=max(30.0, config.heartbeat_timeout() * 2), timeout=timeout)
        if peak_rss_mb is not None:
            peak_rss_mb.update({p.name: p.peak_rss_mb for p in ctx.procs})
        return status
    except LaunchError:
        ctx.stop_all()
        raise
    except FileNotFoundError as exc:
        ctx.stop_all()
        raise LaunchError(f"cannot start {exc.filename}: {exc.strerror}") from None
    finally:
        stop.restore()


class _StopOnSignal:  # also used by the cluster launchers (common.supervise)
    """Ctrl-C or SIGTERM to the launcher stops the whole job."""

    def __init__(self, ctx: ProcessContext):
        self.ctx = ctx
        self.old = {}
        if threading.current_thread() is threading.main_thread():
            self.old = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self.ctx.report(f"got {signal.Signals(signum).name}; stopping the job")
        self.ctx.stop_all()
        self.restore()
        raise SystemExit(128 + signum)

    def restore(self) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)
