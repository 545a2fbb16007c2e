"""The wrapper of every server and worker that a cluster launcher starts, and of the scheduler
that ``pskv launch`` runs here (docs/launchers/README.md, "pskv.launch.guard"). Standard library
only, so it starts fast; the launcher shares its line pump, :func:`terminate` and :func:`exit_status`."""

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
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import IO, Optional

ID_VARS = {"server": "DMLC_SERVER_ID", "worker": "DMLC_WORKER_ID"}
Stop = Callable[[subprocess.Popen[bytes]], None]  # how terminate() signals one process


class LineBuffer:
    """Bytes in, whole lines out, so that lines of different processes never mix. A line ends with
    ``\\n``, ``\\r\\n`` or ``\\r`` (progress bars) and keeps its ending; a partial line waits."""

    def __init__(self) -> None:
        self.rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        lines = (self.rest + chunk).splitlines(keepends=True)
        self.rest = lines.pop() if lines and not lines[-1].endswith((b"\n", b"\r")) else b""
        return lines

    def end(self) -> list[bytes]:
        """The partial line left at the end of the stream, with ``\\n`` added (or none)."""
        rest, self.rest = self.rest, b""
        return [rest + b"\n"] if rest else []


def pump(pipe: IO[bytes], emit: Callable[[list[bytes]], None]) -> threading.Thread:
    """A started thread that hands each batch of whole lines read from ``pipe`` to ``emit`` until
    EOF, then closes it."""

    def run() -> None:
        buffer = LineBuffer()
        with pipe:
            for chunk in iter(functools.partial(os.read, pipe.fileno(), 65536), b""):
                emit(buffer.feed(chunk))
            emit(buffer.end())

    thread = threading.Thread(target=run, daemon=True, name="pskv-pump")
    thread.start()
    return thread


class GuardError(Exception):
    """A bad invocation: the message says what is missing."""


def rank_from(environ: Mapping[str, str], names: Sequence[str], offset: int = 0) -> int:
    """The last integer in the first variable of ``names`` that is set, minus ``offset``."""
    for name in names:
        if not (raw := environ.get(name, "").strip()):
            continue
        if (match := re.search(r"(\d+)\D*$", raw)) is None:
            raise GuardError(f"{name}={raw!r} holds no rank number")
        if int(match.group(1)) < offset:
            raise GuardError(f"{name}={raw} minus offset {offset} is a negative rank")
        return int(match.group(1)) - offset
    raise GuardError(f"none of {', '.join(names)} is set, so this process has no rank")


def child_env(
    environ: Mapping[str, str], rank_vars: Sequence[str] = (), rank_offset: int = 0, workers_here: int = 0
) -> dict[str, str]:
    """COMMAND's environment: the rank from ``rank_vars`` as ``DMLC_SERVER_ID`` / ``DMLC_WORKER_ID``
    (and ``RANK``, ``WORLD_SIZE`` for a worker); ``OMP_NUM_THREADS`` = cores / ``workers_here``
    for a worker, unless set."""
    env = dict(environ)
    role = env.get("DMLC_ROLE", "")
    if rank_vars:
        rank = str(rank_from(env, rank_vars, rank_offset))
        if role in ID_VARS:
            env[ID_VARS[role]] = rank
        if role == "worker":
            env["RANK"] = rank
            if env.get("DMLC_NUM_WORKER"):
                env.setdefault("WORLD_SIZE", env["DMLC_NUM_WORKER"])
    if workers_here and role == "worker" and not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers_here))
    return env


def exit_status(code: int) -> int:
    """A shell's exit status for a ``Popen`` return code: 128 + N for signal N."""
    return 128 - code if code < 0 else code


def terminate(popens: Sequence[subprocess.Popen[bytes]], term: Stop, kill: Stop, grace: float) -> None:
    """Stop processes: ``term`` each, then ``kill`` those still running after ``grace`` seconds."""
    for p in popens:
        term(p)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in popens) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in popens:
        if p.poll() is None:
            kill(p)
    for p in popens:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def die_with_parent(sig: int) -> Callable[[], None]:
    """A ``preexec_fn``: a new session, and signal ``sig`` when the thread that started the child dies,
    even by SIGKILL (Linux ``PR_SET_PDEATHSIG``). Looked up here: a child forked beside threads imports nothing."""
    import ctypes

    prctl, parent = getattr(ctypes.CDLL(None, use_errno=True), "prctl", lambda *_: 0), os.getpid()  # (not Linux: the session only)

    def preexec() -> None:
        os.setsid()
        if prctl(1, sig) == 0 and os.getppid() != parent:  # the parent died before prctl
            os.kill(os.getpid(), sig)

    return preexec


