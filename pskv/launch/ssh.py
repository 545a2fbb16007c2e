"""``pskv launch --launcher ssh``: servers and workers on the hosts of a hostfile, over OpenSSH.

1. Every host of the hostfile is checked first, in parallel (``ssh host true``); an unreachable
   one is an error that names it, and nothing is started.
2. ``--sync-dst-dir DIR``: the working directory is copied to DIR on every distinct host
   (``rsync -a --mkpath -e SSH ./ host:DIR/``; names that reach the same account on the same
   machine, as ``ssh -G`` resolves them, are synced once); the processes run from there.
   Without it they run from this directory's path on every host (a shared file system).
3. The remote interpreter (``--python``, default ``python3``) must import pskv there.
4. The scheduler runs here, bound to an address the hosts can reach
   (:func:`~pskv.launch.common.scheduler_address`); servers and workers are placed round
   robin over the hosts (:func:`~pskv.launch.common.place`), each one ``ssh`` client here
   running ``cd DIR && exec env DMLC_...=... python3 -m pskv.launch.guard --watch-stdin -- CMD``
   there. Its output comes back prefixed ``[worker 2@host] ``.
5. The ssh client's stdin is a pipe the launcher never writes: when the job stops (a failure,
   Ctrl-C, ``--timeout``) or the launcher dies, the pipe closes, and the guard on the remote
   host stops its command. Nothing is left running on any host.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from ..errors import LaunchError
from .common import (
    Host,
    JobSpec,
    base_env,
    finish_timeout,
    guard_argv,
    last_lines,
    place,
    print_plan,
    role_env,
    scheduler_address,
    shell_command,
    start_guarded_scheduler,
    supervise,
)
from .local import free_port
from .process import Proc, ProcessContext

#: options added to every ssh command: never prompt, give up on a dead host quickly, no tty
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-T")
#: seconds a remote guard waits between SIGTERM and SIGKILL (less than the launcher's grace)
REMOTE_GRACE = 3.0
#: ssh clients started to one host at a time, and the pause between such waves: sshd drops
#: connections beyond MaxStartups (default 10) that are still authenticating
STARTUP_WAVE = 8
STARTUP_PAUSE = 0.5


@dataclass(frozen=True)
class Destination:
    """Where a host name leads, as ``ssh -G`` resolves it: equal destinations are one machine
    and account (synced once, sharing cores)."""

    hostname: str
    port: str
    user: str
    proxy: str


def ssh_base(spec: JobSpec) -> list[str]:
    return [*spec.ssh_command, *SSH_OPTIONS]


def ssh_argv(spec: JobSpec, host: Host, remote: str) -> list[str]:
    port = ["-p", str(host.port)] if host.port is not None else []
    return [*ssh_base(spec), *port, host.name, remote]


def run_parallel(commands: dict[Host, list[str]], timeout: float) -> dict[Host, tuple[int, str]]:
    """Run one command per host at the same time; (status, stderr + stdout) of each."""
    procs: dict[Host, subprocess.Popen[str]] = {}
    try:
        for host, argv in commands.items():
            procs[host] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
    except OSError as exc:
        for p in procs.values():
            p.kill()
            p.wait()
        raise LaunchError(f"cannot run {commands[next(iter(commands))][0]}: {exc.strerror or exc}") from None
    deadline = time.monotonic() + timeout
    out: dict[Host, tuple[int, str]] = {}
    for host, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out[host] = (p.returncode, f"{stderr}\n{stdout}")
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            out[host] = (124, f"no answer within {timeout:g} s")
    return out


def _fail_hosts(what: str, failures: dict[Host, tuple[int, str]]) -> LaunchError:
    lines = [f"  {host}: {last_lines(text) or f'exit status {code}'}" for host, (code, text) in failures.items()]
    names = ", ".join(str(h) for h in failures)
    return LaunchError(f"{what} {names}; nothing was started\n" + "\n".join(lines))


def check_hosts(spec: JobSpec, hosts: Sequence[Host]) -> None:
    """``ssh host true`` on every host at once; a :class:`LaunchError` names those that fail."""
    results = run_parallel({h: ssh_argv(spec, h, "true") for h in hosts}, timeout=60)
    failed = {h: r for h, r in results.items() if r[0] != 0}
    if failed:
        raise _fail_hosts("cannot reach", failed)


def destinations(spec: JobSpec, hosts: Sequence[Host]) -> dict[Host, Destination]:
    """What each host name resolves to in the ssh configuration (``ssh -G``, nothing sent)."""
    out: dict[Host, Destination] = {}
    for h in hosts:
        fields: dict[str, str] = {}
        port = ["-p", str(h.port)] if h.port is not None else []
        try:
            res = subprocess.run(
                [*ssh_base(spec), *port, "-G", h.name],
                capture_output=True,
                text=True,
                timeout=30,
                stdin=subprocess.DEVNULL,
            )
            if res.returncode == 0:
                for line in res.stdout.splitlines():
                    key, _, value = line.partition(" ")
                    fields.setdefault(key.lower(), value.strip())
        except (OSError, subprocess.TimeoutExpired):
            pass
        name = h.name.rpartition("@")[2]
        out[h] = Destination(
            fields.get("hostname", name),
            fields.get("port", str(h.port or 22)),
            fields.get("user", h.name.rpartition("@")[0]),
            fields.get("proxyjump", "") + fields.get("proxycommand", ""),
        )
    return out


def rsync_argv(spec: JobSpec, host: Host, dst: str) -> list[str]:
    port = ["-p", str(host.port)] if host.port is not None else []
    name = f"[{host.name}]" if ":" in host.name else host.name
    return ["rsync", "-a", "--mkpath", "-e", shlex.join([*ssh_base(spec), *port]), "./", f"{name}:{dst.rstrip('/')}/"]


def distinct(hosts: Sequence[Host], dests: dict[Host, Destination]) -> list[Host]:
    """The first host name of each destination."""
    first: dict[Destination, Host] = {}
    for h in hosts:
        first.setdefault(dests[h], h)
    return list(first.values())


def sync(spec: JobSpec, hosts: Sequence[Host], dests: dict[Host, Destination], dst: str) -> None:
    """Copy the working directory to ``dst`` on each distinct destination."""
    try:
        results = run_parallel({h: rsync_argv(spec, h, dst) for h in distinct(hosts, dests)}, timeout=3600)
    except LaunchError as exc:
        raise LaunchError(f"--sync-dst-dir needs rsync here: {exc}") from None
    failed = {h: r for h, r in results.items() if r[0] != 0}
    if failed:
        raise _fail_hosts(f"could not copy {os.getcwd()} to {dst} on", failed)


def check_python(spec: JobSpec, hosts: Sequence[Host], cwd: str) -> None:
    """The remote interpreter must start the guard (pskv installed there, or in ``cwd``)."""
    probe = shell_command([spec.python, "-c", "import pskv.launch.guard"], cwd=cwd)
    results = run_parallel({h: ssh_argv(spec, h, probe) for h in hosts}, timeout=120)
    failed = {h: r for h, r in results.items() if r[0] != 0}
    if failed:
        raise _fail_hosts(
            f"`{spec.python}` cannot import pskv in {cwd} (install pskv there, or pass --python) on", failed
        )


@dataclass
class Planned:
    """One remote process: its name, role, host and ssh command line."""

    name: str
    role: str
    host: Host
    argv: list[str]


def plan(spec: JobSpec, root_uri: str, port: Optional[int], dests: dict[Host, Destination], cwd: str) -> list[Planned]:
    """The ssh command of every server and worker."""
    base = base_env(spec, root_uri, port)
    servers = place(spec.num_servers, spec.hosts)
    workers = place(spec.num_workers, spec.hosts)
    per_dest: dict[Destination, int] = {}
    local_rank: list[int] = []
    for h in workers:
        local_rank.append(per_dest.get(dests[h], 0))
        per_dest[dests[h]] = local_rank[-1] + 1
    master_addr = dests[workers[0]].hostname
    master_port = str(free_port())
    out: list[Planned] = []
    for s, h in enumerate(servers):
        env = role_env(spec, base, "server", s)
        argv = [*guard_argv(spec.python, watch_stdin=True, grace=REMOTE_GRACE), "--", *spec.serve_argv()]
        out.append(Planned(f"server {s}@{h}", "server", h, ssh_argv(spec, h, shell_command(argv, env, cwd))))
    for w, h in enumerate(workers):
        env = {
            **base,
            "LOCAL_RANK": str(local_rank[w]),
            "LOCAL_WORLD_SIZE": str(per_dest[dests[h]]),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": master_port,
        }
        env = role_env(spec, env, "worker", w)
        here = per_dest[dests[h]]
        argv = [*guard_argv(spec.python, watch_stdin=True, workers_here=here, grace=REMOTE_GRACE), "--", *spec.worker_argv()]
        out.append(Planned(f"worker {w}@{h}", "worker", h, ssh_argv(spec, h, shell_command(argv, env, cwd))))
    return out


def launch_ssh(spec: JobSpec) -> int:
    """Run the job over ssh; the exit status."""
    if not spec.hosts:
        raise LaunchError("the ssh launcher needs the hosts: -H/--hostfile FILE")
    cwd = spec.sync_dst_dir or os.getcwd()
    dests = destinations(spec, spec.hosts)
    root_uri = scheduler_address(spec.environ, [d.hostname for d in dests.values()])
    if spec.dry_run:
        port = 0 if spec.num_servers else None
        lines = []
        if spec.sync_dst_dir:
            lines += [shlex.join(rsync_argv(spec, h, spec.sync_dst_dir)) for h in distinct(spec.hosts, dests)]
        if spec.num_servers:
            lines.append(f"scheduler here, bound to {root_uri} (its port replaces DMLC_PS_ROOT_PORT=0 below)")
        lines += [f"{p.name}: {shlex.join(p.argv)}" for p in plan(spec, root_uri, port, dests, cwd)]
        print_plan(f"pskv launch --launcher ssh: {spec.num_servers} server(s), {spec.num_workers} worker(s)", "\n".join(lines))
        return 0
    check_hosts(spec, spec.hosts)
    if spec.sync_dst_dir:
        sync(spec, spec.hosts, dests, spec.sync_dst_dir)
    check_python(spec, spec.hosts, cwd)
    ctx = ProcessContext()

    def body() -> int:
        helpers, port = start_guarded_scheduler(ctx, spec, root_uri)
        workers: list[Proc] = []
        started: dict[Destination, int] = {}
        for p in plan(spec, root_uri, port, dests, cwd):
            n = started.get(dests[p.host], 0)
            if n and n % STARTUP_WAVE == 0:
                time.sleep(STARTUP_PAUSE)  # stay under sshd's MaxStartups (10 by default)
            started[dests[p.host]] = n + 1
            proc = ctx.start(p.name, p.role, p.argv, spec.environ, show="prefix", stdin="pipe")
            (workers if p.role == "worker" else helpers).append(proc)
        return ctx.wait(workers, helpers, finish_timeout=finish_timeout(), timeout=spec.timeout)

    return supervise(ctx, body)
