"""The remote side of a launcher: run one role's command, and make sure it dies with the job.

::

    python -m pskv.launch.guard [--rank-from VAR[,VAR...]] [--rank-offset K] [--prefix TEMPLATE]
                                [--watch-stdin] [--workers-here N] [--status-dir DIR]
                                [--grace SECONDS] -- COMMAND [ARG...]

Every cluster launcher starts each server and worker through this wrapper (``ssh``, ``mpirun``,
``srun``, ``qsub``, YARN and Kubernetes containers alike). It

* sets ``DMLC_WORKER_ID`` or ``DMLC_SERVER_ID`` (by ``DMLC_ROLE``) from the first of the
  ``--rank-from`` variables that is set, minus ``--rank-offset`` (``OMPI_COMM_WORLD_RANK``,
  ``PMI_RANK``, ``SLURM_PROCID``, ``SGE_TASK_ID`` with offset 1, ``JOB_COMPLETION_INDEX``...;
  the last integer in the value counts, so ``worker-3`` gives 3), so ranks are deterministic;
  workers also get ``RANK`` and ``WORLD_SIZE``;
* runs COMMAND so that it can be stopped as a whole. When the guard leads its own session
  already (an ssh session, a Grid Engine job script), COMMAND stays in it: every process there
  is the job's, and a resource manager that kills the job's process group (``qdel``) reaches
  them all. Elsewhere (mpirun's and srun's tasks share groups with others) COMMAND gets a
  session of its own, and dies by SIGKILL if the guard is killed (Linux ``PR_SET_PDEATHSIG``);
* forwards SIGTERM, SIGINT and SIGHUP to COMMAND's process group, then SIGKILL after
  ``--grace`` seconds to every process of its session (also to what COMMAND leaves behind
  when it exits by itself);
* with ``--watch-stdin``, stops the group the same way when its standard input reaches EOF: the
  ssh launcher keeps the ssh client's stdin open, so when the launcher dies or stops the ssh
  client, the remote command dies too (COMMAND itself reads from /dev/null);
* with ``--prefix``, writes every line COMMAND prints as one write, prefixed ``[worker 3] ``
  (for mpirun, srun and qsub, whose output comes back merged);
* with ``--status-dir``, writes ``ROLE.RANK.status`` there holding the exit status at the end;
* exits with COMMAND's status (128 + N for signal N) and says so on stderr when it is not 0.

Standard library only and no torch import, so it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Optional

from .lines import pump

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class GuardError(Exception):
    """A bad invocation: the message says what is missing."""


def rank_from(environ: Mapping[str, str], names: Sequence[str], offset: int = 0) -> int:
    """The rank: the last integer in the first variable of ``names`` that is set, minus ``offset``."""
    for name in names:
        raw = environ.get(name, "").strip()
        if not raw:
            continue
        match = re.search(r"(\d+)\D*$", raw)
        if match is None:
            raise GuardError(f"{name}={raw!r} holds no rank number")
        rank = int(match.group(1)) - offset
        if rank < 0:
            raise GuardError(f"{name}={raw} minus offset {offset} is a negative rank")
        return rank
    raise GuardError(f"none of {', '.join(names)} is set, so this process has no rank")


def child_env(
    environ: Mapping[str, str],
    rank_vars: Sequence[str] = (),
    rank_offset: int = 0,
    workers_here: Optional[int] = None,
    cpus: Optional[int] = None,
) -> tuple[dict[str, str], Optional[int]]:
    """The environment COMMAND runs with, and its rank (None when neither given nor derived)."""
    env = dict(environ)
    role = env.get("DMLC_ROLE", "")
    rank: Optional[int] = None
    if rank_vars:
        rank = rank_from(env, rank_vars, rank_offset)
        if role == "worker":
            env["DMLC_WORKER_ID"] = env["RANK"] = str(rank)
            if env.get("DMLC_NUM_WORKER"):
                env.setdefault("WORLD_SIZE", env["DMLC_NUM_WORKER"])
        elif role == "server":
            env["DMLC_SERVER_ID"] = str(rank)
    elif role == "worker" and env.get("DMLC_WORKER_ID"):
        rank = int(env["DMLC_WORKER_ID"])
    elif role == "server" and env.get("DMLC_SERVER_ID"):
        rank = int(env["DMLC_SERVER_ID"])
    if workers_here and role == "worker" and not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(max(1, (cpus or os.cpu_count() or 1) // workers_here))
    return env, rank


def session_members(sid: int) -> list[int]:
    """Live processes of session ``sid`` (Linux /proc), the caller excluded."""
    out: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # state ppid pgrp session ...
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(entry))
    return out


def _die_with_parent() -> None:
    """In the child: a new session, and SIGKILL when the guard dies (Linux)."""
    os.setsid()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Guard:
    """One guarded command."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], name: str, prefix: Optional[str], grace: float):
        self.argv = list(argv)
        self.env = dict(env)
        self.name = name
        self.prefix = prefix
        self.grace = grace
        self.stop_reason: Optional[str] = None
        self.stop_signal = signal.SIGTERM
        self._stop = threading.Event()
        self._write_lock = threading.Lock()
        self.popen: Optional[subprocess.Popen[bytes]] = None
        # a session leader (ssh session, SGE job) keeps the command in its own session: every
        # process there is ours, and a resource manager that kills the session's group reaches
        # them all; anywhere else (mpirun, srun tasks share groups) the command gets a new one
        self.own_session = os.getsid(0) == os.getpid()

    # -- output ----------------------------------------------------------------------------------

    def say(self, text: str, named: bool = True) -> None:
        name = f"{self.name}: " if named and not self.prefix else ""
        line = f"{self.prefix or ''}pskv guard: {name}{text}\n"
        with self._write_lock, contextlib.suppress(OSError):
            os.write(2, line.encode(errors="replace"))

    def _write(self, fd: int, lines: list[bytes]) -> None:
        tag = (self.prefix or "").encode()
        for line in lines:
            with self._write_lock, contextlib.suppress(OSError):
                os.write(fd, tag + line)

    # -- stopping --------------------------------------------------------------------------------

    def request_stop(self, reason: str, sig: int = signal.SIGTERM) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            self.stop_signal = signal.Signals(sig)
            self._stop.set()

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.popen is not None and self.own_session and self._stop.is_set():
            return  # our own group signal coming back to us
        self.request_stop(f"got {signal.Signals(signum).name}", signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    def _watch_stdin(self) -> None:
        while True:
            try:
                data = os.read(0, 65536)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                self.request_stop("standard input closed (the launcher stopped the job, or is gone)")
                return

    def _session(self) -> int:
        assert self.popen is not None
        return os.getpid() if self.own_session else self.popen.pid

    def _signal_group(self, sig: int) -> None:
        """Signal the command's process group; SIGKILL goes to every process of its session."""
        assert self.popen is not None
        if sig == signal.SIGKILL:
            for pid in session_members(self._session()) or [self.popen.pid]:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            return
        with contextlib.suppress(OSError):
            # in our own session this reaches us too; we ignore it while stopping
            os.killpg(os.getpgrp() if self.own_session else self.popen.pid, sig)

    def _stop_child(self) -> None:
        assert self.popen is not None
        self._signal_group(self.stop_signal)
        deadline = time.monotonic() + self.grace
        while self.popen.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.popen.poll() is None:
            self.say(f"still running {self.grace:g} s after {self.stop_signal.name}; sending SIGKILL")
        self._signal_group(signal.SIGKILL)  # also whatever the command left behind in its group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)

    # -- running ---------------------------------------------------------------------------------

    def run(self, watch_stdin: bool = False, status_path: Optional[str] = None) -> int:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        pass_fds: tuple[int, ...] = ()
        port_fd = self.env.get("PSKV_PORT_FD", "")
        if port_fd.isdigit():  # the scheduler reports its port through us
            pass_fds = (int(port_fd),)
        out = subprocess.PIPE if self.prefix else None
        try:
            self.popen = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                pass_fds=pass_fds,
                preexec_fn=None if self.own_session else _die_with_parent,
            )
        except OSError as exc:
            self.say(f"{self.name} failed: cannot start {self.argv[0]}: {exc.strerror or exc} (exited with status 127)", named=False)
            self._write_status(status_path, 127)
            return 127
        finally:
            for fd in pass_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        pumps: list[threading.Thread] = []
        if self.prefix:
            assert self.popen.stdout is not None and self.popen.stderr is not None
            for pipe, fd in ((self.popen.stdout, 1), (self.popen.stderr, 2)):
                t = threading.Thread(target=pump, args=(pipe, functools.partial(self._write, fd)), daemon=True)
                t.start()
                pumps.append(t)
        if watch_stdin:
            threading.Thread(target=self._watch_stdin, daemon=True).start()
        while self.popen.poll() is None:
            if self._stop.wait(0.1):
                self._stop_child()
                break
        code = self.popen.wait()
        if self.stop_reason is None and session_members(self._session()):
            self._signal_group(signal.SIGKILL)  # what the command left behind
        for t in pumps:
            t.join(timeout=5)
        status = 128 - code if code < 0 else code
        if self.stop_reason is not None:
            self.say(f"{self.stop_reason}; stopped the command (status {status})")
        elif status != 0:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            command = " ".join(self.argv)[:200]
            self.say(f"{self.name} failed: {command} {how} on host {socket.gethostname()} (pid {self.popen.pid})", named=False)
        self._write_status(status_path, status)
        return status

    def _write_status(self, path: Optional[str], status: int) -> None:
        if path:
            with contextlib.suppress(OSError), open(path, "w") as f:
                f.write(f"{status}\n")


