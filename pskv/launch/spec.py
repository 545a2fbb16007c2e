"""The job: what ``pskv launch`` was asked to run (:class:`JobSpec`), and the environment of each of
its processes (:meth:`JobSpec.process_env`, the one builder of the contract of SPEC.md section 8;
docs/launchers/README.md lists it).
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
        """What a server (``pskv serve``) or a worker (the command) runs on a cluster's host; a
        single string with spaces runs through ``/bin/sh -c``, as MXNet's launcher did."""
        if role == "server":
            return [self.python, "-m", "pskv", "serve"]
        if len(self.command) == 1 and " " in self.command[0]:
            return ["/bin/sh", "-c", self.command[0]]
        return list(self.command)

    def guarded(self, role: str, *options: str) -> list[str]:
        """``python3 -m pskv.launch.guard OPTIONS -- ...``: :meth:`argv` under the guard."""
        return [self.python, "-m", "pskv.launch.guard", *options, "--", *self.argv(role)]

    def process_env(
        self,
        role: str,
        root_uri: str,
        port: Optional[int],
        rank: Optional[int] = None,
        *,
        base: Optional[Mapping[str, str]] = None,
        torch: Optional[Mapping[str, str]] = None,
    ) -> dict[str, str]:
        """The environment of one process of ``role`` (``"scheduler"``, ``"server"``, ``"worker"``).

        It starts from ``base`` (this machine's environment, for a process started here), by
        default from the launcher's forwarded ``PSKV_*`` and ``DMLC_INTERFACE`` only. ``rank``
        sets the id where the launcher knows it; ``port`` None (no scheduler) leaves
        ``DMLC_PS_ROOT_PORT`` out. Workers also get ``torch`` (``LOCAL_RANK``, ``MASTER_ADDR``,
        ...). ``--env-ROLE`` comes last, so it wins. ::

            env = spec.process_env("worker", "10.0.0.5", 9000, rank=2)  # DMLC_WORKER_ID=2, RANK=2, ...
        """
        if base is None:
            base = {k: v for k, v in self.environ.items() if k.startswith(FORWARDED) and k not in NOT_FORWARDED}
        env = {**base, **self.env, "DMLC_ROLE": role, "DMLC_PS_ROOT_URI": root_uri, "PYTHONUNBUFFERED": "1"}
        env.update(DMLC_NUM_WORKER=str(self.num_workers), DMLC_NUM_SERVER=str(self.num_servers))
        if port is not None:
            env["DMLC_PS_ROOT_PORT"] = str(port)
        if rank is not None:
            env["DMLC_SERVER_ID" if role == "server" else "DMLC_WORKER_ID"] = str(rank)
        if role == "worker":
            if rank is not None:
                env.update(RANK=str(rank), WORLD_SIZE=str(self.num_workers))
            env.update(torch or {})
        env.update(self.role_env.get(role, {}))
        return env


def free_port() -> int:
    """A port of 127.0.0.1 that was free a moment ago (for ``MASTER_PORT`` only; pskv's own
    ports are never guessed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
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
