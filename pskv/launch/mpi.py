"""``pskv launch --launcher mpi``: servers and workers as the app contexts of one MPMD ``mpirun``
(docs/launchers/mpi.md shows the command, for Open MPI and MPICH)."""

from __future__ import annotations

import itertools
import os
import tempfile
from typing import Optional

from ..errors import LaunchError
from .job import Backend, Planned, require_tool, run_quiet
from .spec import JobSpec, place, scheduler_address

RANK_VARS = "OMPI_COMM_WORLD_RANK,PMI_RANK,PMIX_RANK"


class Mpi(Backend):
    def __init__(self, spec: JobSpec):
        super().__init__(spec)
        self.mpirun = require_tool("mpirun", "mpi", "install Open MPI (openmpi-bin) or MPICH")
        # a hydra (MPICH, Intel MPI, MVAPICH), as `mpirun --version` says, else Open MPI
        res = run_quiet([self.mpirun, "--version"], timeout=60)
        text = (res.stdout + res.stderr).upper()
        hydra = any(name in text for name in ("HYDRA", "MPICH", "INTEL(R) MPI"))
        self.mpich = hydra and "OPEN MPI" not in text and "OPENRTE" not in text
        for h in spec.hosts:
            if h.port is not None:
                raise LaunchError(f"hostfile entry {h}: mpirun cannot take an ssh port per host; set it in ~/.ssh/config instead")
        if spec.sync_dst_dir and not os.path.isabs(spec.sync_dst_dir):
            raise LaunchError(f"--sync-dst-dir {spec.sync_dst_dir}: the mpi launcher needs an absolute path (rsync copies a relative one to the remote home, mpirun --wdir looks for it here)")
        self.address = scheduler_address(spec.environ, [h.name.rpartition("@")[2] for h in spec.hosts])
        self.title = f"pskv launch --launcher mpi ({'mpich' if self.mpich else 'openmpi'})"
        self.hostfile: Optional[str] = None  # MPICH's, with every process's host in rank order
        if spec.hosts and self.mpich:
            fd, self.hostfile = tempfile.mkstemp(prefix="pskv-mpi-", suffix=".hosts")
            with os.fdopen(fd, "w") as f:
                f.write(self.hostfile_text())

    def runs(self, role: str) -> list[tuple[str, int]]:
        """The role's processes in rank order, as (host, count) runs of consecutive processes on one host."""
        placed = place(self.spec.count(role), self.spec.hosts)
        return [(name, len(list(group))) for name, group in itertools.groupby(h.name for h in placed)]

    def hostfile_text(self) -> str:
        return "".join(f"{host}:{n}\n" for role in self.spec.roles() for host, n in self.runs(role))

    def processes(self, port: Optional[int]) -> list[Planned]:
        spec, mpich = self.spec, self.mpich
        by_host = bool(spec.hosts) and not mpich  # Open MPI: --host for each run (MPICH reads them from -f)
        # --oversubscribe: the placement below is the launcher's; slots are weights
        argv = [self.mpirun, *(["--oversubscribe"] if by_host else []), *spec.launcher_args]
        argv += ["-f", self.hostfile] if self.hostfile else []
        if spec.sync_dst_dir:
            argv += ["-wdir" if mpich else "--wdir", spec.sync_dst_dir]
        sep: list[str] = []  # between two app contexts: ":"
        for role in spec.roles():
            env = spec.process_env(role, self.address, port).items()
            env_args = [a for k, v in env for a in (["-env", k, v] if mpich else ["-x", f"{k}={v}"])]
            if spec.secret:  # its value comes from mpirun's environment, never from this command line
                env_args += ["-envlist", "PSKV_SECRET"] if mpich else ["-x", "PSKV_SECRET"]
            offset = spec.num_servers if role == "worker" else 0  # MPI numbers the workers after the servers
            rank = ["--rank-from", RANK_VARS, *(["--rank-offset", str(offset)] if offset else [])]
            guarded = spec.guarded(role, *rank, "--prefix", f"{role} {{rank}}", *(["--say-finished"] if role == "worker" else []))
            for host, n in self.runs(role) if by_host else [("", spec.count(role))]:  # "": mpirun places them
                where = ["--host", host] if host else []
                argv += [*sep, "-n" if mpich else "-np", str(n), *where, *env_args, *guarded]
                sep = [":"]
        return [Planned("mpirun", argv, main=True, show="raw")]

    def plan(self, port: Optional[int]) -> str:
        text = super().plan(port)
        return f"{text}\nhostfile {self.hostfile}:\n{self.hostfile_text()}" if self.hostfile else text

    def prepare(self) -> None:
        if self.spec.sync_dst_dir:
            if not self.spec.hosts:
                raise LaunchError("--sync-dst-dir with the mpi launcher needs the hosts: -H/--hostfile FILE")
            from .ssh import destinations, reach

            reach(self.spec, destinations(self.spec, self.spec.hosts))

    def close(self, status: Optional[int]) -> None:
        if self.hostfile:
            os.unlink(self.hostfile)
