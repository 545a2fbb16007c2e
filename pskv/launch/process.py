"""A job's processes on this machine: start them, stream their output, wait, stop them.

Every launcher ends up running local processes (the roles themselves, or ``ssh``/``srun``/
``mpirun`` clients standing for them). :class:`ProcessContext` starts each in its own process
group, prefixes every line it prints with its name (``[worker 0] ...``), and when one fails stops
all the others: SIGTERM to each group, SIGKILL after a grace period. It never touches a process
it did not start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Optional


@dataclass
class Proc:
    """One started process."""

    name: str  # "scheduler", "server 1", "worker 0"
    role: str
    popen: subprocess.Popen[bytes]
    readers: list[threading.Thread] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)  # last lines it printed, for error reports

    @property
    def returncode(self) -> Optional[int]:
        return self.popen.poll()


def exit_status(code: int) -> int:
    """A shell-style status: 128 + signal for a process killed by a signal."""
    return 128 - code if code < 0 else code


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
        self._out = stdout or sys.stdout
        self._err = stderr or sys.stderr
        self._lock = threading.Lock()

    def start(
        self,
        name: str,
        role: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        pass_fds: Sequence[int] = (),
        cwd: Optional[str] = None,
        show: str = "prefix",
    ) -> Proc:
        """Start ``argv`` in a new process group with ``env``.

        ``show``: ``"prefix"`` streams its output with ``[name] `` before every line, ``"raw"``
        streams it as it is, ``"tail"`` keeps only the last lines for the failure report.
        """
        if show not in ("prefix", "raw", "tail"):
            raise ValueError(f"show must be prefix, raw or tail, got {show!r}")
        popen = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
            cwd=cwd,
        )
        proc = Proc(name, role, popen)
        assert popen.stdout is not None and popen.stderr is not None
        for pipe, sink in ((popen.stdout, self._out), (popen.stderr, self._err)):
            t = threading.Thread(target=self._pump, args=(proc, pipe, sink, show), daemon=True, name=f"pskv-out-{name}")
            t.start()
            proc.readers.append(t)
        self.procs.append(proc)
        return proc

    def _pump(self, proc: Proc, pipe: IO[bytes], sink: IO[str], show: str) -> None:
        """Copy ``pipe`` to ``sink`` line by line, each line prefixed with ``[name] ``.

        Only whole lines (ended by \\n, or \\r for progress bars) are written, so lines of
        different processes never mix; a last unterminated line is written at EOF.
        """
        tag = f"[{proc.name}] " if show == "prefix" else ""
        pending = ""
        fd = pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if chunk:
                pending += chunk.decode(errors="replace")
                lines = pending.splitlines(keepends=True)
                pending = lines.pop() if lines and not lines[-1].endswith(("\n", "\r")) else ""
            else:
                lines = [pending + "\n"] if pending else []
                pending = ""
            if lines and show == "tail":
                proc.tail.extend(line.rstrip("\r\n") for line in lines if line.strip())
                del proc.tail[: -self.TAIL]
            elif lines:
                for line in lines:
                    stripped = line.rstrip("\r\n")
                    if stripped:
                        proc.tail.append(stripped)
                del proc.tail[: -self.TAIL]
                with self._lock:
                    try:
                        sink.write("".join(tag + line for line in lines))
                        sink.flush()
                    except (OSError, ValueError):
                        pass
            if not chunk:
                break
        pipe.close()

    # -- waiting and stopping -------------------------------------------------------------------

    def wait(self, main: Sequence[Proc], helpers: Sequence[Proc], finish_timeout: float = 60.0, timeout: Optional[float] = None) -> int:
        """Wait for the job; the launcher's exit status.

        The job succeeds when every ``main`` process (the workers) exits 0 and every helper
        (scheduler, servers) then exits by itself within ``finish_timeout``. The first process
        to fail stops all others and its status is returned.
        """
        started = time.monotonic()
        finished_at: Optional[float] = None
        while True:
            failed = next((p for p in self.procs if p.returncode not in (None, 0)), None)
            if failed is not None:
                code = failed.returncode
                assert code is not None
                self.stop_all()
                self.report(f"{failed.name} {describe_exit(code)}; stopped the other processes of the job", failed)
                return exit_status(code)
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
        """SIGTERM every process group still running, SIGKILL after ``grace`` seconds."""
        running = [p for p in self.procs if p.returncode is None]
        for p in running:
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
            for t in p.readers:
                t.join(timeout=2.0)

    def report(self, text: str, failed: Optional[Proc] = None) -> None:
        with self._lock:
            self._err.write(f"pskv launch: {text}\n")
            if failed is not None and failed.tail:
                self._err.write(f"pskv launch: last lines of {failed.name}:\n")
                for line in failed.tail[-10:]:
                    self._err.write(f"    {line}\n")
            self._err.flush()
