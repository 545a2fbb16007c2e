"""``pskv launch --launcher slurm``: inside an allocation with ``srun``, or submitted with ``sbatch``.

Inside an allocation (``SLURM_JOB_ID`` is set: ``salloc ... pskv launch``, or a batch script):
the scheduler runs here, then one job step per role, at the same time::

    srun --overlap --ntasks=S --kill-on-bad-exit=1 --job-name=NAME-server --export=ALL \\
        python3 -m pskv.launch.guard --rank-from SLURM_PROCID --prefix 'server {rank}' -- python3 -m pskv serve
    srun --overlap --ntasks=W ... --prefix 'worker {rank}' -- COMMAND

with the job's ``DMLC_*`` variables in srun's environment (``--export=ALL`` carries them, with
no trouble over commas in values). ``--overlap`` lets the two steps share the allocation's CPUs
(without it the second step waits for the first to end). A failing task ends its step
(``--kill-on-bad-exit``); the launcher then stops the other step and the scheduler.

Outside an allocation it writes a batch script that runs this same launcher inside the job, and
submits it with ``sbatch --wait`` (``--ntasks`` = servers + workers; ``-H`` asks for those
nodes), streaming the job's output file while it runs; Ctrl-C or a failure ``scancel``s it.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping

from ..errors import LaunchError
from .common import (
    Follower,
    JobSpec,
    base_env,
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
from .process import Proc, ProcessContext


def in_allocation(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID", "").strip())


def allocation_nodes(environ: Mapping[str, str]) -> list[str]:
    """The allocation's node names (``SLURM_JOB_NODELIST`` expanded by ``scontrol``)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    if not nodelist:
        return []
    if not re.search(r"[\[\]]", nodelist):
        return [n for n in nodelist.split(",") if n]
    scontrol = shutil.which("scontrol")
    if scontrol:
        res = run_quiet([scontrol, "show", "hostnames", nodelist], timeout=30)
        if res.returncode == 0:
            return res.stdout.split()
    return []


def srun_argv(spec: JobSpec, srun: str, role: str) -> list[str]:
    cmd = spec.serve_argv() if role == "server" else spec.worker_argv()
    return [
        srun,
        "--overlap",
        f"--ntasks={spec.count(role)}",
        "--kill-on-bad-exit=1",
        f"--job-name={spec.name}-{role}",
        "--export=ALL",
        *spec.launcher_args,
        *guard_argv(spec.python, rank_from=["SLURM_PROCID"], prefix=f"{role} {{rank}}"),
        "--",
        *cmd,
    ]


def launch_in_allocation(spec: JobSpec) -> int:
    srun = require_tool("srun", "slurm")
    if spec.hosts:
        raise LaunchError("inside a Slurm allocation the nodes are the allocation's; -H/--hostfile is for submitting")
    root_uri = scheduler_address(spec.environ, allocation_nodes(spec.environ))
    roles = [r for r in ("server", "worker") if spec.count(r)]
    if spec.dry_run:
        base = base_env(spec, root_uri, 0 if spec.num_servers else None)
        lines = [f"scheduler here, bound to {root_uri} (its port replaces DMLC_PS_ROOT_PORT=0 below)"] if spec.num_servers else []
        for role in roles:
            env = role_env(spec, base, role)
            lines.append(f"{' '.join(f'{k}={shlex.quote(v)}' for k, v in env.items())} {shlex.join(srun_argv(spec, srun, role))} &")
        print_plan(f"pskv launch --launcher slurm, inside allocation {spec.environ.get('SLURM_JOB_ID')}", "\n".join(lines))
        return 0
    ctx = ProcessContext()

    def body() -> int:
        helpers, port = start_guarded_scheduler(ctx, spec, root_uri)
        base = base_env(spec, root_uri, port)
        main: list[Proc] = []
        for role in roles:
            env = {**spec.environ, **role_env(spec, base, role)}
            proc = ctx.start(f"srun {role}s", role, srun_argv(spec, srun, role), env, show="raw")
            (main if role == "worker" else helpers).append(proc)
        return ctx.wait(main, helpers, finish_timeout=finish_timeout(), timeout=spec.timeout)

    return supervise(ctx, body)


