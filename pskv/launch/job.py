"""Running a job: :func:`run_job`, each launcher's :class:`Backend`, and the :class:`ProcessContext` of
the processes on this machine (docs/launchers/README.md, "How the launcher is built")."""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Literal, Optional, Protocol

from .. import config
from ..errors import LaunchError
from .guard import LineBuffer, die_with_parent, exit_status, pump, terminate
from .spec import SERVE, JobSpec

Show = Literal["prefix", "raw", "tail"]
Stdin = Literal["devnull", "pipe", "secret"]  # secret: a pipe whose first line is the env's PSKV_SECRET
QUEUE_START_TIMEOUT = "3600"  # PSKV_START_TIMEOUT where a cluster may queue some of the job's processes


class Watched(Protocol):
    """What :meth:`ProcessContext.wait` needs of a process, here or elsewhere (a Grid Engine task)."""

    name: str

    @property
    def tail(self) -> list[str]: ...

    @property
    def returncode(self) -> Optional[int]: ...


@dataclass
class Proc:
    """A process started here."""

    name: str  # "scheduler", "worker 0", "mpirun", ...
    popen: subprocess.Popen[bytes]
    again: Callable[[int], Proc]  # start it anew, its nth restart (--max-restarts)
    readers: list[threading.Thread] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)  # its last lines, for the failure report
    failure: str = ""  # the first guard failure line among them
    peak_rss_mb: float = 0.0  # the largest resident size seen (Linux VmHWM), sampled while it runs
    state: str = ""  # as last sampled (Linux /proc): "T" is stopped (SIGSTOP)

    @property
    def returncode(self) -> Optional[int]:
        return self.popen.returncode  # once reaped: by ProcessContext.wait, where it sees the exit, or by a stop

    def sample(self) -> None:
        with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{self.popen.pid}/status") as f:
            for key, _, value in (line.partition(":") for line in f):
                if key == "VmHWM":
                    self.peak_rss_mb = max(self.peak_rss_mb, int(value.split()[0]) / 1024)
                elif key == "State":
                    self.state = value.split()[0]


def failure_status(line: str) -> int:
    """The exit status that a guard's failure line reports (1 if none)."""
    found = re.findall(r"(exited with status|was killed by signal) (\d+)", line)
    how, number = found[-1] if found else ("exited with status", "1")
    return int(number) + (128 if how.startswith("was killed") else 0)


