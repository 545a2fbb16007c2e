"""Running a job: :func:`run_job` does what every launcher does, a :class:`Backend` what is
specific to one tool.

``run_job`` starts the scheduler here (for the backends whose scheduler runs on this machine:
it binds a free port and reports it through a pipe, under ``pskv.launch.guard --watch-stdin`` so
that it dies with the launcher), asks the backend to start the servers and workers, and waits:
the first process to fail stops everything (the backend's :meth:`~Backend.cancel` ends what runs
elsewhere) and its status is the launcher's; Ctrl-C and SIGTERM stop everything too (130 / 143),
``--timeout`` as well (124). ``--dry-run`` prints the backend's plan and starts nothing.
"""

from __future__ import annotations

import glob
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Optional

from .. import config
from ..errors import LaunchError
from .guard import guard_argv
from .lines import LineBuffer
from .process import Proc, ProcessContext, Watched
from .spec import SERVE, JobSpec


@dataclass
class Planned:
    """A process to start on this machine: a role itself, or a cluster tool's client standing
    for one or many (``ssh``, ``mpirun``, ``srun``)."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's environment
    main: bool = False  # the job is done when every main process has exited with status 0
    show: str = "prefix"  # as for ProcessContext.start
    stdin: str = "devnull"
    delay: float = 0.0  # seconds to wait before starting it

    def describe(self) -> str:
        env = "".join(f"{shlex.quote(f'{k}={v}')} " for k, v in self.env.items())
        return f"{self.name}: {env}{shlex.join(self.argv)}"


@dataclass
class Done:
    """A step that has already ended (a submission), as :meth:`ProcessContext.wait` sees it."""

    name: str
    returncode: Optional[int]
    tail: list[str] = field(default_factory=list)


class Backend:
    """How one launcher plans, starts and cancels the job's processes.

    The defaults suit a launcher whose processes all start here (local, ssh, mpirun, srun): it
    lists them in :meth:`processes`. Batch systems override :meth:`plan` and :meth:`start`.
    """

    title = ""  # the heading of the --dry-run output
    address: Optional[str] = None  # the scheduler runs here, bound to this; None: it runs elsewhere
    guarded = True  # the scheduler runs under pskv.launch.guard --watch-stdin
    scheduler_show = "prefix"
    slack = 0.0  # seconds added to --timeout (time in a queue)

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.scheduler_env: dict[str, str] = {}  # extra variables for the scheduler

    def processes(self, port: Optional[int]) -> list[Planned]:
        """The processes to start here, once the scheduler listens on ``port``."""
        return []

    def plan(self, port: Optional[int]) -> str:
        """What ``--dry-run`` prints."""
        return "\n".join(p.describe() for p in self.processes(port))

    def prepare(self) -> None:
        """Checks and copies before anything starts (not for ``--dry-run``)."""

    def start(self, ctx: ProcessContext, port: Optional[int]) -> tuple[list[Watched], list[Watched]]:
        """Start the servers and workers; the main processes (the workers, or what stands for
        them) and the helpers, for :meth:`ProcessContext.wait`."""
        main: list[Watched] = []
        helpers: list[Watched] = []
        for p in self.processes(port):
            time.sleep(p.delay)
            proc = ctx.start(p.name, p.argv, {**self.spec.environ, **p.env}, show=p.show, stdin=p.stdin)
            (main if p.main else helpers).append(proc)
        return main, helpers

    def cancel(self, ctx: ProcessContext) -> None:
        """Stop what runs elsewhere (``qdel``, ``scancel``); called once, when the job stops early."""

    def close(self, status: Optional[int]) -> None:
        """After the job (``status`` None: it raised): remove files, or keep and name them."""


def run_job(spec: JobSpec, backend: Backend) -> int:
    """Run the job ``spec`` through ``backend``; the launcher's exit status.

    Blocks until the job ends (for YARN and Kubernetes: until it is submitted). A bad option, a
    missing tool or an unreachable host raises :class:`LaunchError` before anything starts;
    whatever goes wrong later stops everything that was started. ::

        spec = JobSpec(num_workers=4, num_servers=2, command=["python3", "train.py"], hosts=read_hostfile("hosts"))
        status = run_job(spec, ssh.backend(spec))
    """
    here = bool(spec.num_servers) and backend.address is not None
    if spec.dry_run:
        try:
            note = f"scheduler here, bound to {backend.address} (its port replaces DMLC_PS_ROOT_PORT=0 below)\n"
            sys.stdout.write(f"# {backend.title}\n{note if here else ''}{backend.plan(0 if here else None).rstrip()}\n")
            sys.stdout.flush()
            return 0
        finally:
            backend.close(0)
    status: Optional[int] = None
    backend.prepare()
    ctx = ProcessContext()
    ctx.on_stop.append(lambda: backend.cancel(ctx))
    stop = _StopOnSignal(ctx)
    try:
        helpers: list[Watched] = []
        port = None
        if here:
            scheduler, port = start_scheduler(ctx, spec, backend)
            helpers.append(scheduler)
        main, more = backend.start(ctx, port)
        timeout = None if spec.timeout is None else spec.timeout + backend.slack
        finish = max(30.0, config.heartbeat_timeout() * 2)
        status = ctx.wait(main, [*helpers, *more], finish_timeout=finish, timeout=timeout)
        return status
    except FileNotFoundError as exc:
        ctx.stop_all()
        raise LaunchError(f"cannot start {exc.filename}: {exc.strerror}") from None
    except BaseException:
        ctx.stop_all()
        raise
    finally:
        stop.restore()
        backend.close(status)


def start_scheduler(ctx: ProcessContext, spec: JobSpec, backend: Backend) -> tuple[Proc, int]:
    """Start the scheduler here, bound to ``backend.address`` on a port of its choosing; the
    process and that port, which it reports through a pipe (``PSKV_PORT_FD``).

    Blocks until the port arrives; a scheduler that exits first, or takes longer than
    ``PSKV_START_TIMEOUT``, is a :class:`LaunchError`.
    """
    assert backend.address is not None
    read_fd, write_fd = os.pipe()
    env = {**spec.process_env("scheduler", backend.address, 0, base=spec.environ), **backend.scheduler_env}
    env["PSKV_PORT_FD"] = str(write_fd)
    argv = [*guard_argv(sys.executable, watch_stdin=True), "--", *SERVE] if backend.guarded else SERVE
    stdin = "pipe" if backend.guarded else "devnull"
    try:
        proc = ctx.start("scheduler", argv, env, pass_fds=(write_fd,), show=backend.scheduler_show, stdin=stdin)
    finally:
        os.close(write_fd)
    timeout = config.start_timeout()
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"the scheduler did not report its port within {timeout:g} s")
            if select.select([read_fd], [], [], min(left, 0.2))[0]:
                chunk = os.read(read_fd, 64)
                if not chunk:  # it closed the pipe without a port: it failed to start
                    proc.popen.wait(timeout=5)
                    raise LaunchError(f"the scheduler exited with status {proc.returncode} before reporting its port")
                data += chunk
    finally:
        os.close(read_fd)
    return proc, int(data.strip())


class _StopOnSignal:
    """Ctrl-C or SIGTERM to the launcher stops the whole job (exit status 128 + signal)."""

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


# --------------------------------------------------------------------------------------------
# helpers of the backends


def require_tool(name: str, launcher: str, hint: str = "") -> str:
    """The path of ``name`` on PATH, or a :class:`LaunchError` that says what is missing."""
    path = shutil.which(name)
    if path is None:
        raise LaunchError(f"the {launcher} launcher needs `{name}`, which is not on PATH{'; ' + hint if hint else ''}")
    return path


def run_quiet(
    argv: Sequence[str], timeout: float = 60.0, env: Optional[Mapping[str, str]] = None, input: Optional[str] = None
) -> subprocess.CompletedProcess[str]:
    """Run a short helper command, output captured (``input`` on its stdin); a hang is a
    :class:`LaunchError`."""
    try:
        return subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            env=None if env is None else dict(env),
        )
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{shlex.join(argv)}` did not finish within {timeout:g} s") from None
    except OSError as exc:
        raise LaunchError(f"cannot run `{shlex.join(argv)}`: {exc.strerror or exc}") from None


def last_lines(text: str, n: int = 5) -> str:
    return " | ".join([line for line in text.strip().splitlines() if line.strip()][-n:])


class Spool(threading.Thread):
    """A batch job's directory, new in the working directory (which the execution hosts share):
    its scripts and output files. While it runs (:meth:`start`), the whole lines appended to the
    files matching ``pattern`` there (asked again every 0.2 s: files appear late) are copied to
    ``sink``; they are prefixed already (``[worker 1] ...``). :meth:`close` removes it after
    success, and keeps and names it after a failure."""

    def __init__(self, prefix: str, pattern: str, sink: Optional[IO[str]] = None, directory: Optional[str] = None):
        super().__init__(daemon=True, name="pskv-spool")
        self.dir = tempfile.mkdtemp(prefix=prefix, dir=directory or os.getcwd())
        self.pattern = pattern
        self.sink = sink or sys.stdout
        self._done = threading.Event()
        self._files: dict[str, tuple[int, LineBuffer]] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _copy(self, final: bool) -> None:
        for path in sorted(glob.glob(self.path(self.pattern))):
            pos, buffer = self._files.get(path) or (0, LineBuffer())
            try:
                with open(path, "rb") as f:
                    f.seek(pos)
                    lines = buffer.feed(f.read())
                    self._files[path] = (f.tell(), buffer)
            except OSError:
                continue
            lines += buffer.end() if final else []
            self.sink.write("".join(line.decode(errors="replace") for line in lines))
        self.sink.flush()

    def run(self) -> None:
        while not self._done.wait(0.2):
            self._copy(final=False)
        self._copy(final=True)

    def close(self, status: Optional[int], what: str) -> None:
        """Stop following (the last lines are copied first); remove the directory if ``status`` is 0."""
        if self.is_alive():
            self._done.set()
            self.join(timeout=10)
        if status == 0:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(f"pskv launch: {what} are in {self.dir}", file=sys.stderr, flush=True)