# --------------------------------------------------------------------------------------------
# sbatch


def inner_command(spec: JobSpec) -> list[str]:
    """``pskv launch --launcher slurm ...`` as the batch script runs it inside the job."""
    argv = [spec.python, "-m", "pskv", "launch", "--launcher", "slurm", "-n", str(spec.num_workers), "-s", str(spec.num_servers)]
    argv += ["--python", spec.python, "--job-name", spec.name]
    if spec.timeout is not None:
        argv += ["--timeout", f"{spec.timeout:g}"]
    for flag, env in (("--env", spec.env), ("--env-server", spec.role_env["server"]), ("--env-worker", spec.role_env["worker"])):
        for k, v in env.items():
            argv += [flag, f"{k}:{v}"]
    return [*argv, "--", *spec.command]


def batch_script(spec: JobSpec, output: str, cwd: str) -> str:
    lines = [
        "#!/bin/sh",
        f"#SBATCH --job-name={spec.name}",
        f"#SBATCH --ntasks={spec.num_workers + spec.num_servers}",
        f"#SBATCH --output={output}",
    ]
    if spec.hosts:
        nodes = [h.name for h in spec.hosts]
        lines += [f"#SBATCH --nodes={len(nodes)}", f"#SBATCH --nodelist={','.join(nodes)}"]
    if spec.timeout is not None:
        lines.append(f"#SBATCH --time={math.ceil(spec.timeout / 60) + 1}")
    lines += [
        "# written by pskv launch --launcher slurm: the launcher runs again inside the allocation",
        f"cd {shlex.quote(cwd)} || exit 1",
        f"exec {shlex.join(inner_command(spec))}",
    ]
    return "\n".join(lines) + "\n"


def launch_batch(spec: JobSpec) -> int:
    sbatch = require_tool("sbatch", "slurm", "run it where Slurm's client commands are installed")
    cwd = os.getcwd()
    workdir = tempfile.mkdtemp(prefix=".pskv-slurm-", dir=cwd)
    output = os.path.join(workdir, "job.out")
    script = os.path.join(workdir, "job.sh")
    with open(script, "w") as f:
        f.write(batch_script(spec, output, cwd))
    argv = [sbatch, "--wait", "--parsable", *spec.launcher_args, script]
    if spec.dry_run:
        with open(script) as f:
            print_plan(f"batch script {script}", f.read())
        print_plan("submit", shlex.join(argv))
        shutil.rmtree(workdir, ignore_errors=True)
        return 0
    ctx = ProcessContext()
    follower = Follower(lambda: [output], sys.stdout)
    job_id: list[str] = []

    def cancel() -> None:
        scancel = shutil.which("scancel")
        if scancel is None:
            return
        target = job_id or [f"--name={spec.name}"]
        run_quiet([scancel, *target], timeout=60, env=spec.environ)
        ctx.report(f"cancelled Slurm job {' '.join(job_id) or spec.name}")

    ctx.on_stop.append(cancel)

    def body() -> int:
        proc = ctx.start("sbatch", "sbatch", argv, spec.environ, show="tail")
        follower.start()
        deadline = time.monotonic() + 60
        while not job_id and proc.returncode is None and time.monotonic() < deadline:
            ids = [line.split(";")[0] for line in proc.tail if line.split(";")[0].strip().isdigit()]
            if ids:
                job_id.append(ids[0].strip())
                ctx.report(f"submitted Slurm job {job_id[0]} ({spec.num_servers} server(s), {spec.num_workers} worker(s)); its output follows")
                break
            time.sleep(0.05)
        timeout = None if spec.timeout is None else spec.timeout + 600  # queueing time on top
        return ctx.wait([proc], [], timeout=timeout)

    try:
        status = supervise(ctx, body)
    finally:
        follower.finish()
    if status == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        ctx.report(f"the batch script and the job's output are in {workdir}")
    return status


def launch_slurm(spec: JobSpec) -> int:
    """Run the job on Slurm; the exit status."""
    if in_allocation(spec.environ):
        return launch_in_allocation(spec)
    return launch_batch(spec)