def guard_argv(
    python: str,
    *,
    rank_from: Sequence[str] = (),
    rank_offset: int = 0,
    prefix: Optional[str] = None,
    watch_stdin: bool = False,
    workers_here: int = 0,
    status_dir: Optional[str] = None,
    grace: Optional[float] = None,
) -> list[str]:
    """``python -m pskv.launch.guard [options]``, for a launcher (the command and its ``--`` follow)."""
    argv = [python, "-m", "pskv.launch.guard"]
    argv += ["--rank-from", ",".join(rank_from)] if rank_from else []
    argv += ["--rank-offset", str(rank_offset)] if rank_offset else []
    argv += ["--prefix", prefix] if prefix else []
    argv += ["--watch-stdin"] if watch_stdin else []
    argv += ["--workers-here", str(workers_here)] if workers_here else []
    argv += ["--status-dir", status_dir] if status_dir else []
    return argv + (["--grace", f"{grace:g}"] if grace is not None else [])


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pskv.launch.guard",
        description="Run one server or worker of a pskv job: rank from the cluster's variables, "
        "signals forwarded, stopped when stdin closes (--watch-stdin).",
    )
    p.add_argument("--rank-from", default="", metavar="VAR[,VAR...]", help="take the rank from the first of these variables that is set")
    p.add_argument("--rank-offset", type=int, default=0, metavar="K", help="subtract K from that value (1 for SGE_TASK_ID)")
    p.add_argument("--prefix", metavar="TEMPLATE", help="prefix every output line with [TEMPLATE] ({role}, {rank}, {host} are filled in)")
    p.add_argument("--watch-stdin", action="store_true", help="stop the command when standard input reaches EOF")
    p.add_argument("--workers-here", type=int, metavar="N", help="N workers share this host: OMP_NUM_THREADS = cores / N unless set")
    p.add_argument("--status-dir", metavar="DIR", help="write ROLE.RANK.status with the exit status there")
    p.add_argument("--grace", type=float, default=5.0, metavar="SECONDS", help="SIGKILL this long after SIGTERM (default 5)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command (after --)")
    args = p.parse_args(list(argv))
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("no command to run (python -m pskv.launch.guard [options] -- COMMAND ...)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    role = os.environ.get("DMLC_ROLE", "process")
    try:
        names = [n.strip() for n in args.rank_from.split(",") if n.strip()]
        env, rank = child_env(os.environ, names, args.rank_offset, args.workers_here)
    except GuardError as exc:
        print(f"pskv guard: {exc}", file=sys.stderr, flush=True)
        return 2
    shown = "?" if rank is None else str(rank)
    name = f"{role} {shown}" if role in ("server", "worker") else role
    prefix = None
    if args.prefix:
        prefix = "[" + args.prefix.format(role=role, rank=shown, host=socket.gethostname()) + "] "
    status_path = os.path.join(args.status_dir, f"{role}.{shown}.status") if args.status_dir else None
    return Guard(args.command, env, name, prefix, args.grace).run(args.watch_stdin, status_path)


if __name__ == "__main__":
    sys.exit(main())