def describe_exit(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    with contextlib.suppress(ValueError):
        return f"was killed by {signal.Signals(-code).name}"
    return f"was killed by signal {-code}"


class ProcessContext:
    """Start, watch and stop a job's processes on this machine; one launcher thread drives it."""

    TAIL = 20  # lines kept of each process, for a failure report
    GRACE = 5.0  # seconds between SIGTERM and SIGKILL

    def __init__(self) -> None:
        self.procs: list[Proc] = []
        self.watched: list[tuple[Watched, bool]] = []  # (process, main), in start order: see wait()
        self.on_stop: Optional[Callable[[], None]] = None  # run once when the job stops early: cancel cluster jobs
        self._lock = threading.RLock()  # re-entrant: run_job's signal handler reports from the main thread
        # every process gets the read end; when this launcher dies (even by SIGKILL) the pipe ends,
        # and every pskv process of the job stops with an error (PSKV_LIFELINE, docs/DESIGN.md)
        self.lifeline, self._lifeline_w = os.pipe()
        self.started_fd = -1  # where the scheduler says the job started (start_scheduler)
        self.started = self.ended = False  # what the scheduler said: the job started, ended
        self.joined = self.finished = 0  # workers that registered with it (before the start); whose guard said "finished" (mpi)
        self.restarts = self.max_restarts = 0  # of workers it declared lost (--max-restarts)
        self.unjoined: set[str] = set()  # restarted, not registered yet: stopped if the job ends first
        self.starting, self.deferred = False, 0  # in start(): run_job's signal handler defers a signal till it returns
        self.preexec: Optional[Callable[[], None]] = None  # where no scheduler reads the lifeline: see run_job
        self.since = time.time()  # timeline parts older than this are another job's (a launcher killed by SIGKILL left them)

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str], pass_fds: Sequence[int] = (),
        show: Show = "prefix", stdin: Stdin = "devnull", main: bool = False,
    ) -> Proc:  # fmt: skip
        """Start ``argv`` in a new process group. ``show``: output as ``[name] ...`` lines, ``"raw"``,
        or only its ``"tail"`` kept; ``stdin="pipe"``: a pipe never written, closed when the job stops
        (``"secret"``: written once, the job's secret)."""
        env = {**env, "PSKV_LIFELINE": f"{self.lifeline}:{os.fstat(self.lifeline).st_ino}"}
        self.starting = True  # a Ctrl-C raised inside Popen would leave its new process unknown, never stopped
        try:
            popen = subprocess.Popen(
                list(argv), env=env, stdin=subprocess.DEVNULL if stdin == "devnull" else subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=self.preexec is None, preexec_fn=self.preexec, pass_fds=(*pass_fds, self.lifeline),
            )  # fmt: skip
            if stdin == "secret" and popen.stdin is not None:
                with contextlib.suppress(BrokenPipeError):  # it exited at once: its status tells why
                    popen.stdin.write(f"{env['PSKV_SECRET']}\n".encode())
                    popen.stdin.flush()
            proc = Proc(name, popen, again=lambda n: self.start(name, argv, {**env, "PSKV_RESTARTS": str(n)}, pass_fds, show, stdin, main))
            pipes = ((popen.stdout, sys.stdout), (popen.stderr, sys.stderr))
            proc.readers = [pump(pipe, functools.partial(self._emit, proc, sink, show)) for pipe, sink in pipes if pipe is not None]
            self.procs.append(proc)
            self.watch(proc, main)
        finally:
            self.starting = False
        if self.deferred:  # now that the process is known, the signal stops it with the rest
            signal.raise_signal(self.deferred)
        return proc

    def watch(self, process: Watched, main: bool) -> None:
        """Wait for ``process`` too: a process started here, or one elsewhere (a Grid Engine task)."""
        self.watched.append((process, main))

    def _emit(self, proc: Proc, sink: IO[str], show: Show, raw: list[bytes]) -> None:
        lines = [line.decode(errors="replace") for line in raw]
        with self._lock:
            if not proc.failure:  # a guard's failure line ("pskv guard: worker 1 failed: ..."): quoted in the report, its status taken
                proc.failure = next((line.strip() for line in lines if "pskv guard: " in line and " failed: " in line), "")
            self.finished += len(lines) - len(lines := [line for line in lines if not re.search(r"pskv guard: worker \d+ finished\s*$", line)])  # (counted, not shown)
            proc.tail = [*proc.tail, *(line.rstrip("\r\n") for line in lines if line.strip())][-self.TAIL :]
            if show != "tail":
                tag = f"[{proc.name}] " if show == "prefix" else ""
                with contextlib.suppress(OSError, ValueError):
                    sink.write("".join(tag + line for line in lines))
                    sink.flush()

    def wait(self, finish_timeout: float = 60.0, timeout: Optional[float] = None, min_workers: int = 0, replicas: int = 0, num_workers: int = -1) -> int:
        """Wait for the job; the launcher's exit status. The job succeeds when every main process
        exits 0 and every helper then exits by itself within ``finish_timeout``. The first process
        to fail stops all others, and its status is returned, unless it is a worker and at least
        ``min_workers`` others remain, or the first server lost with ``replicas`` (the job goes on
        without it); ``timeout`` stops the job with 124. ``num_workers``: W; 2W "finished" lines of the guards (mpi: on stdout and stderr) end a job not started."""
        started = time.monotonic()
        finished_at: Optional[float] = None
        lost: list[Watched] = []  # declared lost: the job goes on without them
        blame_until = 0.0  # till when a failure waits for the process its error names (see below)
        next_sample = 0.0
        while True:
            if time.monotonic() >= next_sample:  # /proc of every process, 4 times a second (not every 50 ms pass)
                for proc in self.procs:
                    proc.sample()
                next_sample = time.monotonic() + 0.25
            for proc in self.procs:  # exits are seen here, once a pass; one not reaped yet still owns its group: what it left there goes too, as the guard's
                with contextlib.suppress(OSError):
                    if proc.popen.returncode is None and os.waitid(os.P_PID, proc.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                        os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.poll()
            self._hear(lost)
            # the first process to fail; of those found at once, one killed by a signal (the rest may
            # have noticed its end as fast as we did)
            failed = sorted((p for p, _ in self.watched if p.returncode and p not in lost), key=lambda p: (p.returncode or 0) > 0)
            # a lost worker or server is let go only once the job started (before, nothing can take over)
            workers = sum(p.name.startswith("worker ") and p not in lost for p, main in self.watched if main)
            spare = {
                "worker": 0 < min_workers < workers and f"the job goes on with {workers - 1} workers (--min-workers {min_workers})",
                "server": sum(p.name.startswith("server ") for p in lost) < replicas and f"its backup serves its parts (--replicas {replicas})",
            }  # fmt: skip
            if failed and self.started and (note := spare.get(failed[0].name.split(" ")[0])):
                lost.append(failed[0])
                self.report(f"{failed[0].name} {describe_exit(failed[0].returncode or 0)}; {note}", failed[0])
                continue
            named = self._named(failed[0], lost) if failed else None
            named = (self._named(named, lost) or named) if named is not None and named.returncode else named  # failed too (the scheduler, of a worker that raised): what its error names
            if named is not None and named.returncode is None and time.monotonic() < (blame_until := blame_until or time.monotonic() + self.GRACE):
                time.sleep(0.05)  # its error names a worker or server that is still exiting: that one's status is the job's
                continue
            if failed:  # (the one named still runs: stopped (SIGSTOP), it is the one the others gave up on)
                stopped = named if named is not None and named.returncode is None and getattr(named, "state", "") == "T" else None
                p = next((q for q in failed if q is named), stopped or failed[0])
                code = p.returncode or 1
                self.stop_all()  # first: its readers' last lines may hold the guard's failure line
                first = getattr(p, "failure", "")
                cause = f" ({first})" if first else ""
                how = "is stopped (SIGSTOP?) and the others gave up on it" if p is stopped else describe_exit(code)
                self.report(f"{p.name} {how}{cause}; stopped the other processes of the job", failed[0] if p is stopped else p)
                return failure_status(first) if first else exit_status(code)
            if finished_at is None and all(p.returncode == 0 for p, main in self.watched if main and p not in lost):
                finished_at = time.monotonic()
            if any(p.name == "scheduler" and p.returncode == 0 for p in self.procs):  # the job is done
                lost += [p for p in self.procs if p.name in self.unjoined and p.returncode is None and p not in lost]
                frozen = [p.name for p in self.procs if p.returncode is None and p not in lost and p.state == "T"]
                if frozen:  # a stopped process can do no more work: waiting for it would never end
                    return self._stop(1, f"the job finished, but {', '.join(frozen)} is stopped (SIGSTOP?) and did not exit; stopped it")
            alive = [p.name for p, main in self.watched if not main and p.returncode is None and p not in lost]
            if finished_at is not None and not alive:
                left = [p.name for p in lost if p.returncode is None]
                if left:  # stopped, or cut off: the scheduler declared them lost and the job went on
                    return self._stop(0, f"the job finished; stopped {', '.join(left)}, declared lost earlier")
                self._drain()
                return 0
            if (finished_at is not None or self.finished == 2 * num_workers) and not self.started and any(p.name == "scheduler" for p in self.procs):
                return self._stop(0, f"the workers finished before the job started (none made a dist store); stopped {', '.join(p.name for p, _ in self.watched if p.returncode is None)}")
            gone = [p.name for p, main in self.watched if main and p.returncode == 0 and p.name.startswith("worker ")]
            if gone and self.joined and not self.started:  # it needs every worker: it can never start
                return self._stop(1, f"{', '.join(gone)} finished before the job started, without joining it (no dist store); "
                                     f"the job, which needs all its workers, could never start: stopped it")
            if finished_at is not None and time.monotonic() - finished_at > finish_timeout:
                return self._stop(1, f"the workers finished but {', '.join(alive)} did not exit within {finish_timeout:g} s; stopped them")
            if timeout is not None and time.monotonic() - started > timeout:
                return self._stop(124, f"the job ran past its time limit of {timeout:g} s; stopped it")
            time.sleep(0.05)

    def _named(self, failed: Watched, lost: Sequence[Watched] = ()) -> Optional[Watched]:
        """The worker, server or scheduler that the last lines of ``failed`` name (its error: "worker 1 finished ..."), not one of
        ``lost`` (declared lost earlier, the job went on: the scheduler's last lines name it too, before the one that ended the job)."""
        for reader in getattr(failed, "readers", ()):  # its last lines, read to the end
            reader.join(timeout=1.0)
        last = " ".join(line for line in failed.tail[-3:] if "pskv" in line)  # pskv's errors, not the program's own lines
        return next((q for q, _ in self.watched if q is not failed and q not in lost and q.name.startswith(("worker ", "server ", "scheduler")) and re.search(
            r"the scheduler at \S+ (has not answered|closed its)" if q.name == "scheduler" else rf"\b{re.escape(q.name)}\b", last)), None)

    def _restart(self, name: str) -> None:
        """Start the worker ``name`` the scheduler declared lost anew, if --max-restarts allows and it is a
        process of ours: it rejoins the running job (docs/SPEC.md, "A worker back in a lost one's place")."""
        proc = next((p for p in reversed(self.procs) if p.name == name), None)  # (mpirun, srun...: none)
        if self.restarts < self.max_restarts and proc is not None:
            self._signal(proc.popen, signal.SIGKILL)  # stopped (SIGSTOP) or cut off: it is not coming back
            self.restarts += 1
            proc.again(self.restarts)
            self.unjoined.add(name)
            self.report(f"restarted {name} (restart {self.restarts} of {self.max_restarts})")

    def _stop(self, status: int, text: str) -> int:
        self.stop_all()
        self.report(text)
        return status

    def _hear(self, lost: list[Watched]) -> None:
        """What the scheduler says on its pipe: ``started``, ``lost <role> <rank>`` (the job goes on), ``back worker <rank>``,
        ``ended`` (every worker finished)."""
        while self.started_fd >= 0 and select.select([self.started_fd], [], [], 0)[0]:
            data = os.read(self.started_fd, 4096)
            if not data:  # it exited
                os.close(self.started_fd)
                self.started_fd = -1
            for line in data.decode(errors="replace").split("\n"):
                self.started, self.ended = self.started or line == "started", self.ended or line == "ended"
                self.joined += line == "registered worker"
                self.unjoined.discard(line[5:] if line.startswith("back ") else "")
                lost += [p for p, _ in self.watched if line == f"lost {p.name}" and p not in lost]
                if line.startswith("lost worker ") and not self.ended:  # (a worker too late to rejoin: ended first)
                    self._restart(line[5:])

    def stop_all(self) -> None:
        """Stop every process still running: EOF on its stdin pipe if it has one, else SIGTERM to
        its group; SIGKILL after :attr:`GRACE` seconds. :attr:`on_stop` runs first, once."""
        on_stop, self.on_stop = self.on_stop, None
        if on_stop is not None:
            try:
                on_stop()
            except Exception as exc:  # stopping the rest matters more
                self.report(f"while stopping: {exc}")
        running = [p.popen for p in self.procs if p.returncode is None]
        terminate(running, self._signal, functools.partial(self._signal, sig=signal.SIGKILL), self.GRACE)
        self._drain()

    @staticmethod
    def _signal(popen: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
        if sig == signal.SIGTERM and popen.stdin is not None:
            popen.stdin.close()  # instead of SIGTERM: an ssh client then ends its remote side too
            return
        with contextlib.suppress(OSError):
            os.killpg(popen.pid, sig)  # the group that start_new_session made

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


@dataclass
class Planned:
    """A process to start here: a role, or a cluster tool's client standing for one or many."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's environment
    main: bool = False  # the job is done when every main process has exited with status 0
    show: Show = "prefix"
    stdin: Stdin = "devnull"
    delay: float = 0.0  # seconds to wait before starting it


class Backend:
    """How one launcher plans, starts and cancels the job's processes; by default, its :meth:`processes` here."""

    title = ""  # the heading of the --dry-run output
    address = ""  # the scheduler runs here, bound to this; "": it runs elsewhere
    guarded = True  # the scheduler runs under pskv.launch.guard --watch-stdin
    scheduler_show: Show = "prefix"
    slack = 0.0  # seconds added to --timeout (time in a queue)
    ctx: Optional[ProcessContext] = None  # the job's processes, once run_job has started
    queued = False  # the cluster may queue some processes while others run (sge, yarn, kubernetes)
    merges = True  # merge the job's timeline files when it ends (sbatch: the launcher inside the allocation does)

    def __init__(self, spec: JobSpec):
        self.spec = spec
        if self.queued and not spec.environ.get("PSKV_START_TIMEOUT"):  # every process waits for those still queued
            spec.env.setdefault("PSKV_START_TIMEOUT", QUEUE_START_TIMEOUT)

    def processes(self, port: Optional[int]) -> list[Planned]:
        """The processes to start here, once the scheduler listens on ``port``."""
        return []

    def plan(self, port: Optional[int]) -> str:
        """What ``--dry-run`` prints."""
        shown = [(p.name, [*(f"{k}={v}" for k, v in p.env.items()), *p.argv]) for p in self.processes(port)]
        return "\n".join(f"{name}: {shlex.join(words)}" for name, words in shown)

    def prepare(self) -> None:
        """Checks and copies before anything starts (not for ``--dry-run``)."""

    def start(self, ctx: ProcessContext, port: Optional[int]) -> Optional[int]:
        """Start the servers and workers, or what stands for them; the job's status if that was all of it
        (a submission), else None: :meth:`ProcessContext.wait` waits for the job."""
        for p in self.processes(port):
            time.sleep(p.delay)
            env = {**self.spec.environ, **p.env, **self.spec.secret_env()}
            ctx.start(p.name, p.argv, env, show=p.show, stdin=p.stdin, main=p.main)
        return None

    def cancel(self, ctx: ProcessContext) -> None:
        """Stop what runs elsewhere (``scancel``, ``qdel``); called once, when the job stops early."""

    def close(self, status: Optional[int]) -> None:
        """After the job (``status`` None: it raised): remove files, or keep and name them."""


class Document(Backend):
    """A launcher that hands the cluster one document (yarn, kubernetes), :attr:`text`: written to
    ``--output``, else handed to :attr:`tool` by :meth:`submit`; ``--dry-run`` prints it without the secret."""

    launcher = tool = hint = ""  # its name, the cluster tool (its path once prepared), and what to do without it
    text = written = success = ""  # the document; the reports once written to --output, once submitted
    command: list[str]  # the submission, as a user would type it
    queued = True

    def plan(self, port: Optional[int]) -> str:
        secret = self.spec.secret
        return self.text.replace(secret, "<the job's secret, made anew at launch>") if secret else self.text

    def prepare(self) -> None:
        if not self.spec.output:
            self.tool = require_tool(self.tool, self.launcher, self.hint)

    def start(self, ctx: ProcessContext, port: Optional[int]) -> int:
        if self.spec.output:
            write_private(self.spec.output, self.text)
            ctx.report(self.written)
            return 0
        res = self.submit()
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
        ctx.report(self.success if res.returncode == 0 else f"`{shlex.join(self.command)}` {describe_exit(res.returncode)}")
        return exit_status(res.returncode)

    def submit(self) -> subprocess.CompletedProcess[str]:
        """Run :attr:`tool` to hand the document over, on its standard input."""
        return run_quiet([self.tool, *self.command[1:]], timeout=300, input=self.text)


def run_job(spec: JobSpec, backend: Backend) -> int:
    """Run the job ``spec`` through ``backend`` (e.g. ``ssh.Ssh(spec)``) until it ends or is submitted;
    the exit status. A bad option, tool or host raises :class:`LaunchError` before anything starts."""
    here = bool(spec.num_servers and backend.address)
    if spec.dry_run:
        try:
            note = f"scheduler here, bound to {backend.address} (its port replaces DMLC_PS_ROOT_PORT=0 below)\n" if here else ""
            print(f"# {backend.title}\n{note}{backend.plan(0 if here else None).rstrip()}", flush=True)
        except BrokenPipeError:  # `--dry-run | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (else the exit's flush fails again)
        finally:
            backend.close(0)
        return 0
    ctx = backend.ctx = ProcessContext()
    if not here:  # no scheduler reads the lifeline (-s 0): the kernel sends each process SIGTERM when the launcher dies
        ctx.preexec = die_with_parent(signal.SIGTERM)

    def stop_on_signal(signum: int, frame: Optional[FrameType]) -> None:
        if ctx.starting:  # ctx.start raises it again once its new process is watched
            ctx.deferred = signum
            return
        ctx.report(f"got {signal.Signals(signum).name}; stopping the job")
        ctx.stop_all()
        raise SystemExit(128 + signum)

    in_main_thread = threading.current_thread() is threading.main_thread()
    hup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)  # (ignored: nohup, which must keep the job)
    old = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGINT, signal.SIGTERM, *hup)} if in_main_thread else {}
    status: Optional[int] = None
    try:
        backend.prepare()  # in here: close() removes what the backend wrote (mpi's hostfile) if it fails
        ctx.on_stop = lambda: backend.cancel(ctx)
        status = backend.start(ctx, start_scheduler(ctx, spec, backend) if here else None)
        if status is None:
            timeout = None if spec.timeout is None else spec.timeout + backend.slack
            env = {**spec.environ, **spec.env}
            min_workers, replicas = int(env.get("PSKV_MIN_WORKERS") or 0), int(env.get("PSKV_REPLICAS") or 0) if spec.num_servers > 1 else 0
            ctx.max_restarts = int(env.get("PSKV_MAX_RESTARTS") or 0) if min_workers else 0
            status = ctx.wait(finish_timeout=max(30.0, config.heartbeat_timeout() * 2), timeout=timeout, min_workers=min_workers, replicas=replicas, num_workers=spec.num_workers)
        return status
    except BaseException as exc:
        ctx.stop_all()
        if isinstance(exc, FileNotFoundError) or (isinstance(exc, OSError) and exc.filename in spec.command[:1]):  # not a program
            hint = "; a script without the execute bit or a #! line runs as `python SCRIPT`" if exc.errno in (errno.EACCES, errno.ENOEXEC) else ""
            raise LaunchError(f"cannot start {exc.filename}: {exc.strerror}{hint}") from None
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.EAGAIN):  # a huge -n
            raise LaunchError(f"cannot start process {len(ctx.procs) + 1} of the job: {exc.strerror}; stopped the others") from None
        raise
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for fd in (ctx.lifeline, ctx._lifeline_w, ctx.started_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        backend.close(status)
        if ctx.procs and backend.merges:  # the job ran from here (not submitted)
            merge_timelines(spec, ctx)


def merge_timelines(spec: JobSpec, ctx: ProcessContext) -> None:
    """Merge the servers' and workers' timeline files (``PSKV_TIMELINE``, for some roles only with
    --env-server/--env-worker) that this host sees: all on one machine, or in a folder the hosts share."""
    paths: dict[str, int] = {}
    for role, count in (("server", spec.num_servers), ("worker", spec.num_workers)):
        if path := {**spec.environ, **spec.env, **spec.role_env.get(role, {})}.get("PSKV_TIMELINE", ""):
            paths[path] = paths.get(path, 0) + count
    for path, count in paths.items():
        from ..ps import timeline  # not at the top: pskv.ps loads zmq

        if (merged := timeline.merge(path, ctx.since)) < count:
            said = f"{merged} of {count} processes' files merged into {path}; the others wrote none" if merged else f"none of the {count} processes wrote one"
            ctx.report(f"timeline: {said} here (on a cluster each host keeps its own as "
                       f"{path}.<role>-<rank>.json: gather them and merge with pskv.ps.timeline.merge)")


def start_scheduler(ctx: ProcessContext, spec: JobSpec, backend: Backend) -> int:
    """Start the scheduler here, bound to ``backend.address``; the port it reports through a pipe
    (``PSKV_PORT_FD``). :class:`LaunchError` if it exits first or takes over ``PSKV_START_TIMEOUT``."""
    # the port comes first on the pipe; "started" next, once every node registered (run_job closes it)
    ctx.started_fd, write_fd = os.pipe()
    env = {**spec.process_env("scheduler", backend.address, 0, base=spec.environ), **spec.secret_env()}
    env["PSKV_PORT_FD"] = str(write_fd)
    guard = [sys.executable, "-m", "pskv.launch.guard", "--watch-stdin", "--"] if backend.guarded else []
    try:
        stdin: Stdin = "pipe" if backend.guarded else "devnull"
        proc = ctx.start("scheduler", [*guard, *SERVE], env, pass_fds=(write_fd,), show=backend.scheduler_show, stdin=stdin)
    finally:
        os.close(write_fd)
    timeout = config.start_timeout()
    if not select.select([ctx.started_fd], [], [], timeout)[0]:
        raise LaunchError(f"the scheduler did not report its port within {timeout:g} s")
    data = os.read(ctx.started_fd, 64)  # one small write: the whole line, or EOF
    if not data.strip():  # it closed the pipe without a port: it failed to start
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=5)
        raise LaunchError(f"the scheduler exited with status {proc.returncode} before reporting its port")
    return int(data)


