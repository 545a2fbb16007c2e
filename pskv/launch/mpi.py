"""``pskv launch --launcher mpi``: servers and workers as the two app contexts of one ``mpirun``.

The scheduler runs here. One MPMD command starts the rest::

    mpirun [--launcher-args] --hostfile H -np S -x DMLC_ROLE=server -x ... \\
        python3 -m pskv.launch.guard --rank-from OMPI_COMM_WORLD_RANK,PMI_RANK --prefix 'server {rank}' \\
        -- python3 -m pskv serve \\
      : -np W -x DMLC_ROLE=worker -x ... \\
        python3 -m pskv.launch.guard --rank-from OMPI_COMM_WORLD_RANK,PMI_RANK --rank-offset S \\
        --prefix 'worker {rank}' -- COMMAND

MPI numbers the processes through the contexts in order, so the guard turns the world rank into
``DMLC_SERVER_ID`` / ``DMLC_WORKER_ID``; it also prefixes every line (mpirun merges everyone's
output). Open MPI takes ``-x NAME=VALUE`` and ``--hostfile`` (lines ``host slots=N``); MPICH's
hydra (``mpirun --version`` says HYDRA) takes ``-env NAME VALUE`` and ``-f`` (lines ``host:N``);
the hostfile is rewritten in the flavour's format. When a process fails, mpirun stops the
others and exits with its status; the launcher then stops the scheduler.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from collections.abc import Mapping, Sequence
from typing import Optional

from ..errors import LaunchError
from .common import (
    Host,
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
from .process import ProcessContext

RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def mpi_flavor(mpirun: str) -> str:
    """``"openmpi"`` or ``"mpich"`` (hydra: MPICH, Intel MPI, MVAPICH), from ``mpirun --version``."""
    res = run_quiet([mpirun, "--version"], timeout=60)
    text = res.stdout + res.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text.upper() or "MPICH" in text.upper() or "Intel(R) MPI" in text:
        return "mpich"
    return "openmpi"


def hostfile_text(hosts: Sequence[Host], flavor: str) -> str:
    for h in hosts:
        if h.port is not None:
            raise LaunchError(
                f"hostfile entry {h}: mpirun cannot take an ssh port per host; set it in ~/.ssh/config instead"
            )
    if flavor == "mpich":
        return "".join(f"{h.name}:{h.slots}\n" for h in hosts)
    return "".join(f"{h.name} slots={h.slots}\n" for h in hosts)


def _env_args(env: Mapping[str, str], flavor: str) -> list[str]:
    out: list[str] = []
    for k, v in env.items():
        out += ["-env", k, v] if flavor == "mpich" else ["-x", f"{k}={v}"]
    return out


def mpirun_argv(
    spec: JobSpec, mpirun: str, flavor: str, root_uri: str, port: Optional[int], hostfile: Optional[str]
) -> list[str]:
    """The whole MPMD command line."""
    base = base_env(spec, root_uri, port)
    argv = [mpirun, *spec.launcher_args]
    if hostfile:
        argv += ["-f", hostfile] if flavor == "mpich" else ["--hostfile", hostfile]
    if spec.sync_dst_dir:
        argv += ["-wdir", spec.sync_dst_dir] if flavor == "mpich" else ["--wdir", spec.sync_dst_dir]
    contexts: list[list[str]] = []
    offset = 0
    for role in ("server", "worker"):
        n = spec.count(role)
        if not n:
            continue
        cmd = spec.serve_argv() if role == "server" else spec.worker_argv()
        guard = guard_argv(spec.python, rank_from=RANK_VARS, rank_offset=offset, prefix=f"{role} {{rank}}")
        np = ["-n", str(n)] if flavor == "mpich" else ["-np", str(n)]
        contexts.append([*np, *_env_args(role_env(spec, base, role), flavor), *guard, "--", *cmd])
        offset += n
    for i, ctx_args in enumerate(contexts):
        if i:
            argv.append(":")
        argv += ctx_args
    return argv


def launch_mpi(spec: JobSpec) -> int:
    """Run the job with one mpirun; the exit status."""
    mpirun = require_tool("mpirun", "mpi", "install Open MPI (openmpi-bin) or MPICH")
    flavor = mpi_flavor(mpirun)
    root_uri = scheduler_address(spec.environ, [h.name.rpartition("@")[2] for h in spec.hosts])
    tmp = tempfile.mkdtemp(prefix="pskv-mpi-")
    try:
        hostfile = None
        if spec.hosts:
            hostfile = os.path.join(tmp, "hostfile")
            with open(hostfile, "w") as f:
                f.write(hostfile_text(spec.hosts, flavor))
        if spec.dry_run:
            port = 0 if spec.num_servers else None
            lines = [f"scheduler here, bound to {root_uri} (its port replaces DMLC_PS_ROOT_PORT=0 below)"] if port == 0 else []
            if hostfile:
                lines.append(f"hostfile {hostfile}:\n{hostfile_text(spec.hosts, flavor)}")
            lines.append(shlex.join(mpirun_argv(spec, mpirun, flavor, root_uri, port, hostfile)))
            print_plan(f"pskv launch --launcher mpi ({flavor})", "\n".join(lines))
            return 0
        if spec.sync_dst_dir:
            if not spec.hosts:
                raise LaunchError("--sync-dst-dir with the mpi launcher needs the hosts: -H/--hostfile FILE")
            from .ssh import check_hosts, destinations, sync

            check_hosts(spec, spec.hosts)
            sync(spec, spec.hosts, destinations(spec, spec.hosts), spec.sync_dst_dir)
        ctx = ProcessContext()

        def body() -> int:
            helpers, port = start_guarded_scheduler(ctx, spec, root_uri)
            argv = mpirun_argv(spec, mpirun, flavor, root_uri, port, hostfile)
            main = ctx.start("mpirun", "mpirun", argv, spec.environ, show="raw")
            return ctx.wait([main], helpers, finish_timeout=finish_timeout(), timeout=spec.timeout)

        return supervise(ctx, body)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
