"""The job: what ``pskv launch`` was asked to run (:class:`JobSpec`), and the environment of each
of its processes (:meth:`JobSpec.process_env`, the one builder of that environment).

The contract is SPEC.md section 8: every process gets ``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``,
``DMLC_PS_ROOT_PORT``, ``DMLC_NUM_WORKER``, ``DMLC_NUM_SERVER``, and servers and workers a stable
``DMLC_SERVER_ID`` / ``DMLC_WORKER_ID``; workers also get the variables ``torchrun`` sets. A
process on another host gets exactly the variables built here (never the launcher's whole
environment, which belongs to this machine): those, ``PYTHONUNBUFFERED=1``, the launcher's
``PSKV_*`` settings and ``DMLC_INTERFACE``, then ``--env`` for every process and
``--env-server`` / ``--env-worker`` for one role.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from ..errors import LaunchError
from .hosts import Host

ROLES = ("server", "worker")
DEFAULT_PORT = 9091
#: variables of the launcher's own environment that every remote process gets as well ...
FORWARDED = ("PSKV_", "DMLC_INTERFACE")
#: ... except these, which mean something only here
NOT_FORWARDED = ("PSKV_PORT_FD", "PSKV_SSH")
SERVE = [sys.executable, "-m", "pskv", "serve"]
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class JobSpec:
    """Everything a launcher needs to know about the job, from ``pskv launch``'s options."""

    num_workers: int
    num_servers: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    role_env: dict[str, dict[str, str]] = field(default_factory=lambda: {"server": {}, "worker": {}})
    python: str = "python3"
    hosts: list[Host] = field(default_factory=list)
    sync_dst_dir: Optional[str] = None
    timeout: Optional[float] = None
    launcher_args: list[str] = field(default_factory=list)
    ssh_command: list[str] = field(default_factory=lambda: ["ssh"])
    name: str = ""
    image: Optional[str] = None
    port: int = DEFAULT_PORT
    cpus: Optional[float] = None
    memory_mb: Optional[int] = None
    output: Optional[str] = None
    dry_run: bool = False
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.num_servers < 0:
            raise LaunchError(
                f"need at least one worker and no negative server count, got -n {self.num_workers} -s {self.num_servers}"
            )
        if not self.command:
            raise LaunchError("no command to run: pskv launch -n 2 -s 2 -- python train.py")
        if not self.name:
            self.name = f"pskv-{secrets.token_hex(3)}"

    def roles(self) -> list[str]:
        """The roles that have processes: servers (unless ``-s 0``) and workers."""
        return [r for r in ROLES if self.count(r)]

    def count(self, role: str) -> int:
        return self.num_servers if role == "server" else self.num_workers

    def argv(self, role: str) -> list[str]:
        """What a server (``pskv serve``) or a worker (the command) runs on a cluster's host.
        A single string with spaces runs through ``/bin/sh -c``, as MXNet's launcher did."""
        if role == "server":
            return [self.python, "-m", "pskv", "serve"]
        if len(self.command) == 1 and " " in self.command[0]:
            return ["/bin/sh", "-c", self.command[0]]
        return list(self.command)

    def process_env(
        self,
        role: str,
        root_uri: str,
        port: Optional[int],
        rank: Optional[int] = None,
        *,
        base: Optional[Mapping[str, str]] = None,
        torch: Optional[Mapping[str, str]] = None,
        workers_here: int = 0,
    ) -> dict[str, str]:
        """The environment of one process of ``role`` (``"scheduler"``, ``"server"``, ``"worker"``).

        ``base`` is what it starts from: this machine's environment for a process that runs
        here; by default only the forwarded ``PSKV_*`` / ``DMLC_INTERFACE`` (a remote process).
        ``rank`` sets the id, where the launcher knows it (else a guard sets it from the cluster's
        rank variable); ``port`` None leaves ``DMLC_PS_ROOT_PORT`` out (no scheduler, ``-s 0``).
        Workers also get ``torch`` (``LOCAL_RANK``, ``MASTER_ADDR``, ... where known) and, with
        ``workers_here`` workers sharing this machine, ``OMP_NUM_THREADS`` = cores / that,
        unless set. ``--env-ROLE`` comes last, so it wins. ::

            env = spec.process_env("worker", "10.0.0.5", 9000, rank=2)  # DMLC_WORKER_ID=2, RANK=2, ...
            env = spec.process_env("server", address, port, base=os.environ)  # a server started here
        """
        env = forwarded_env(self.environ) if base is None else dict(base)
        env.update(self.env)
        env.update(DMLC_ROLE=role, DMLC_PS_ROOT_URI=root_uri, PYTHONUNBUFFERED="1")
        env.update(DMLC_NUM_WORKER=str(self.num_workers), DMLC_NUM_SERVER=str(self.num_servers))
        if port is not None:
            env["DMLC_PS_ROOT_PORT"] = str(port)
        if rank is not None:
            env["DMLC_SERVER_ID" if role == "server" else "DMLC_WORKER_ID"] = str(rank)
        if role == "worker":
            if rank is not None:
                env.update(RANK=str(rank), WORLD_SIZE=str(self.num_workers))
            env.update(torch or {})
            if workers_here:
                env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers_here)))
        env.update(self.role_env.get(role, {}))
        return env


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's own variables that every process of the job gets: ``PSKV_*`` settings
    and ``DMLC_INTERFACE`` (an interface name is usually the same on every host)."""
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED) and k not in NOT_FORWARDED}


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for ``MASTER_PORT`` only; pskv's own ports never guess)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def check_env_names(env: Mapping[str, str]) -> None:
    for k in env:
        if not _NAME.fullmatch(k):
            raise LaunchError(f"not an environment variable name: {k!r}")


def shell_command(argv: Sequence[str], env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> str:
    """``cd DIR && exec env A=1 ... argv`` for a remote POSIX shell, every piece quoted."""
    parts = [f"cd {shlex.quote(cwd)} &&"] if cwd else []
    parts.append("exec")
    if env:
        check_env_names(env)
        parts += ["env", *(shlex.quote(f"{k}={v}") for k, v in env.items())]
    return " ".join([*parts, *map(shlex.quote, argv)])


def export_lines(env: Mapping[str, str]) -> str:
    """``export NAME=value`` lines for a POSIX shell script."""
    check_env_names(env)
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
