"""``pskv launch --launcher ssh``: each server and worker is one ssh client here, to a host of the
hostfile, running the guard (docs/launchers/ssh.md shows the commands)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Optional

from ..errors import LaunchError
from .job import Backend, Planned, run_quiet
from .spec import Host, JobSpec, free_port, place, scheduler_address, shell_command

#: added to every ssh command: never prompt, give up on a dead host quickly, no tty
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-T")
#: seconds a remote guard waits between SIGTERM and SIGKILL (less than the launcher's grace)
REMOTE_GRACE = "3"
#: clients started to one machine at a time, and the pause between such waves (sshd's MaxStartups: ssh.md)
STARTUP_WAVE = 8
STARTUP_PAUSE = 0.5


class Destination(NamedTuple):
    """Where a host name leads, as ``ssh -G`` resolves it: equal ones are one machine and account."""

    hostname: str
    port: str
    user: str
    proxy: str


def ssh_argv(spec: JobSpec, host: Host, *remote: str) -> list[str]:
    """``ssh [options] [-p PORT] HOST REMOTE`` (without REMOTE: the options, for ``rsync -e``)."""
    port = ["-p", str(host.port)] if host.port is not None else []
    return [*spec.ssh_command, *SSH_OPTIONS, *port, *([host.name, *remote] if remote else [])]


def destinations(spec: JobSpec, hosts: Sequence[Host]) -> dict[Host, Destination]:
    """What each host name resolves to in the ssh configuration (``ssh -G``: nothing is sent)."""
    out: dict[Host, Destination] = {}
    for h in hosts:
        fields: dict[str, str] = {}
        with contextlib.suppress(LaunchError):  # no ssh here: the names are taken as they are
            res = run_quiet([*ssh_argv(spec, h), "-G", h.name], timeout=30)
            for line in res.stdout.splitlines() if res.returncode == 0 else []:
                key, _, value = line.partition(" ")
                fields.setdefault(key.lower(), value.strip())
        user, _, name = h.name.rpartition("@")
        proxy = fields.get("proxyjump", "") + fields.get("proxycommand", "")
        out[h] = Destination(fields.get("hostname", name), fields.get("port", str(h.port or 22)), fields.get("user", user), proxy)
    return out


def on_each(hosts: Sequence[Host], argv: Callable[[Host], list[str]], failure: str, timeout: float) -> None:
    """Run ``argv(host)`` for every host at once; a :class:`LaunchError` names those where it
    fails (``failure``, then the host names), with the last lines each printed."""

    def why(h: Host) -> str:
        try:
            res = run_quiet(argv(h), timeout=timeout)
        except LaunchError as exc:
            return str(exc)
        lines = [line for line in f"{res.stderr}\n{res.stdout}".splitlines() if line.strip()]
        return "" if res.returncode == 0 else " | ".join(lines[-5:]) or f"exit status {res.returncode}"

    with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
        failed = {h: reason for h, reason in zip(hosts, pool.map(why, hosts)) if reason}
    if failed:
        names = ", ".join(map(str, failed))
        raise LaunchError(f"{failure} {names}; nothing was started\n" + "\n".join(f"  {h}: {r}" for h, r in failed.items()))


def rsync_argv(spec: JobSpec, host: Host, dst: str) -> list[str]:
    name = f"[{host.name}]" if ":" in host.name else host.name
    return ["rsync", "-a", "--mkpath", "-e", shlex.join(ssh_argv(spec, host)), "./", f"{name}:{dst.rstrip('/')}/"]


def distinct(dests: dict[Host, Destination]) -> list[Host]:
    """The first host name of each destination."""
    return [h for i, (h, d) in enumerate(dests.items()) if d not in list(dests.values())[:i]]


def reach(spec: JobSpec, dests: dict[Host, Destination]) -> None:
    """Check every host; with ``--sync-dst-dir``, copy the working directory to each distinct destination."""
    dst = spec.sync_dst_dir
    if dst and shutil.which("rsync") is None:
        raise LaunchError("--sync-dst-dir needs rsync here, and it is not on PATH")
    on_each(list(dests), lambda h: ssh_argv(spec, h, "true"), "cannot reach", timeout=60)
    if dst:
        on_each(distinct(dests), lambda h: rsync_argv(spec, h, dst), f"could not copy {os.getcwd()} to {dst} on", timeout=3600)


class Ssh(Backend):
    def __init__(self, spec: JobSpec):
        super().__init__(spec)
        if not spec.hosts:
            raise LaunchError("the ssh launcher needs the hosts: -H/--hostfile FILE")
        self.cwd = spec.sync_dst_dir or os.getcwd()
        self.dests = destinations(spec, spec.hosts)
        self.address = scheduler_address(spec.environ, [d.hostname for d in self.dests.values()])
        self.title = f"pskv launch --launcher ssh: {spec.num_servers} server(s), {spec.num_workers} worker(s)"

    def plan(self, port: Optional[int]) -> str:
        dst = self.spec.sync_dst_dir
        rsync = [shlex.join(rsync_argv(self.spec, h, dst)) + "\n" for h in distinct(self.dests)] if dst else []
        return "".join(rsync) + super().plan(port)

    def prepare(self) -> None:
        spec = self.spec
        reach(spec, self.dests)
        probe = shell_command([spec.python, "-c", "import pskv.launch.guard"], cwd=self.cwd)
        failure = f"`{spec.python}` cannot import pskv in {self.cwd} (install pskv there, or pass --python) on"
        on_each(spec.hosts, lambda h: ssh_argv(spec, h, probe), failure, timeout=120)

    def processes(self, port: Optional[int]) -> list[Planned]:
        spec = self.spec
        workers = place(spec.num_workers, spec.hosts)
        per_dest = Counter(self.dests[h] for h in workers)  # workers on each machine
        master = {"MASTER_ADDR": self.dests[workers[0]].hostname, "MASTER_PORT": str(free_port())}
        started: Counter[Destination] = Counter()  # clients started to each machine so far
        secret = ["--secret-stdin"] if spec.secret else []  # not on the remote command line
        out = []
        for role, hosts in (("server", place(spec.num_servers, spec.hosts)), ("worker", workers)):
            for rank, h in enumerate(hosts):
                dest = self.dests[h]
                n = per_dest[dest] if role == "worker" else 0  # workers on this machine
                local_rank = sum(self.dests[w] == dest for w in workers[:rank])
                torch = {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(n), **master} if n else {}
                env = spec.process_env(role, self.address, port, rank, torch=torch)
                guard = spec.guarded(role, "--watch-stdin", *secret, "--workers-here", str(n), "--grace", REMOTE_GRACE)
                delay = STARTUP_PAUSE if started[dest] and started[dest] % STARTUP_WAVE == 0 else 0.0
                started[dest] += 1
                argv = ssh_argv(spec, h, shell_command(guard, env, self.cwd))
                out.append(Planned(f"{role} {rank}@{h}", argv, main=role == "worker", stdin="secret" if secret else "pipe", delay=delay))
        return out