class Guard:
    """One guarded command."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], name: str, prefix: str, grace: float):
        self.argv, self.env, self.name, self.prefix, self.grace = list(argv), dict(env), name, prefix, grace
        self.stop_reason, self.stop_signal = "", signal.SIGTERM  # a reason: stop COMMAND with that signal
        self.lock = threading.Lock()
        # a session leader (ssh, Grid Engine) keeps COMMAND in its session; elsewhere it gets its own
        self.own_session = os.getsid(0) == os.getpid()

    def say(self, text: str, named: bool = True) -> None:
        name = f"{self.name}: " if named and not self.prefix else ""
        self._write(2, [f"pskv guard: {name}{text}\n".encode(errors="replace")])

    def _write(self, fd: int, lines: list[bytes]) -> None:
        for line in lines:
            with self.lock, contextlib.suppress(OSError):
                os.write(fd, self.prefix.encode() + line)

    def request_stop(self, reason: str, sig: signal.Signals = signal.SIGTERM) -> None:
        if not self.stop_reason:  # also ignores our own group signal coming back to us
            self.stop_reason, self.stop_signal = reason, sig

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        sig = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
        self.request_stop(f"got {signal.Signals(signum).name}", sig)

    def _watch_stdin(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 65536):
                pass
        self.request_stop("standard input closed (the launcher stopped the job, or is gone)")

    def _signal_group(self, popen: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp() if self.own_session else popen.pid, self.stop_signal)

    def _kill_session(self, popen: subprocess.Popen[bytes]) -> None:
        """SIGKILL to every process of COMMAND's session but the guard (Linux ``/proc``)."""
        session = os.getsid(0) if self.own_session else popen.pid
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                with contextlib.suppress(OSError):
                    if os.getsid(int(entry)) == session:
                        os.kill(int(entry), signal.SIGKILL)

    def _kill_late(self, popen: subprocess.Popen[bytes]) -> None:
        self.say(f"still running {self.grace:g} s after {self.stop_signal.name}; sending SIGKILL")
        self._kill_session(popen)

    def run(self, watch_stdin: bool = False) -> int:
        """Run COMMAND to the end; its exit status."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        port_fd = self.env.get("PSKV_PORT_FD", "")
        pass_fds = (int(port_fd),) if port_fd.isdigit() else ()  # the scheduler reports its port through us
        out = subprocess.PIPE if self.prefix else None
        try:
            popen = subprocess.Popen(
                self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, pass_fds=pass_fds,
                preexec_fn=None if self.own_session else die_with_parent(signal.SIGKILL),
            )  # fmt: skip
        except OSError as exc:
            self.say(f"{self.name} failed: cannot start {self.argv[0]}: {exc.strerror or exc} (exited with status 127)", named=False)
            return 127
        finally:
            for fd in pass_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        pumps = [pump(p, functools.partial(self._write, fd)) for p, fd in ((popen.stdout, 1), (popen.stderr, 2)) if p is not None]  # piped with --prefix only
        if watch_stdin:
            threading.Thread(target=self._watch_stdin, daemon=True).start()
        while popen.poll() is None and not self.stop_reason:
            time.sleep(0.1)
        if popen.poll() is None:
            terminate([popen], self._signal_group, self._kill_late, self.grace)
        code = popen.wait()
        self._kill_session(popen)  # whatever COMMAND left behind
        for t in pumps:
            t.join(timeout=5)
        status = exit_status(code)
        if self.stop_reason:
            self.say(f"{self.stop_reason}; stopped the command (status {status})")
        elif status != 0:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            where = f"on host {socket.gethostname()} (pid {popen.pid})"
            self.say(f"{self.name} failed: {' '.join(self.argv)[:200]} {how} {where}", named=False)
        return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pskv.launch.guard",
        description="Run one server or worker of a pskv job: rank from the cluster's variables, "
        "signals forwarded, stopped when stdin closes (--watch-stdin).",
    )
    p.add_argument("--rank-from", default="", metavar="VAR[,VAR...]", help="take the rank from the first of these variables that is set")
    p.add_argument("--rank-offset", type=int, default=0, metavar="K", help="subtract K from that value (1 for SGE_TASK_ID)")
    p.add_argument("--prefix", default="", metavar="TEMPLATE", help="prefix every output line with [TEMPLATE] ({role}, {rank}, {host} are filled in)")
    p.add_argument("--watch-stdin", action="store_true", help="stop the command when standard input reaches EOF")
    p.add_argument("--secret-stdin", action="store_true", help="the first line of standard input is the job's secret (PSKV_SECRET for the command)")
    p.add_argument("--workers-here", type=int, default=0, metavar="N", help="N workers share this host: OMP_NUM_THREADS = cores / N unless set")
    p.add_argument("--say-finished", action="store_true", help="say when the command exited 0, on stdout and stderr (mpi: mpirun ends only with the servers)")
    p.add_argument("--status-dir", metavar="DIR", help="write ROLE.RANK.status with the exit status there")
    p.add_argument("--grace", type=float, default=5.0, metavar="SECONDS", help="SIGKILL this long after SIGTERM (default 5)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command (after --)")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command to run (python -m pskv.launch.guard [options] -- COMMAND ...)")
    role = os.environ.get("DMLC_ROLE", "process")
    try:
        names = [n.strip() for n in args.rank_from.split(",") if n.strip()]
        env = child_env(os.environ, names, args.rank_offset, args.workers_here)
        if args.secret_stdin:  # the launcher writes nothing after it: the rest of stdin is only watched for EOF
            line = sys.stdin.buffer.readline()
            if not line.endswith(b"\n"):
                raise GuardError("--secret-stdin: standard input ended before the secret's line")
            env["PSKV_SECRET"] = line.decode().strip()
    except GuardError as exc:
        print(f"pskv guard: {exc}", file=sys.stderr, flush=True)
        return 2
    rank = env.get(ID_VARS.get(role, ""), "?")
    name = f"{role} {rank}" if role in ID_VARS else role
    prefix = "[" + args.prefix.format(role=role, rank=rank, host=socket.gethostname()) + "] " if args.prefix else ""
    guard = Guard(command, env, name, prefix, args.grace)
    for fd in (1, 2) if (status := guard.run(args.watch_stdin)) == 0 and args.say_finished else ():  # after its output, on both
        guard._write(fd, [f"pskv guard: {name} finished\n".encode()])
    if args.status_dir:
        with contextlib.suppress(OSError), open(os.path.join(args.status_dir, f"{role}.{rank}.status"), "w") as f:
            f.write(f"{status}\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
