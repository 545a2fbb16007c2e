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
import tempfile
from typing import Optional

from ..errors import LaunchError
from .guard import guard_argv
from .hosts import scheduler_address
from .job import Backend, Planned, require_tool, run_quiet
from .spec import JobSpec

RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def mpi_flavor(mpirun: str) -> str:
    """``"openmpi"`` or ``"mpich"`` (hydra: MPICH, Intel MPI, MVAPICH), from ``mpirun --version``."""
    res = run_quiet([mpirun, "--version"], timeout=60)
    text = res.stdout + res.stderr
    if "Open MPI" not in text and "OpenRTE" not in text and any(s in text.upper() for s in ("HYDRA", "MPICH", "INTEL(R) MPI")):
        return "mpich"
    return "openmpi"


class Mpi(Backend):
    def __init__(self, spec: JobSpec):
        super().__init__(spec)
        self.mpirun = require_tool("mpirun", "mpi", "install Open MPI (openmpi-bin) or MPICH")
        self.flavor = mpi_flavor(self.mpirun)
        for h in spec.hosts:
            if h.port is not None:
                raise LaunchError(f"hostfile entry {h}: mpirun cannot take an ssh port per host; set it in ~/.ssh/config instead")
        self.address = scheduler_address(spec.environ, [h.name.rpartition("@")[2] for h in spec.hosts])
        self.title = f"pskv launch --launcher mpi ({self.flavor})"
        self.hostfile: Optional[str] = None

    def hostfile_text(self) -> str:
        """The hostfile in the flavour's format."""
        if self.flavor == "mpich":
            return "".join(f"{h.name}:{h.slots}\n" for h in self.spec.hosts)
        return "".join(f"{h.name} slots={h.slots}\n" for h in self.spec.hosts)

    def processes(self, port: Optional[int]) -> list[Planned]:
        spec, mpich = self.spec, self.flavor == "mpich"
        assert self.address is not None
        argv = [self.mpirun, *spec.launcher_args]
        if spec.hosts:
            if self.hostfile is None:
                fd, self.hostfile = tempfile.mkstemp(prefix="pskv-mpi-", suffix=".hosts")
                with os.fdopen(fd, "w") as f:
                    f.write(self.hostfile_text())
            argv += ["-f" if mpich else "--hostfile", self.hostfile]
        if spec.sync_dst_dir:
            argv += ["-wdir" if mpich else "--wdir", spec.sync_dst_dir]
        contexts: list[list[str]] = []
        offset = 0
        for role in spec.roles():
            env = spec.process_env(role, self.address, port).items()
            env_args = [a for k, v in env for a in (["-env", k, v] if mpich else ["-x", f"{k}={v}"])]
            guard = guard_argv(spec.python, rank_from=RANK_VARS, rank_offset=offset, prefix=f"{role} {{rank}}")
            count = ["-n" if mpich else "-np", str(spec.count(role))]
            contexts.append([*count, *env_args, *guard, "--", *spec.argv(role)])
            offset += spec.count(role)
        for i, context in enumerate(contexts):
            argv += [":", *context] if i else context
        return [Planned("mpirun", argv, main=True, show="raw")]

    def plan(self, port: Optional[int]) -> str:
        text = super().plan(port)
        return f"{text}\nhostfile {self.hostfile}:\n{self.hostfile_text()}" if self.hostfile else text

    def prepare(self) -> None:
        if self.spec.sync_dst_dir:
            if not self.spec.hosts:
                raise LaunchError("--sync-dst-dir with the mpi launcher needs the hosts: -H/--hostfile FILE")
            from .ssh import destinations, sync

            sync(self.spec, destinations(self.spec, self.spec.hosts), self.spec.sync_dst_dir)

    def close(self, status: Optional[int]) -> None:
        if self.hostfile:
            os.unlink(self.hostfile)


def backend(spec: JobSpec) -> Backend:
    return Mpi(spec)