def write_private(path: str, text: str) -> None:
    """Write a file only its owner may read (it holds the job's secret)."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def require_tool(name: str, launcher: str, hint: str = "") -> str:
    """The path of ``name`` on PATH, or a :class:`LaunchError` that says what is missing."""
    if (path := shutil.which(name)) is None:
        raise LaunchError(f"the {launcher} launcher needs `{name}`, which is not on PATH{'; ' + hint if hint else ''}")
    return path


def run_quiet(argv: Sequence[str], timeout: float = 60.0, input: Optional[str] = None) -> subprocess.CompletedProcess[str]:
    """Run a short helper command, its output captured; a hang is a :class:`LaunchError`."""
    try:
        stdin = None if input is not None else subprocess.DEVNULL
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input, stdin=stdin)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{shlex.join(argv)}` did not finish within {timeout:g} s") from None
    except OSError as exc:
        raise LaunchError(f"cannot run `{shlex.join(argv)}`: {exc.strerror or exc}") from None


class Spool(threading.Thread):
    """A batch job's new directory in the (shared) working directory, for its scripts and output
    files; once started, it copies the lines appended to the files matching ``pattern`` to stdout."""

    def __init__(self, prefix: str, pattern: str):
        super().__init__(daemon=True, name="pskv-spool")
        self.dir = tempfile.mkdtemp(prefix=prefix, dir=os.getcwd())
        self.pattern = pattern
        self.done = threading.Event()
        self.files: dict[str, tuple[int, LineBuffer]] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def copy(self, final: bool) -> None:
        for path in sorted(glob.glob(self.path(self.pattern))):  # asked every time: files appear late
            pos, buffer = self.files.get(path) or (0, LineBuffer())
            with contextlib.suppress(OSError), open(path, "rb") as f:
                f.seek(pos)
                lines = buffer.feed(f.read()) + (buffer.end() if final else [])
                self.files[path] = (f.tell(), buffer)
                sys.stdout.write("".join(line.decode(errors="replace") for line in lines))
        sys.stdout.flush()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.copy(final=False)
        self.copy(final=True)

    def close(self, status: Optional[int], what: str) -> None:
        """Stop following; remove the directory after success, else keep and name it."""
        if self.is_alive():
            self.done.set()
            self.join(timeout=10)
        if status == 0:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(f"pskv launch: {what} are in {self.dir}", file=sys.stderr, flush=True)
