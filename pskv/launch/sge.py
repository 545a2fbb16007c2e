"""``pskv launch --launcher sge``: servers and workers as two Grid Engine array jobs.

The scheduler runs here. Each role becomes one array job, submitted from the working directory
(which the execution hosts must share, as usual with Grid Engine)::

    qsub -terse -cwd -V -S /bin/sh -N NAME-worker -t 1-W -j y -o DIR [--launcher-args] DIR/worker.sh

``DIR`` is a new ``.pskv-sge-*`` directory in the working directory; ``worker.sh`` exports the
job's ``DMLC_*`` variables (in the script, not with ``qsub -v``, whose commas would split
values) and runs ``python3 -m pskv.launch.guard --rank-from SGE_TASK_ID --rank-offset 1
--prefix 'worker {rank}' --status-dir DIR -- COMMAND``. The launcher follows the tasks' output
files (their lines are prefixed by the guard) and their status files: the first task that fails
stops the job at once (``qdel`` of both arrays, then the scheduler), naming it. A task that
ends without a status (deleted, killed by a limit) or a job in an error state fails the job too.
The guard runs as the job script's process (a session leader), so ``qdel``, which kills the
job's process group, reaches the command and all it started.

A parallel-environment job would need ``qrsh -inherit`` on every host; array jobs need nothing
beyond ``qsub``, so that is what this launcher uses.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Optional

from ..errors import LaunchError
from .common import (
    Follower,
    JobSpec,
    base_env,
    export_lines,
    finish_timeout,
    guard_argv,
    print_plan,
    require_tool,
    role_env,
    run_quiet,
    scheduler_address,
    start_guarded_scheduler,
    supervise,
)
from .process import ProcessContext, Watched

#: how long the scheduler here waits for queued tasks to register, unless PSKV_START_TIMEOUT says
QUEUE_START_TIMEOUT = "3600"
#: seconds a task may lack a status file after its job left qstat (shared file systems lag)
STATUS_GRACE = 10.0


def role_script(spec: JobSpec, role: str, env: Mapping[str, str], workdir: str) -> str:
    cmd = spec.serve_argv() if role == "server" else spec.worker_argv()
    guard = guard_argv(spec.python, rank_from=["SGE_TASK_ID"], rank_offset=1, prefix=f"{role} {{rank}}", status_dir=workdir)
    return (
        "#!/bin/sh\n"
        f"# pskv launch --launcher sge: the {role}s of job {spec.name} (task i is {role} i-1)\n"
        + export_lines(env)
        + f"exec {shlex.join([*guard, '--', *cmd])}\n"
    )


def qsub_argv(spec: JobSpec, qsub: str, role: str, script: str, workdir: str) -> list[str]:
    return [
        qsub,
        "-terse",
        "-cwd",
        "-V",
        "-S",
        "/bin/sh",
        "-N",
        f"{spec.name}-{role}",
        "-t",
        f"1-{spec.count(role)}",
        "-j",
        "y",
        "-o",
        workdir,
        *spec.launcher_args,
        script,
    ]


class Task:
    """One array task, watched through the status file its guard writes."""

    def __init__(self, role: str, rank: int, workdir: str, jobs: JobWatch):
        self.role, self.rank = role, rank
        self.workdir = workdir
        self.jobs = jobs
        self.name = f"{role} {rank}"
        self.status_path = os.path.join(workdir, f"{role}.{rank}.status")
        self._code: Optional[int] = None

    @property
    def returncode(self) -> Optional[int]:
        if self._code is None:
            try:
                with open(self.status_path) as f:
                    text = f.read().strip()
                if text:
                    self._code = int(text)
            except (OSError, ValueError):
                pass
        if self._code is None:
            lost = self.jobs.lost(self.role)
            if lost:
                self.name = f"{self.role} {self.rank} ({lost})"
                self._code = 137
        return self._code

    @property
    def tail(self) -> list[str]:
        job = self.jobs.ids.get(self.role, "")
        lines: list[str] = []
        for path in glob.glob(os.path.join(self.workdir, f"*.o{job}.{self.rank + 1}")):
            with open(path, errors="replace") as f:
                lines += [line.rstrip("\n") for line in f if line.strip()]
        return lines[-20:]


class JobWatch(threading.Thread):
    """Polls ``qstat`` every 2 s: which of our jobs are still listed, and in which state."""

    def __init__(self, qstat: str, environ: Mapping[str, str]):
        super().__init__(daemon=True, name="pskv-qstat")
        self.qstat = qstat
        self.environ = environ
        self.ids: dict[str, str] = {}  # role -> job id
        self._gone_since: dict[str, float] = {}
        self._error: dict[str, str] = {}
        self._stop = threading.Event()

    def poll(self) -> None:
        res = run_quiet([self.qstat], timeout=60, env=self.environ)
        if res.returncode != 0:
            return
        listed: dict[str, str] = {}
        for line in res.stdout.splitlines()[2:]:
            fields = line.split()
            if len(fields) >= 5:
                listed.setdefault(fields[0], "")
                listed[fields[0]] += fields[4]
        now = time.monotonic()
        for role, job in self.ids.items():
            if job in listed:
                self._gone_since.pop(role, None)
                if "E" in listed[job]:
                    self._error[role] = f"Grid Engine job {job} is in an error state; `qstat -j {job}` says why"
            else:
                self._gone_since.setdefault(role, now)

    def lost(self, role: str) -> str:
        """Why the tasks of ``role`` without a status will never have one ('' while they may)."""
        if role in self._error:
            return self._error[role]
        since = self._gone_since.get(role)
        if since is not None and time.monotonic() - since > STATUS_GRACE:
            return f"Grid Engine job {self.ids[role]} ended without its status: deleted, or killed by a limit"
        return ""

    def run(self) -> None:
        while not self._stop.wait(2.0):
            with contextlib.suppress(LaunchError):
                self.poll()

    def stop(self) -> None:
        self._stop.set()


def launch_sge(spec: JobSpec) -> int:
    """Run the job on Grid Engine; the exit status."""
    qsub = require_tool("qsub", "sge", "run it on a Grid Engine submit host")
    qdel = shutil.which("qdel") or "qdel"
    qstat = shutil.which("qstat") or "qstat"
    roles = [r for r in ("server", "worker") if spec.count(r)]
    root_uri = scheduler_address(spec.environ)
    cwd = os.getcwd()
    workdir = tempfile.mkdtemp(prefix=".pskv-sge-", dir=cwd)
    jobs = JobWatch(qstat, spec.environ)
    ctx = ProcessContext()
    follower = Follower(lambda: sorted(glob.glob(os.path.join(workdir, "*.o*"))), sys.stdout)

    def write_scripts(port: Optional[int]) -> dict[str, str]:
        base = base_env(spec, root_uri, port)
        scripts = {}
        for role in roles:
            path = os.path.join(workdir, f"{role}.sh")
            with open(path, "w") as f:
                f.write(role_script(spec, role, role_env(spec, base, role), workdir))
            os.chmod(path, 0o755)
            scripts[role] = path
        return scripts

    if spec.dry_run:
        scripts = write_scripts(0 if spec.num_servers else None)
        if spec.num_servers:
            print_plan("scheduler", f"here, bound to {root_uri} (its port replaces DMLC_PS_ROOT_PORT=0 below)")
        for role, path in scripts.items():
            with open(path) as f:
                print_plan(f"{role} script {path}", f.read())
            print_plan("submit", shlex.join(qsub_argv(spec, qsub, role, path, workdir)))
        shutil.rmtree(workdir, ignore_errors=True)
        return 0

    def cancel() -> None:
        ids = list(jobs.ids.values())
        if not ids:
            return
        run_quiet([qdel, *ids], timeout=60, env=spec.environ)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the execution hosts have stopped the tasks
            res = run_quiet([qstat], timeout=60, env=spec.environ)
            listed = {line.split()[0] for line in res.stdout.splitlines()[2:] if line.strip()}
            if res.returncode != 0 or not listed & set(ids):
                break
            time.sleep(0.5)
        ctx.report(f"deleted Grid Engine job(s) {' '.join(ids)}")

    ctx.on_stop.append(cancel)

    def body() -> int:
        extra = {} if spec.environ.get("PSKV_START_TIMEOUT") else {"PSKV_START_TIMEOUT": QUEUE_START_TIMEOUT}
        started, port = start_guarded_scheduler(ctx, spec, root_uri, extra)
        helpers: list[Watched] = list(started)
        scripts = write_scripts(port)
        for role in roles:
            res = run_quiet(qsub_argv(spec, qsub, role, scripts[role], workdir), timeout=120, env=spec.environ)
            job = res.stdout.strip().split(".")[0]
            if res.returncode != 0 or not job.isdigit():
                raise LaunchError(f"qsub of the {role}s failed: {(res.stderr + res.stdout).strip()}")
            jobs.ids[role] = job
        ctx.report(
            "submitted Grid Engine job(s) " + ", ".join(f"{jobs.ids[r]} ({spec.count(r)} {r}{'s' if spec.count(r) > 1 else ''})" for r in roles)
        )
        jobs.start()
        follower.start()
        tasks = {r: [Task(r, i, workdir, jobs) for i in range(spec.count(r))] for r in roles}
        main = tasks.get("worker", [])
        return ctx.wait(main, [*helpers, *tasks.get("server", [])], finish_timeout=finish_timeout(), timeout=spec.timeout)

    try:
        status = supervise(ctx, body)
    finally:
        jobs.stop()
        follower.finish()
    if status == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        ctx.report(f"the job scripts and the tasks' output are in {workdir}")
    return status
