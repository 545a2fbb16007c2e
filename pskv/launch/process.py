"""A job's processes on this machine: start them, stream their output, wait, stop them.

Every launcher ends up running local processes (the roles themselves, or ``ssh``/``srun``/
``mpirun`` clients standing for them). :class:`ProcessContext` starts each in its own process
group, prefixes every line it prints with its name (``[worker 0] ...``), and when one fails stops
all the others: SIGTERM to each group, SIGKILL after a grace period. It never touches a process
it did not start.
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
from typing import IO, Optional, Protocol

from .lines import pump


@dataclass
class Proc:
    """One started process."""

    name: str  # "scheduler", "server 1", "worker 0", "mpirun"
    popen: subprocess.Popen[bytes]
    readers: list[threading.Thread] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)  # last lines it printed, for error reports
    peak_rss_mb: float = 0.0  # the largest resident size seen (Linux: VmHWM), sampled while it runs
    failures: list[str] = field(default_factory=list)  # "pskv guard: ... failed: ..." lines it relayed

    def sample(self) -> None:
        """Update :attr:`peak_rss_mb` from ``/proc`` (no-op elsewhere or once it has exited)."""
        try:
            with open(f"/proc/{self.popen.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        self.peak_rss_mb = max(self.peak_rss_mb, int(line.split()[1]) / 1024)
                        return
        except (OSError, ValueError):
            pass

    @property
    def returncode(self) -> Optional[int]:
        return self.popen.poll()


#: what pskv.launch.guard writes when its command fails ("pskv guard: worker 1 failed: ..."); a
#: launcher whose one client process stands for many (mpirun, srun) quotes the first such line
GUARD_FAILURE = ("pskv guard: ", " failed: ")


class Watched(Protocol):
    """What :meth:`ProcessContext.wait` needs of a process: a name, its status, its last lines."""

    @property
    def name(self) -> str: ...

    @property
    def tail(self) -> list[str]: ...

    @property
    def returncode(self) -> Optional[int]: ...


def exit_status(code: int) -> int:
    """A shell-style status: 128 + signal for a process killed by a signal."""
    return 128 - code if code < 0 else code


def guard_status(line: str) -> int:
    """The exit status a guard's failure line reports (1 if it says none)."""
    found = re.findall(r"(exited with status|was killed by signal) (\d+)", line)
    if not found:
        return 1
    how, number = found[-1]
    return int(number) + (128 if how.startswith("was killed") else 0)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class ProcessContext:
    """Start, watch and stop a job's processes. Not thread-safe; one launcher drives it."""

    TAIL = 20

    def __init__(self, grace: float = 5.0, stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None):
        self.grace = grace
        self.procs: list[Proc] = []
        #: called (once) when the job is stopped, before any signal: cancel cluster jobs here
        self.on_stop: list[Callable[[], None]] = []
        self._stopped_remote = False
        self._out = stdout or sys.stdout
        self._err = stderr or sys.stderr
        self._lock = threading.Lock()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        pass_fds: Sequence[int] = (),
        show: str = "prefix",
        stdin: str = "devnull",
    ) -> Proc:
        """Start ``argv`` in a new process group with ``env``.

        ``show``: ``"prefix"`` streams its output with ``[name] `` before every line, ``"raw"``
        streams it as it is, ``"tail"`` keeps only the last lines for the failure report.
        ``stdin``: ``"devnull"``, or ``"pipe"``: a pipe that is never written and is closed
        when the job stops (an ``ssh`` client passes that EOF on to the remote
        ``pskv.launch.guard --watch-stdin``, which then stops its command), or when this
        process dies.
        """
        if show not in ("prefix", "raw", "tail"):
            raise ValueError(f"show must be prefix, raw or tail, got {show!r}")
        if stdin not in ("devnull", "pipe"):
            raise ValueError(f"stdin must be devnull or pipe, got {stdin!r}")
        popen = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.PIPE if stdin == "pipe" else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
        )
        proc = Proc(name, popen)
        assert popen.stdout is not None and popen.stderr is not None
        for pipe, sink in ((popen.stdout, self._out), (popen.stderr, self._err)):
            emit = functools.partial(self._emit, proc, sink, show)
            t = threading.Thread(target=pump, args=(pipe, emit), daemon=True, name=f"pskv-out-{name}")
            t.start()
            proc.readers.append(t)
        self.procs.append(proc)
        return proc

    def _emit(self, proc: Proc, sink: IO[str], show: str, raw: list[bytes]) -> None:
        """One batch of whole lines of ``proc``: remembered for the failure report, and written to
        ``sink`` (prefixed ``[name] `` for ``show="prefix"``) unless only the tail is kept."""
        lines = [line.decode(errors="replace") for line in raw]
        for line in lines:
            if all(part in line for part in GUARD_FAILURE) and len(proc.failures) < 10:
                proc.failures.append(line.strip())
        proc.tail += [stripped for stripped in (line.rstrip("\r\n") for line in lines) if stripped.strip()]
        del proc.tail[: -self.TAIL]
        if show == "tail":
            return
        tag = f"[{proc.name}] " if show == "prefix" else ""
        with self._lock, contextlib.suppress(OSError, ValueError):
            sink.write("".join(tag + line for line in lines))
            sink.flush()

    # -- waiting and stopping -------------------------------------------------------------------

    def _watched(self, main: Sequence[Watched], helpers: Sequence[Watched]) -> list[Watched]:
        extra = [p for p in (*main, *helpers) if not isinstance(p, Proc)]
        return [*self.procs, *extra]

    def wait(
        self,
        main: Sequence[Watched],
        helpers: Sequence[Watched],
        finish_timeout: float = 60.0,
        timeout: Optional[float] = None,
    ) -> int:
        """Wait for the job; the launcher's exit status.

        The job succeeds when every ``main`` process (the workers) exits 0 and every helper
        (scheduler, servers) then exits by itself within ``finish_timeout``. The first process
        to fail stops all others and its status is returned. ``main`` and ``helpers`` may also
        hold :class:`Watched` stand-ins for processes that run elsewhere (a Grid Engine task).
        """
        started = time.monotonic()
        finished_at: Optional[float] = None
        next_sample = 0.0
        while True:
            if time.monotonic() >= next_sample:
                for p in self.procs:
                    p.sample()
                next_sample = time.monotonic() + 0.25
            failed = next((p for p in self._watched(main, helpers) if p.returncode not in (None, 0)), None)
            if failed is not None:
                code = failed.returncode
                assert code is not None
                self.stop_all()
                first = list(getattr(failed, "failures", []))
                cause = f" ({first[0]})" if first else ""
                self.report(f"{failed.name} {describe_exit(code)}{cause}; stopped the other processes of the job", failed)
                return guard_status(first[0]) if first else exit_status(code)
            if finished_at is None and all(p.returncode == 0 for p in main):
                finished_at = time.monotonic()
            if finished_at is not None:
                alive = [p for p in helpers if p.returncode is None]
                if not alive:
                    self._drain()
                    return 0
                if time.monotonic() - finished_at > finish_timeout:
                    self.stop_all()
                    names = ", ".join(p.name for p in alive)
                    self.report(f"the workers finished but {names} did not exit within {finish_timeout:g} s; stopped them")
                    return 1
            if timeout is not None and time.monotonic() - started > timeout:
                self.stop_all()
                self.report(f"the job ran past its time limit of {timeout:g} s; stopped it")
                return 124
            time.sleep(0.05)

    def stop_all(self) -> None:
        """Stop every process still running: SIGTERM to its group (or, for one started with
        ``stdin="pipe"``, EOF on that pipe), SIGKILL after ``grace`` seconds. The
        :attr:`on_stop` callbacks run first."""
        if not self._stopped_remote:
            self._stopped_remote = True
            for callback in self.on_stop:
                try:
                    callback()
                except Exception as exc:  # stopping the rest matters more
                    self.report(f"while stopping: {exc}")
        running = [p for p in self.procs if p.returncode is None]
        for p in running:
            if p.popen.stdin is not None:
                with contextlib.suppress(OSError):
                    p.popen.stdin.close()
            else:
                self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(p.returncode is None for p in running):
            time.sleep(0.05)
        for p in running:
            if p.returncode is None:
                self._signal(p, signal.SIGKILL)
        for p in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=5)
        self._drain()

    @staticmethod
    def _signal(p: Proc, sig: int) -> None:
        try:
            os.killpg(p.popen.pid, sig)  # the group we created with start_new_session
        except ProcessLookupError:
            pass
        except PermissionError:
            p.popen.send_signal(sig)

    def _drain(self) -> None:
        for p in self.procs:
            if p.popen.stdin is not None and p.returncode is not None:
                with contextlib.suppress(OSError):
                    p.popen.stdin.close()
            for t in p.readers:
                t.join(timeout=2.0)

    def report(self, text: str, failed: Optional[Watched] = None) -> None:
        with self._lock:
            self._err.write(f"pskv launch: {text}\n")
            if failed is not None and failed.tail:
                self._err.write(f"pskv launch: last lines of {failed.name}:\n")
                for line in failed.tail[-10:]:
                    self._err.write(f"    {line}\n")
            self._err.flush()
