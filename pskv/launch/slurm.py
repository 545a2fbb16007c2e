"""``pskv launch --launcher slurm``: inside an allocation one ``srun`` step per role, outside one a
batch script that runs this launcher again, submitted with ``sbatch --wait`` (docs/launchers/slurm.md)."""

from __future__ import annotations

import math
import os
import shlex
import shutil
import time
from collections.abc import Mapping
from typing import Optional, cast

from ..errors import LaunchError
from .job import Backend, Planned, Proc, ProcessContext, Spool, require_tool, run_quiet
from .spec import JobSpec, scheduler_address


def allocation_nodes(environ: Mapping[str, str]) -> list[str]:
    """The allocation's node names (``SLURM_JOB_NODELIST``, expanded by ``scontrol``)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    if "[" not in nodelist:
        return [n for n in nodelist.split(",") if n]
    scontrol = shutil.which("scontrol")
    res = run_quiet([scontrol, "show", "hostnames", nodelist], timeout=30) if scontrol else None
    return res.stdout.split() if res and res.returncode == 0 else []


class Srun(Backend):
    """Inside an allocation: one ``srun`` step per role."""

    def __init__(self, spec: JobSpec):
        super().__init__(spec)
        self.srun = require_tool("srun", "slurm")
        if spec.hosts:
            raise LaunchError("inside a Slurm allocation the nodes are the allocation's; -H/--hostfile is for submitting")
        self.address = scheduler_address(spec.environ, allocation_nodes(spec.environ))
        self.title = f"pskv launch --launcher slurm, inside allocation {spec.environ.get('SLURM_JOB_ID')}"

    def processes(self, port: Optional[int]) -> list[Planned]:
        spec = self.spec
        out = []
        for role in spec.roles():
            argv = [self.srun, "--overlap", f"--ntasks={spec.count(role)}", "--kill-on-bad-exit=1", f"--job-name={spec.name}-{role}"]
            argv += ["--export=ALL", *spec.launcher_args, *spec.guarded(role, "--rank-from", "SLURM_PROCID", "--prefix", f"{role} {{rank}}")]
            env = spec.process_env(role, self.address, port)
            out.append(Planned(f"srun {role}s", argv, env, main=role == "worker", show="raw"))
        return out


class Sbatch(Backend):
    """Outside an allocation: a batch script that runs this launcher again inside the job."""

    slack = 600.0  # time in the queue, on top of --timeout
    merges = False

    def __init__(self, spec: JobSpec):
        super().__init__(spec)
        self.sbatch = require_tool("sbatch", "slurm", "run it where Slurm's client commands are installed")
        self.spool = Spool(".pskv-slurm-", "job.out")
        self.script = self.spool.path("job.sh")
        with open(self.script, "w") as f:
            f.write(self.batch_script())
        self.argv = [self.sbatch, "--wait", "--parsable", *spec.launcher_args, self.script]
        self.job_id, self.proc = "", cast(Optional[Proc], None)  # (sbatch)
        self.title = f"batch script {self.script}"

    def batch_script(self) -> str:
        spec = self.spec
        inner = [spec.python, "-m", "pskv", "launch", "--launcher", "slurm", "-n", str(spec.num_workers), "-s", str(spec.num_servers)]
        inner += ["--python", spec.python, "--job-name", spec.name]
        inner += ["--timeout", f"{spec.timeout:g}"] if spec.timeout is not None else []
        for flag, env in (("--env", spec.env), ("--env-server", spec.role_env["server"]), ("--env-worker", spec.role_env["worker"])):
            inner += [a for k, v in env.items() for a in (flag, f"{k}:{v}")]
        lines = ["#!/bin/sh", f"#SBATCH --job-name={shlex.quote(spec.name)}", f"#SBATCH --ntasks={spec.num_workers + spec.num_servers}"]
        lines.append(f"#SBATCH --output={shlex.quote(self.spool.path('job.out'))}")
        if spec.hosts:
            lines += [f"#SBATCH --nodes={len(spec.hosts)}", f"#SBATCH --nodelist={','.join(h.name for h in spec.hosts)}"]
        if spec.timeout is not None:
            lines.append(f"#SBATCH --time={math.ceil(spec.timeout / 60) + 1}")
        lines.append("# written by pskv launch --launcher slurm: the launcher runs again inside the allocation")
        lines += [f"cd {shlex.quote(os.getcwd())} || exit 1", f"exec {shlex.join([*inner, '--', *spec.command])}"]
        return "\n".join(lines) + "\n"

    def plan(self, port: Optional[int]) -> str:
        return f"{self.batch_script()}# submit\n{shlex.join(self.argv)}"

    def start(self, ctx: ProcessContext, port: Optional[int]) -> None:
        proc = self.proc = ctx.start("sbatch", self.argv, self.spec.environ, show="tail", main=True)
        self.spool.start()
        deadline = time.monotonic() + 60
        while not self.job_id and proc.popen.poll() is None and time.monotonic() < deadline:  # (before the wait loop reaps)
            ids = [line.split(";")[0].strip() for line in proc.tail]  # --parsable: "JOBID[;CLUSTER]"
            self.job_id = next((i for i in ids if i.isdigit()), "")
            time.sleep(0.05)
        if self.job_id:
            jobs = f"{self.spec.num_servers} server(s), {self.spec.num_workers} worker(s)"
            ctx.report(f"submitted Slurm job {self.job_id} ({jobs}); its output follows")

    def cancel(self, ctx: ProcessContext) -> None:
        if not self.job_id and self.proc is not None and self.proc.returncode is not None:  # sbatch ended without a job id: it submitted none
            return
        if (scancel := shutil.which("scancel")) is not None:
            run_quiet([scancel, self.job_id or f"--name={self.spec.name}"], timeout=60)
            ctx.report(f"cancelled Slurm job {self.job_id or self.spec.name}")

    def close(self, status: Optional[int]) -> None:
        self.spool.close(status, "the batch script and the job's output")


def backend(spec: JobSpec) -> Backend:
    return Srun(spec) if spec.environ.get("SLURM_JOB_ID", "").strip() else Sbatch(spec)
