"""Running a job: :func:`run_job` does what every launcher does (the scheduler here, waiting,
stopping, the exit status, ``--timeout``, ``--dry-run``), a :class:`Backend` what is specific to
one tool. docs/launchers/README.md, "How the launcher is built", walks through it.
"""

from __future__ import annotations

import contextlib
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
from typing import Optional

from .. import config
from ..errors import LaunchError
from .lines import LineBuffer
from .process import Proc, ProcessContext, Show, Stdin, Watched
from .spec import SERVE, JobSpec


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

    def describe(self) -> str:
        env = "".join(f"{shlex.quote(f'{k}={v}')} " for k, v in self.env.items())
        return f"{self.name}: {env}{shlex.join(self.argv)}"


@dataclass
class Done:
    """A submission that has already ended, as :meth:`ProcessContext.wait` watches it."""

    name: str
    returncode: Optional[int]
    tail: list[str]


class Backend:
    """How one launcher plans, starts and cancels the job's processes. The defaults start the
    :meth:`processes` here (local, ssh, mpirun, srun); batch systems override :meth:`start`."""

    title = ""  # the heading of the --dry-run output
    address: Optional[str] = None  # the scheduler runs here, bound to this; None: it runs elsewhere
    guarded = True  # the scheduler runs under pskv.launch.guard --watch-stdin
    scheduler_show: Show = "prefix"
    slack = 0.0  # seconds added to --timeout (time in a queue)

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.scheduler_env: dict[str, str] = {}

    def processes(self, port: Optional[int]) -> list[Planned]:
        """The processes to start here, once the scheduler listens on ``port``."""
        return []

    def plan(self, port: Optional[int]) -> str:
        """What ``--dry-run`` prints."""
        return "\n".join(p.describe() for p in self.processes(port))

    def prepare(self) -> None:
        """Checks and copies before anything starts (not for ``--dry-run``)."""

    def start(self, ctx: ProcessContext, port: Optional[int]) -> tuple[list[Watched], list[Watched]]:
        """Start the servers and workers; the main processes (workers, or what stands for them)
        and the helpers."""
        main: list[Watched] = []
        helpers: list[Watched] = []
        for p in self.processes(port):
            time.sleep(p.delay)
            proc = ctx.start(p.name, p.argv, {**self.spec.environ, **p.env}, show=p.show, stdin=p.stdin)
            (main if p.main else helpers).append(proc)
        return main, helpers

    def cancel(self, ctx: ProcessContext) -> None:
        """Stop what runs elsewhere (``scancel``, ``qdel``); called once, when the job stops early."""

    def close(self, status: Optional[int]) -> None:
        """After the job (``status`` None: it raised): remove files, or keep and name them."""


def run_job(spec: JobSpec, backend: Backend) -> int:
    """Run the job ``spec`` through ``backend``; the launcher's exit status.

    Blocks until the job ends (for YARN and Kubernetes: until it is submitted). A bad option, a
    missing tool or an unreachable host raises :class:`LaunchError` before anything starts;
    whatever goes wrong later stops everything that was started. ::

        spec = JobSpec(num_workers=4, num_servers=2, command=["python3", "train.py"], hosts=read_hostfile("hosts"))
        status = run_job(spec, ssh.Ssh(spec))
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
    backend.prepare()
    ctx = ProcessContext()
    ctx.on_stop = lambda: backend.cancel(ctx)

    def stop_on_signal(signum: int, frame: Optional[FrameType]) -> None:
        ctx.report(f"got {signal.Signals(signum).name}; stopping the job")
        ctx.stop_all()
        raise SystemExit(128 + signum)

    in_main_thread = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main_thread else {}
    status: Optional[int] = None
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
        for sig, handler in old.items():
            signal.signal(sig, handler)
        backend.close(status)


def start_scheduler(ctx: ProcessContext, spec: JobSpec, backend: Backend) -> tuple[Proc, int]:
    """Start the scheduler here, bound to ``backend.address``; it and the port it chose.

    Blocks until the scheduler reports the port through a pipe (``PSKV_PORT_FD``); one that exits
    first, or takes longer than ``PSKV_START_TIMEOUT``, is a :class:`LaunchError`.
    """
    assert backend.address is not None
    read_fd, write_fd = os.pipe()
    env = {**spec.process_env("scheduler", backend.address, 0, base=spec.environ), **backend.scheduler_env}
    env["PSKV_PORT_FD"] = str(write_fd)
    guard = [sys.executable, "-m", "pskv.launch.guard", "--watch-stdin", "--"] if backend.guarded else []
    try:
        stdin: Stdin = "pipe" if backend.guarded else "devnull"
        proc = ctx.start("scheduler", [*guard, *SERVE], env, pass_fds=(write_fd,), show=backend.scheduler_show, stdin=stdin)
    finally:
        os.close(write_fd)
    timeout = config.start_timeout()
    try:
        if not select.select([read_fd], [], [], timeout)[0]:
            raise LaunchError(f"the scheduler did not report its port within {timeout:g} s")
        data = os.read(read_fd, 64)  # one small write: the whole line, or EOF
    finally:
        os.close(read_fd)
    if not data.strip():  # it closed the pipe without a port: it failed to start
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=5)
        raise LaunchError(f"the scheduler exited with status {proc.returncode} before reporting its port")
    return proc, int(data)


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
    """Run a short helper command, its output captured (``input`` on its stdin); a hang is a
    :class:`LaunchError`."""
    try:
        stdin = None if input is not None else subprocess.DEVNULL
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input, stdin=stdin, env=env)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{shlex.join(argv)}` did not finish within {timeout:g} s") from None
    except OSError as exc:
        raise LaunchError(f"cannot run `{shlex.join(argv)}`: {exc.strerror or exc}") from None


def submitted(ctx: ProcessContext, name: str, res: subprocess.CompletedProcess[str], success: str) -> list[Watched]:
    """Show a submission's output (and ``success`` if it worked); the submission, as done."""
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.returncode == 0:
        ctx.report(success)
    return [Done(name, res.returncode, res.stderr.splitlines()[-10:])]


class Spool(threading.Thread):
    """A batch job's new directory in the working directory (which the execution hosts share):
    its scripts and output files. Once started, it copies the whole lines appended to the files
    matching ``pattern`` (prefixed already: ``[worker 1] ...``) to stdout; :meth:`close` removes
    the directory after success, and keeps and names it after a failure."""

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
        """Stop following (the last lines are copied first); remove the directory if ``status`` is 0."""
        if self.is_alive():
            self.done.set()
            self.join(timeout=10)
        if status == 0:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(f"pskv launch: {what} are in {self.dir}", file=sys.stderr, flush=True)
