"""The job's processes on this machine: the roles themselves, or the ``ssh``/``srun``/``mpirun``
clients standing for them. :class:`ProcessContext` starts each in a process group of its own,
streams its output line by line (``[worker 0] ...``), and when one fails stops all the others.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Literal, Optional, Protocol

from .guard import exit_status, terminate
from .lines import pump

Show = Literal["prefix", "raw", "tail"]
Stdin = Literal["devnull", "pipe"]
#: what a guard writes when its command fails ("pskv guard: worker 1 failed: ..."); a launcher whose
#: one client stands for many processes (mpirun, srun) quotes it and takes its status
GUARD_FAILURE = ("pskv guard: ", " failed: ")


class Watched(Protocol):
    """What :meth:`ProcessContext.wait` needs of a process, here or elsewhere (a Grid Engine task)."""

    @property
    def name(self) -> str: ...

    @property
    def tail(self) -> list[str]: ...

    @property
    def returncode(self) -> Optional[int]: ...


@dataclass
class Proc:
    """A process started here."""

    name: str  # "scheduler", "worker 0", "mpirun", ...
    popen: subprocess.Popen[bytes]
    readers: list[threading.Thread] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)  # its last lines, for the failure report
    failure: str = ""  # the first guard failure line among them
    peak_rss_mb: float = 0.0  # the largest resident size seen (Linux VmHWM), sampled while it runs

    @property
    def returncode(self) -> Optional[int]:
        return self.popen.poll()

    def sample(self) -> None:
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{self.popen.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    self.peak_rss_mb = max(self.peak_rss_mb, int(line.split()[1]) / 1024)


def failure_status(line: str) -> int:
    """The exit status that a guard's failure line reports (1 if none)."""
    found = re.findall(r"(exited with status|was killed by signal) (\d+)", line)
    if not found:
        return 1
    how, number = found[-1]
    return int(number) + (128 if how.startswith("was killed") else 0)


def describe_exit(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


class ProcessContext:
    """Start, watch and stop a job's processes; one launcher thread drives it."""

    TAIL = 20

    def __init__(self, grace: float = 5.0):
        self.grace = grace
        self.procs: list[Proc] = []
        self.on_stop: Optional[Callable[[], None]] = None  # run once when the job stops early: cancel cluster jobs
        self._lock = threading.Lock()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        pass_fds: Sequence[int] = (),
        show: Show = "prefix",
        stdin: Stdin = "devnull",
    ) -> Proc:
        """Start ``argv`` with ``env`` in a new process group.

        ``show``: ``"prefix"`` streams its output as ``[name] ...`` lines, ``"raw"`` as it is,
        ``"tail"`` only keeps the last lines for a failure report. ``stdin="pipe"``: a pipe that is
        never written and closes when the job stops or this process dies (an ssh client passes
        that EOF on to the remote guard).
        """
        popen = subprocess.Popen(
            list(argv), env=dict(env), stdin=subprocess.PIPE if stdin == "pipe" else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, pass_fds=tuple(pass_fds),
        )  # fmt: skip
        proc = Proc(name, popen)
        for pipe, sink in ((popen.stdout, sys.stdout), (popen.stderr, sys.stderr)):
            emit = functools.partial(self._emit, proc, sink, show)
            proc.readers.append(threading.Thread(target=pump, args=(pipe, emit), daemon=True, name=f"pskv-out-{name}"))
            proc.readers[-1].start()
        self.procs.append(proc)
        return proc

    def _emit(self, proc: Proc, sink: IO[str], show: Show, raw: list[bytes]) -> None:
        lines = [line.decode(errors="replace") for line in raw]
        with self._lock:
            if not proc.failure:
                proc.failure = next((line.strip() for line in lines if all(part in line for part in GUARD_FAILURE)), "")
            proc.tail = [*proc.tail, *(line.rstrip("\r\n") for line in lines if line.strip())][-self.TAIL :]
            if show != "tail":
                tag = f"[{proc.name}] " if show == "prefix" else ""
                with contextlib.suppress(OSError, ValueError):
                    sink.write("".join(tag + line for line in lines))
                    sink.flush()

    def wait(
        self, main: Sequence[Watched], helpers: Sequence[Watched], finish_timeout: float = 60.0, timeout: Optional[float] = None
    ) -> int:
        """Wait for the job; the launcher's exit status.

        The job succeeds when every ``main`` process (the workers) exits 0 and every helper
        (scheduler, servers) then exits by itself within ``finish_timeout``. The first process to
        fail stops all others, and its status is returned; ``timeout`` stops the job with 124.
        """
        watched = [*self.procs, *(p for p in (*main, *helpers) if not isinstance(p, Proc))]
        started = time.monotonic()
        finished_at: Optional[float] = None
        next_sample = 0.0
        while True:
            if time.monotonic() >= next_sample:
                for proc in self.procs:
                    proc.sample()
                next_sample = time.monotonic() + 0.25
            failed = next((p for p in watched if p.returncode not in (None, 0)), None)
            if failed is not None and failed.returncode is not None:
                code = failed.returncode
                self.stop_all()
                first = getattr(failed, "failure", "")
                cause = f" ({first})" if first else ""
                self.report(f"{failed.name} {describe_exit(code)}{cause}; stopped the other processes of the job", failed)
                return failure_status(first) if first else exit_status(code)
            if finished_at is None and all(p.returncode == 0 for p in main):
                finished_at = time.monotonic()
            alive = [p.name for p in helpers if p.returncode is None]
            if finished_at is not None and not alive:
                self._drain()
                return 0
            if finished_at is not None and time.monotonic() - finished_at > finish_timeout:
                self.stop_all()
                self.report(f"the workers finished but {', '.join(alive)} did not exit within {finish_timeout:g} s; stopped them")
                return 1
            if timeout is not None and time.monotonic() - started > timeout:
                self.stop_all()
                self.report(f"the job ran past its time limit of {timeout:g} s; stopped it")
                return 124
            time.sleep(0.05)

    def stop_all(self) -> None:
        """Stop every process still running: EOF on its stdin pipe if it has one, else SIGTERM to
        its group; SIGKILL after ``grace`` seconds. :attr:`on_stop` runs first, once."""
        on_stop, self.on_stop = self.on_stop, None
        if on_stop is not None:
            try:
                on_stop()
            except Exception as exc:  # stopping the rest matters more
                self.report(f"while stopping: {exc}")
        running = [p.popen for p in self.procs if p.returncode is None]
        terminate(running, self._end, functools.partial(self._signal, sig=signal.SIGKILL), self.grace)
        self._drain()

    @staticmethod
    def _signal(popen: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
        with contextlib.suppress(OSError):
            os.killpg(popen.pid, sig)  # the group that start_new_session made

    def _end(self, popen: subprocess.Popen[bytes]) -> None:
        if popen.stdin is not None:
            popen.stdin.close()
        else:
            self._signal(popen)

    def _drain(self) -> None:
        for p in self.procs:
            if p.popen.stdin is not None:
                p.popen.stdin.close()
            for t in p.readers:
                t.join(timeout=2.0)

    def report(self, text: str, failed: Optional[Watched] = None) -> None:
        with self._lock:
            sys.stderr.write(f"pskv launch: {text}\n")
            if failed is not None and failed.tail:
                sys.stderr.write(f"pskv launch: last lines of {failed.name}:\n")
                sys.stderr.write("".join(f"    {line}\n" for line in failed.tail[-10:]))
            sys.stderr.flush()
