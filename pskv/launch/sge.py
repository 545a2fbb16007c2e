"""``pskv launch --launcher sge``: servers and workers as two Grid Engine array jobs, watched through
the status files their guards write (docs/launchers/sge.md shows the scripts and commands)."""

from __future__ import annotations

import contextlib
import glob
import os
import shlex
import time
from typing import Optional

from ..errors import LaunchError
from .job import Backend, ProcessContext, Spool, require_tool, run_quiet, write_private
from .spec import JobSpec, export_lines, scheduler_address

#: seconds a task may lack a status file after its job left qstat (shared file systems lag)
STATUS_GRACE = 10.0


class Task:
    """One array task, watched through the status file its guard writes."""

    def __init__(self, sge: Sge, role: str, rank: int):
        self.sge, self.role, self.rank = sge, role, rank
        self.name = f"{role} {rank}"
        self.code: Optional[int] = None

    @property
    def returncode(self) -> Optional[int]:
        if self.code is None:
            with contextlib.suppress(OSError, ValueError), open(self.sge.spool.path(f"{self.role}.{self.rank}.status")) as f:
                self.code = int(f.read())
        if self.code is None and (lost := self.sge.lost(self.role)):
            self.name, self.code = f"{self.role} {self.rank} ({lost})", 137
        return self.code

    @property
    def tail(self) -> list[str]:
        lines: list[str] = []
        for path in glob.glob(self.sge.spool.path(f"*.o{self.sge.ids.get(self.role, '')}.{self.rank + 1}")):
            with open(path, errors="replace") as f:
                lines += [line.rstrip("\n") for line in f if line.strip()]
        return lines[-20:]


class Sge(Backend):
    queued = True

    def __init__(self, spec: JobSpec):
        super().__init__(spec)
        if any(c.isspace() or c in "/:@\\*?" for c in spec.name):  # (qsub said "Error reading answer list")
            raise LaunchError(f"--job-name {spec.name!r}: Grid Engine takes no spaces or / : @ \\ * ? in a job name")
        self.qsub = require_tool("qsub", "sge", "run it on a Grid Engine submit host")
        self.address = scheduler_address(spec.environ)
        self.spool = Spool(".pskv-sge-", "*.o*")
        self.title = f"pskv launch --launcher sge: {spec.num_servers} server(s), {spec.num_workers} worker(s)"
        self.ids: dict[str, str] = {}  # role -> its array job's id
        self.gone_since: dict[str, float] = {}  # role -> when qstat stopped listing its job
        self.errors: dict[str, str] = {}  # role -> why its job is in an error state
        self.next_poll = 0.0

    def submissions(self, port: Optional[int]) -> dict[str, list[str]]:
        """Write each role's job script; the ``qsub`` command of each."""
        spec = self.spec
        out, secret_file = {}, {}
        if spec.secret:  # a file only this user reads, in the job's private directory
            secret_file["PSKV_SECRET_FILE"] = self.spool.path("secret")
            write_private(secret_file["PSKV_SECRET_FILE"], spec.secret + "\n")
        for role in spec.roles():
            path = self.spool.path(f"{role}.sh")
            rank = ["--rank-from", "SGE_TASK_ID", "--rank-offset", "1"]
            guarded = spec.guarded(role, *rank, "--prefix", f"{role} {{rank}}", "--status-dir", self.spool.dir)
            with open(path, "w") as f:
                f.write(f"#!/bin/sh\n# pskv launch --launcher sge: the {role}s of job {spec.name} (task i is {role} i-1)\n")
                f.write(export_lines({**spec.process_env(role, self.address, port), **secret_file}))
                f.write(f"exec {shlex.join(guarded)}\n")
            os.chmod(path, 0o755)
            qsub = [self.qsub, "-terse", "-cwd", "-V", "-S", "/bin/sh", "-N", f"{spec.name}-{role}", "-t", f"1-{spec.count(role)}"]
            out[role] = [*qsub, "-j", "y", "-o", self.spool.dir, *spec.launcher_args, path]
        return out

    def plan(self, port: Optional[int]) -> str:
        text = ""
        for role, qsub in self.submissions(port).items():
            with open(qsub[-1]) as f:
                text += f"# {role} script {qsub[-1]}\n{f.read()}# submit\n{shlex.join(qsub)}\n"
        return text

    def start(self, ctx: ProcessContext, port: Optional[int]) -> None:
        spec = self.spec
        for role, qsub in self.submissions(port).items():
            res = run_quiet(qsub, timeout=120)
            job = res.stdout.strip().split(".")[0]
            if res.returncode != 0 or not job.isdigit():
                raise LaunchError(f"qsub of the {role}s failed: {(res.stderr + res.stdout).strip()}")
            self.ids[role] = job
        jobs = [f"{self.ids[r]} ({spec.count(r)} {r}{'s' if spec.count(r) > 1 else ''})" for r in spec.roles()]
        ctx.report("submitted Grid Engine job(s) " + ", ".join(jobs))
        self.spool.start()
        for role in spec.roles():
            for rank in range(spec.count(role)):
                ctx.watch(Task(self, role, rank), main=role == "worker")

    def listed(self) -> dict[str, str]:
        """Job id -> the states of its tasks, as ``qstat`` lists them; :class:`LaunchError` if it fails."""
        res = run_quiet(["qstat"], timeout=60)
        if res.returncode != 0:
            raise LaunchError(f"qstat failed: {res.stderr.strip()}")
        states: dict[str, str] = {}
        for fields in (line.split() for line in res.stdout.splitlines()[2:]):
            if len(fields) >= 5:
                states[fields[0]] = states.get(fields[0], "") + fields[4]
        return states

    def lost(self, role: str) -> str:
        """Why the tasks of ``role`` without a status will never have one ('' while they may);
        ``qstat`` is asked at most every 2 s."""
        now = time.monotonic()
        if now >= self.next_poll:
            self.next_poll = now + 2.0
            with contextlib.suppress(LaunchError):  # qstat failed: nothing is known gone
                listed = self.listed()
                for r, job in self.ids.items():
                    if job in listed:
                        self.gone_since.pop(r, None)
                    else:
                        self.gone_since.setdefault(r, now)
                    if "E" in listed.get(job, ""):
                        self.errors[r] = f"Grid Engine job {job} is in an error state; `qstat -j {job}` says why"
        since = self.gone_since.get(role)
        if role not in self.errors and since is not None and now - since > STATUS_GRACE:
            return f"Grid Engine job {self.ids[role]} ended without its status: deleted, or killed by a limit"
        return self.errors.get(role, "")

    def cancel(self, ctx: ProcessContext) -> None:
        ids = list(self.ids.values())
        if not ids:
            return
        run_quiet(["qdel", *ids], timeout=60)
        deadline = time.monotonic() + 60
        with contextlib.suppress(LaunchError):  # until the execution hosts have stopped the tasks (qstat failed: no use)
            while time.monotonic() < deadline and set(self.listed()) & set(ids):
                time.sleep(0.5)
        ctx.report(f"deleted Grid Engine job(s) {' '.join(ids)}")

    def close(self, status: Optional[int]) -> None:
        self.spool.close(status, "the job scripts and the tasks' output")
