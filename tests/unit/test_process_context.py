"""The launcher's process context (whole lines, prefixes, first failure stops the rest) and the
job runner that drives it (run_job with a fake backend)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from typing import Any, Optional

import pytest

from pskv.errors import LaunchError
from pskv.launch.job import Backend, Planned, Proc, ProcessContext, run_job
from pskv.launch.spec import JobSpec

WRITER = """
import sys, time
for i in range(5):
    sys.stdout.write("part-a ")
    sys.stdout.flush()
    time.sleep(0.01)
    sys.stdout.write("part-b %d\\n" % i)
    sys.stdout.flush()
sys.stdout.write("progress 1\\rprogress 2\\r")
sys.stdout.write("no newline at the end")
"""


def test_lines_never_mix_and_are_prefixed(capsys: pytest.CaptureFixture[str]) -> None:
    ctx = ProcessContext()
    for i in range(3):
        ctx.start(f"worker {i}", [sys.executable, "-u", "-c", WRITER], {}, main=True)
    assert ctx.wait() == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for i in range(3):
        mine = [line for line in lines if line.startswith(f"[worker {i}] ")]
        assert [m for m in mine if "part" in m] == [f"[worker {i}] part-a part-b {n}" for n in range(5)]
        assert f"[worker {i}] no newline at the end" in mine
    assert all(line.startswith("[worker ") for line in out.replace("\r", "\n").splitlines())


def test_first_failure_stops_the_others_and_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    ctx = ProcessContext()
    sleeper = ctx.start("worker 0", [sys.executable, "-c", "import time; time.sleep(60)"], {}, main=True)
    ctx.start("worker 1", [sys.executable, "-c", "import sys; print('bye', file=sys.stderr); sys.exit(7)"], {}, main=True)
    assert ctx.wait() == 7
    assert sleeper.returncode is not None
    err = capsys.readouterr().err
    assert "worker 1 exited with status 7" in err and "    bye" in err


def test_reading_a_status_signals_nothing_the_wait_stops_what_an_exited_process_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading Proc.returncode (a report, stop_all) SIGKILLed the group of a process that had exited, as a
    side effect; now only the wait loop, where it sees the exit, kills what the process left, then reaps it."""
    import os

    from tests.cluster.daemons import alive

    signalled: list[tuple[int, int]] = []
    real = os.killpg
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: (signalled.append((pgid, sig)), real(pgid, sig))[1])
    ctx = ProcessContext()
    code = "import subprocess as s; print('child', s.Popen(['sleep', '60'], stdout=s.DEVNULL, stderr=s.DEVNULL).pid)"
    proc = ctx.start("worker 0", _py(code), {}, main=True)
    os.waitid(os.P_PID, proc.popen.pid, os.WEXITED | os.WNOWAIT)  # it exited (not reaped), its child runs on in its group
    for t in proc.readers:
        t.join(timeout=10)
    child = int(proc.tail[-1].split()[1])
    try:
        seen = [proc.returncode, proc.returncode]
        assert signalled == [] and seen == [None, None]  # not seen by the wait loop yet: not reaped, nothing signalled
        assert ctx.wait() == 0 and proc.returncode == 0
        assert signalled == [(proc.popen.pid, signal.SIGKILL)]
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child)
    finally:
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)


# --------------------------------------------------------------------------------------------
# run_job with a fake backend: what every launcher gets from the job runner


class FakeBackend(Backend):
    """Runs the given local processes; records what run_job asked of it."""

    title = "fake launcher"

    def __init__(self, spec: JobSpec, planned: list[Planned], fail_start: bool = False):
        super().__init__(spec)
        self.planned, self.fail_start = planned, fail_start
        self.calls: list[str] = []
        self.started: list[Proc] = []

    def processes(self, port: Optional[int]) -> list[Planned]:
        return self.planned

    def prepare(self) -> None:
        self.calls.append("prepare")

    def start(self, ctx: ProcessContext, port: Optional[int]) -> None:
        self.calls.append(f"start port={port}")
        super().start(ctx, port)
        self.started = list(ctx.procs)
        if self.fail_start:
            raise LaunchError("the cluster said no")

    def cancel(self, ctx: ProcessContext) -> None:
        self.calls.append("cancel")

    def close(self, status: Optional[int]) -> None:
        self.calls.append(f"close {status}")


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _spec(timeout: Optional[float] = None, dry_run: bool = False) -> JobSpec:
    return JobSpec(2, 1, ["unused"], timeout=timeout, dry_run=dry_run)


SLEEP = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"


def test_run_job_success_waits_for_main_then_helpers(capsys: pytest.CaptureFixture[str]) -> None:
    planned = [
        Planned("server 0", _py("import time; time.sleep(0.5); print('served')")),
        Planned("worker 0", _py("print('hello', flush=True)"), {"X_FROM_PLAN": "x"}, main=True),
        Planned("worker 1", _py("import os; print(os.environ['X_FROM_PLAN'])"), {"X_FROM_PLAN": "y"}, main=True),
    ]
    backend = FakeBackend(_spec(), planned)
    assert run_job(backend.spec, backend) == 0
    out = capsys.readouterr().out
    assert "[worker 0] hello" in out and "[worker 1] y" in out and "[server 0] served" in out
    assert backend.calls == ["prepare", "start port=None", "close 0"]  # no scheduler here: address None


def test_run_job_first_failure_cancels_stops_the_rest_and_is_the_status(capsys: pytest.CaptureFixture[str]) -> None:
    planned = [
        Planned("server 0", _py(SLEEP)),
        Planned("worker 0", _py(SLEEP), main=True),
        Planned("worker 1", _py("import sys, time; time.sleep(1); print('giving up', file=sys.stderr); sys.exit(5)"), main=True),
    ]
    backend = FakeBackend(_spec(), planned)
    assert run_job(backend.spec, backend) == 5
    err = capsys.readouterr().err
    assert "worker 1 exited with status 5; stopped the other processes of the job" in err and "    giving up" in err
    assert backend.calls == ["prepare", "start port=None", "cancel", "close 5"]
    assert [p.returncode for p in backend.started] == [-15, -15, 5]  # server 0, workers 0, 1: SIGTERM to the others


def test_run_job_timeout_is_124(capsys: pytest.CaptureFixture[str]) -> None:
    backend = FakeBackend(_spec(timeout=1), [Planned("worker 0", _py(SLEEP), main=True)])
    assert run_job(backend.spec, backend) == 124
    assert "the job ran past its time limit of 1 s; stopped it" in capsys.readouterr().err
    assert backend.calls == ["prepare", "start port=None", "cancel", "close 124"]


def test_run_job_error_while_starting_stops_what_started(capsys: pytest.CaptureFixture[str]) -> None:
    backend = FakeBackend(_spec(), [Planned("worker 0", _py(SLEEP), main=True)], fail_start=True)
    with pytest.raises(LaunchError, match="the cluster said no"):
        run_job(backend.spec, backend)
    assert len(backend.started) == 1 and backend.started[0].returncode is not None  # stopped, reaped
    assert backend.calls == ["prepare", "start port=None", "cancel", "close None"]


def test_run_job_dry_run_prints_the_plan_and_starts_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    backend = FakeBackend(_spec(dry_run=True), [Planned("worker 0", ["prog", "a b"], {"K": "v w"}, main=True)])
    backend.address = "10.1.1.1"
    assert run_job(backend.spec, backend) == 0
    assert capsys.readouterr().out == (
        "# fake launcher\nscheduler here, bound to 10.1.1.1 (its port replaces DMLC_PS_ROOT_PORT=0 below)\n"
        "worker 0: 'K=v w' prog 'a b'\n"
    )
    assert backend.calls == ["close 0"]


def test_a_line_of_the_program_naming_another_worker_does_not_take_the_blame(capsys: pytest.CaptureFixture[str]) -> None:
    """Worker 0 fails first (5) after printing a line of its own that names worker 1, which then fails as
    its victim (1): the status and the report are worker 0's (only a pskv error naming a node waits for it)."""
    ctx = ProcessContext()
    ctx.start("worker 0", _py("import sys; print('worker 1 looks slow; giving up', flush=True); sys.exit(5)"), {}, main=True)
    ctx.start("worker 1", _py("import time; time.sleep(1.5); raise SystemExit(1)"), {}, main=True)
    assert ctx.wait() == 5
    assert "worker 0 exited with status 5; stopped the other processes of the job" in capsys.readouterr().err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP])
def test_a_signal_while_a_process_starts_stops_that_process_too(monkeypatch: pytest.MonkeyPatch, signum: int) -> None:
    """The signal comes inside Popen, after the fork (where Ctrl-C during a big job's start lands): the new
    process was left running, unknown to the launcher. Now it is stopped with the rest; SIGHUP is handled too."""
    started: list[subprocess.Popen[bytes]] = []

    def popen(*args: Any, **kw: Any) -> subprocess.Popen[bytes]:
        started.append(real(*args, **kw))
        signal.raise_signal(signum)  # its handler runs here, before Popen returns
        return started[-1]

    real = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", popen)
    backend = FakeBackend(_spec(), [Planned("worker 0", _py(SLEEP), main=True), Planned("worker 1", _py(SLEEP), main=True)])
    before = signal.signal(signum, signal.SIG_DFL)  # as from a terminal (under nohup the launcher leaves SIGHUP ignored)
    try:
        with pytest.raises(SystemExit) as exc:
            run_job(backend.spec, backend)
        assert exc.value.code == 128 + signum
        assert len(started) == 1 and started[0].poll() is not None  # stopped, and worker 1 never started
    finally:
        signal.signal(signum, before)
        for p in started:
            p.kill()
            p.wait()


def test_a_launcher_started_with_nohup_keeps_the_job_when_the_terminal_goes() -> None:
    """nohup sets SIGHUP to SIG_IGN: the launcher must leave it so (it stopped the job, status 129)."""
    import os
    import time
    from pathlib import Path

    cmd = [sys.executable, "-m", "pskv", "launch", "-n", "1", "-s", "0", "--", *_py("import time; time.sleep(3); print('done')")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).resolve().parents[2],
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # fmt: skip
    time.sleep(1.5)
    os.kill(p.pid, signal.SIGHUP)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and "done" in out, out


def test_more_processes_than_open_files_is_a_clear_error() -> None:
    """-n 200 under a 256 open-file limit: one line naming the process that could not start (was a traceback)."""
    import resource
    from pathlib import Path

    res = subprocess.run(
        [sys.executable, "-m", "pskv", "launch", "-n", "200", "-s", "0", "--", "sleep", "30"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)),
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "pskv launch: cannot start process " in res.stderr and "Too many open files; stopped the others" in res.stderr
    assert "Traceback" not in res.stderr
