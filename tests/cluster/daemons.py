"""Real cluster daemons for the launcher tests, started on this machine, on 127.0.0.1.

Every helper starts its daemons in a directory that the caller gives (a pytest ``tmp_path``), on
free ports, as the current user, in the foreground (so their PIDs are known), with their logs in
that directory; and on exit, also when the body raises, it stops exactly what it started: the
daemons by PID (SIGTERM, then SIGKILL after a grace period), their descendants, and the processes
they detached whose working directory lies in that directory (slurmstepd, sge_shepherd). Every
wait has a hard timeout and fails with :class:`DaemonError`, whose message ends with the tail of
the daemon logs. Standard library only. Install the software with scripts/install-cluster-deps.sh.

    sshd(tmpdir)       -> Sshd        OpenSSH server with a generated host key and user key
    refused_port()     -> int         a port on 127.0.0.1 that refuses connections
    mpi_available(), mpi_env(), mpi_hostfile(), mpirun_mpmd()   Open MPI's mpirun
    slurm(tmpdir)      -> Slurm       one-node Slurm (slurmctld + slurmd); Slurm.env() for srun etc.
    gridengine(tmpdir) -> GridEngine  one-host Grid Engine (sge_qmaster + sge_execd); env() for qsub
    find_processes(environ=..., cmdline_contains=..., cwd_under=...), descendants(), terminate()
                                      for "nothing left running" checks, by PID only

Command lines verified here (Debian 12; ``cfg`` is ``Sshd.ssh_config``):

    ssh -F cfg pskv-a 'cd /dir && exec env DMLC_ROLE=worker A=1 /abs/python -m x'
    rsync -e 'ssh -F cfg' -a --mkpath src/ pskv-a:/abs/dst/       (--mkpath: parents created)
    mpirun --oversubscribe --hostfile H -np 2 -x DMLC_ROLE=server cmd : -np 3 -x DMLC_ROLE=worker cmd
        with mpi_env() (OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, ...); each -x
        belongs to its own app context; rank: OMPI_COMM_WORLD_RANK, context: OMPI_MCA_orte_app_num
    srun --overcommit -N1 -n3 hostname
    salloc --overcommit -N1 -n5 srun -n5 printenv SLURM_PROCID
    sbatch --wait script, the script holding per-role steps run at the same time:
        srun --overlap --ntasks=2 --export=ALL,DMLC_ROLE=server cmd &   (one per role, then wait)
    qsub -sync y -cwd -t 1-3 -S /bin/sh -q pskv.q -j y -o DIR -v DMLC_ROLE=worker,A=1 script

Environment on remote hosts. A launcher should pass the job's environment inline in the remote
command (:func:`remote_command`): it needs nothing on the server, while ``SendEnv`` needs a
matching ``AcceptEnv`` in the server's sshd_config (stock Debian accepts only ``LANG LC_*``) and
``PermitUserEnvironment`` needs ~/.ssh/environment on every host. Remote commands start in the
user's home directory with the server's default PATH (plus what the shell's rc files add), so use
absolute paths. When the ssh client is killed, a remote command started without a terminal keeps
running (re-parented to init); with ``ssh -tt`` it gets SIGHUP and dies.

Slurm. Without ``--overcommit`` a job cannot have more tasks than the node has CPUs (it stays
pending, "PartitionConfig"); steps started in the background inside one allocation run one after
another unless each has ``--overlap`` ("step creation temporarily disabled"); a heterogeneous
job (``salloc -n1 : -n2 : -n3``) never starts on this one-node cluster (pending, "Resources").
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import glob
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Optional, Union

StrPath = Union[str, "os.PathLike[str]"]

LOCALHOST = "127.0.0.1"
#: Seconds a helper waits for its daemons to come up before it gives up.
START_TIMEOUT = 60.0
#: Seconds between SIGTERM and SIGKILL when stopping.
STOP_GRACE = 5.0


class DaemonError(RuntimeError):
    """A daemon did not start, or a command against it failed; the message carries the log tails."""


# --------------------------------------------------------------------------------------------
# ports, logs, processes


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port that is free on ``host`` now (the kernel picks it; another process may take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def refused_port(host: str = LOCALHOST) -> Iterator[int]:
    """A port on ``host`` that refuses connections for as long as the context lasts.

    The socket is bound but never listens: a connection gets a RST (ECONNREFUSED) and no other
    process can take the port meanwhile."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
        yield int(s.getsockname()[1])
    finally:
        s.close()


def log_tail(path: StrPath, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file ('' when it does not exist)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _logs_message(logs: Sequence[StrPath]) -> str:
    parts = []
    for log in logs:
        tail = log_tail(log)
        parts.append(f"--- {log} (tail) ---\n{tail if tail else '(empty or missing)'}")
    return "\n".join(parts)


def _proc_table() -> dict[int, int]:
    """pid -> ppid for every process visible in /proc."""
    table: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 2:
            table[int(entry)] = int(fields[1])
    return table


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :].startswith("Z")


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def descendants(pid: int) -> list[int]:
    """PIDs of all live descendants of ``pid`` (children first)."""
    children: dict[int, list[int]] = {}
    for child, parent in _proc_table().items():
        children.setdefault(parent, []).append(child)
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return [p for p in out if alive(p)]


def _ancestors_of_self() -> set[int]:
    table = _proc_table()
    out = {os.getpid()}
    p = os.getpid()
    while p in table and table[p] > 0:
        p = table[p]
        out.add(p)
    return out


def find_processes(
    *,
    environ: Optional[Mapping[str, str]] = None,
    cmdline_contains: Optional[str] = None,
    cwd_under: Optional[StrPath] = None,
) -> list[int]:
    """PIDs of this user's live processes that match every criterion given.

    ``environ``: each NAME=VALUE is in the process's initial environment (/proc/PID/environ);
    ``cmdline_contains``: a substring of the NUL-joined-by-space command line; ``cwd_under``: the
    working directory is that directory or below it. The calling process and its ancestors are
    never returned. Meant for "nothing left running" assertions, e.g.
    ``find_processes(environ={"DMLC_PS_ROOT_PORT": str(port)})`` after a launcher failed."""
    if environ is None and cmdline_contains is None and cwd_under is None:
        raise ValueError("find_processes needs at least one criterion")
    skip = _ancestors_of_self()
    uid = os.getuid()
    root = os.path.realpath(cwd_under) if cwd_under is not None else None
    wanted_env = {f"{k}={v}".encode() for k, v in (environ or {}).items()}
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        pid = int(entry)
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            if root is not None:
                cwd = os.readlink(f"/proc/{pid}/cwd")
                if cwd != root and not cwd.startswith(root.rstrip("/") + "/"):
                    continue
            if cmdline_contains is not None:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                if cmdline_contains not in cmd:
                    continue
            if wanted_env:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = set(f.read().split(b"\0"))
                if not wanted_env <= env:
                    continue
        except OSError:
            continue
        if alive(pid):
            found.append(pid)
    return found


def terminate(pids: Sequence[int], grace: float = STOP_GRACE) -> list[int]:
    """SIGTERM ``pids``, wait up to ``grace`` seconds, SIGKILL what is left; returns the PIDs
    that needed SIGKILL. Only ever signals the PIDs given."""
    live = [p for p in pids if alive(p)]
    for p in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in live):
        time.sleep(0.05)
    killed = [p for p in live if alive(p)]
    for p in killed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(alive(p) for p in killed):
        time.sleep(0.05)
    return killed


@dataclasses.dataclass
class _Daemon:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    log: Path


class _Supervisor:
    """The daemons one helper started, and how to stop them (and only them)."""

    def __init__(self, workdir: Path, logs: Sequence[Path] = ()) -> None:
        self.workdir = workdir
        self.daemons: list[_Daemon] = []
        self.logs: list[Path] = list(logs)

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str], log: Path) -> _Daemon:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            try:
                proc = subprocess.Popen(
                    list(argv),
                    cwd=self.workdir,
                    env=dict(env),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as e:
                raise DaemonError(f"cannot start {name} ({shlex.join(argv)}): {e}") from e
        d = _Daemon(name, list(argv), proc, log)
        self.daemons.append(d)
        if log not in self.logs:
            self.logs.append(log)
        return d

    def fail(self, what: str) -> DaemonError:
        return DaemonError(f"{what}\n{_logs_message(self.logs)}")

    def check_running(self) -> None:
        for d in self.daemons:
            rc = d.proc.poll()
            if rc is not None:
                raise self.fail(f"{d.name} exited with status {rc} ({shlex.join(d.argv)})")

    def wait_for(self, what: str, cond: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_running()
            if cond():
                return
            if time.monotonic() > deadline:
                raise self.fail(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.1)

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop the daemons, then their descendants and detached helpers (cwd in workdir)."""
        mains = [d.proc.pid for d in self.daemons if d.proc.poll() is None]
        extra: list[int] = []
        for p in mains:
            extra.extend(descendants(p))
        terminate(mains, grace)
        extra.extend(find_processes(cwd_under=self.workdir))
        more: list[int] = []
        for p in extra:
            more.extend(descendants(p))
        terminate(list(dict.fromkeys(extra + more)), grace)
        for d in self.daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                d.proc.wait(timeout=5)


def _run(
    argv: Sequence[str],
    *,
    env: Optional[Mapping[str, str]] = None,
    timeout: float = 30.0,
    check: bool = True,
    input: Optional[str] = None,
    cwd: Optional[StrPath] = None,
    logs: Sequence[StrPath] = (),
) -> subprocess.CompletedProcess[str]:
    """Run a short command with a hard timeout; DaemonError (with log tails) when it fails."""
    try:
        res = subprocess.run(
            list(argv),
            env=dict(env) if env is not None else None,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        raise DaemonError(f"timed out after {timeout:.0f}s: {shlex.join(argv)}\n{_logs_message(logs)}") from e
    except OSError as e:
        raise DaemonError(f"cannot run {shlex.join(argv)}: {e}") from e
    if check and res.returncode != 0:
        raise DaemonError(
            f"{shlex.join(argv)} exited with status {res.returncode}\n"
            f"stdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-2000:]}\n{_logs_message(logs)}"
        )
    return res


def _which(name: str, *extra_dirs: str) -> Optional[str]:
    path = os.environ.get("PATH", os.defpath)
    return shutil.which(name, path=os.pathsep.join([path, *extra_dirs, "/usr/sbin", "/sbin"]))


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _short_hostname() -> str:
    return socket.gethostname().split(".")[0]


def _port_accepts(port: int, host: str = LOCALHOST) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _mem_total_mb() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


# --------------------------------------------------------------------------------------------
# ssh


def remote_command(
    argv: Sequence[str], env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None
) -> str:
    """The string to give ``ssh host <string>`` so that ``argv`` runs there with ``env`` added
    to the remote environment and ``cwd`` as working directory: ``cd DIR && exec env A=1 cmd``.

    This inline form works with any sshd (no AcceptEnv / PermitUserEnvironment needed); every
    piece is quoted for the remote POSIX shell."""
    parts: list[str] = []
    if cwd is not None:
        parts.append(f"cd {shlex.quote(cwd)} &&")
    parts.append("exec")
    if env:
        parts.append("env")
        for k, v in env.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"not an environment variable name: {k!r}")
            parts.append(shlex.quote(f"{k}={v}"))
    parts.extend(shlex.quote(a) for a in argv)
    return " ".join(parts)


def sshd_available() -> bool:
    """OpenSSH server and client (and ssh-keygen) are installed."""
    return all(_which(n) for n in ("sshd", "ssh", "ssh-keygen"))


def rsync_available() -> bool:
    return _which("rsync") is not None


@dataclasses.dataclass(frozen=True)
class Sshd:
    """A running sshd on ``host:port`` that accepts ``user`` with ``identity_file``.

    ``ssh_config`` is a client config in which every name of ``aliases`` (default ``pskv-a`` and
    ``pskv-b``), and ``localhost``/``127.0.0.1`` too, reach this sshd; ``down_alias`` (``pskv-down``)
    reaches ``down_port`` on 127.0.0.1, which refuses connections."""

    host: str
    port: int
    user: str
    identity_file: Path
    ssh_config: Path
    known_hosts: Path
    log_file: Path
    pid: int
    aliases: tuple[str, ...]
    down_alias: str
    down_port: int
    directory: Path

    def ssh_command(self) -> list[str]:
        """The ssh client command (without host) that uses this server: ``["ssh", "-F", cfg]``."""
        return ["ssh", "-F", str(self.ssh_config)]

    def rsync_rsh(self) -> str:
        """The value for ``rsync -e`` / ``RSYNC_RSH``: ``ssh -F cfg``."""
        return shlex.join(self.ssh_command())

    def run(
        self, host: str, command: str, timeout: float = 30.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``ssh -F cfg host command`` with a hard timeout."""
        return _run([*self.ssh_command(), host, command], timeout=timeout, check=check, logs=[self.log_file])

    def write_hostfile(self, path: StrPath, hosts: Optional[Sequence[str]] = None) -> Path:
        """A hostfile, one host per line (default: ``aliases``)."""
        p = Path(path)
        p.write_text("".join(f"{h}\n" for h in (hosts if hosts is not None else self.aliases)))
        return p

    def session_pids(self) -> list[int]:
        """Live processes under this sshd: its per-connection children and what they run
        (commands whose ssh client went away without a tty are re-parented to init and no
        longer show here; find those with :func:`find_processes`)."""
        return descendants(self.pid)


_SSHD_CONFIG = """\
Port {port}
ListenAddress {host}
HostKey {host_key}
PidFile {pid_file}
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
MaxStartups 100:30:200
MaxSessions 100
Subsystem sftp internal-sftp
LogLevel VERBOSE
"""

_SSH_CONFIG = """\
Host {aliases}
    HostName {host}
    Port {port}
Host {down_alias}
    HostName {host}
    Port {down_port}
Host *
    User {user}
    IdentityFile {identity}
    IdentitiesOnly yes
    StrictHostKeyChecking no
    UserKnownHostsFile {known_hosts}
    GlobalKnownHostsFile /dev/null
    BatchMode yes
    PasswordAuthentication no
    KbdInteractiveAuthentication no
    GSSAPIAuthentication no
    LogLevel ERROR
    ConnectTimeout 10
    ServerAliveInterval 5
    ServerAliveCountMax 3
"""


def _ssh_banner(port: int, host: str = LOCALHOST) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0) as s:
            s.settimeout(2.0)
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


@contextlib.contextmanager
def sshd(
    tmpdir: StrPath,
    *,
    aliases: Sequence[str] = ("pskv-a", "pskv-b"),
    down_alias: str = "pskv-down",
    timeout: float = START_TIMEOUT,
) -> Iterator[Sshd]:
    """Start ``/usr/sbin/sshd -D -e`` on a free port of 127.0.0.1 (keys, config, log in tmpdir).

    Running as root it needs the privilege-separation directory /run/sshd, which it creates
    (mode 0755) when missing, as the Debian package's init script would."""
    sshd_bin = _which("sshd")
    if sshd_bin is None or not sshd_available():
        raise DaemonError("OpenSSH is not installed (scripts/install-cluster-deps.sh ssh)")
    sshd_bin = os.path.realpath(sshd_bin)  # sshd re-executes itself and wants an absolute path
    d = Path(tmpdir, "sshd")
    d.mkdir(parents=True, exist_ok=True)
    d = d.resolve()
    host_key, user_key = d / "ssh_host_ed25519_key", d / "id_ed25519"
    for key in (host_key, user_key):
        if not key.exists():
            _run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"pskv-test-{key.name}", "-f", str(key)]
            )
    authorized = d / "authorized_keys"
    authorized.write_text(Path(f"{user_key}.pub").read_text())
    authorized.chmod(0o600)
    if os.geteuid() == 0 and not os.path.isdir("/run/sshd"):
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    user = _user()
    log = d / "sshd.log"
    known_hosts = d / "known_hosts"
    with refused_port() as down_port:
        sup = _Supervisor(d, [log])
        try:
            for attempt in range(3):
                port = free_port()
                cfg = d / "sshd_config"
                cfg.write_text(
                    _SSHD_CONFIG.format(
                        port=port,
                        host=LOCALHOST,
                        host_key=host_key,
                        pid_file=d / "sshd.pid",
                        authorized_keys=authorized,
                    )
                )
                _run([sshd_bin, "-t", "-f", str(cfg)], logs=[log])
                daemon = sup.start("sshd", [sshd_bin, "-D", "-e", "-f", str(cfg)], os.environ, log)
                try:
                    sup.wait_for(f"sshd on {LOCALHOST}:{port}", lambda port=port: _ssh_banner(port), timeout)
                    break
                except DaemonError:
                    if attempt < 2 and "Address already in use" in log_tail(log):
                        sup.stop()
                        sup.daemons.clear()
                        continue
                    raise
            ssh_config = d / "ssh_config"
            ssh_config.write_text(
                _SSH_CONFIG.format(
                    aliases=" ".join([*aliases, "localhost", LOCALHOST]),
                    host=LOCALHOST,
                    port=port,
                    down_alias=down_alias,
                    down_port=down_port,
                    user=user,
                    identity=user_key,
                    known_hosts=known_hosts,
                )
            )
            yield Sshd(
                host=LOCALHOST,
                port=port,
                user=user,
                identity_file=user_key,
                ssh_config=ssh_config,
                known_hosts=known_hosts,
                log_file=log,
                pid=daemon.proc.pid,
                aliases=tuple(aliases),
                down_alias=down_alias,
                down_port=down_port,
                directory=d,
            )
        finally:
            sup.stop()


# --------------------------------------------------------------------------------------------
# MPI (Open MPI)


def mpi_available() -> bool:
    """Open MPI's ``mpirun`` is installed (MPICH's is not what these helpers describe)."""
    exe = _which("mpirun")
    if exe is None:
        return False
    try:
        res = subprocess.run(
            [exe, "--version"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in res.stdout + res.stderr or "OpenRTE" in res.stdout + res.stderr


def mpi_env(base: Optional[Mapping[str, str]] = None, oversubscribe: bool = True) -> dict[str, str]:
    """The environment for running Open MPI's ``mpirun`` (4.x) on this one machine.

    ``OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1`` (mpirun refuses root otherwise; same as
    ``--allow-run-as-root``), oversubscription allowed (``--oversubscribe``) unless
    ``oversubscribe`` is false, and mpirun's own
    out-of-band and TCP byte-transfer traffic kept on the loopback interface (otherwise mpirun
    listens on every interface)."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_rmaps_base_oversubscribe": "1",
            "OMPI_MCA_oob_tcp_if_include": "lo",
            "OMPI_MCA_btl_tcp_if_include": "lo",
        }
    )
    if not oversubscribe:
        del env["OMPI_MCA_rmaps_base_oversubscribe"]
    return env


def mpi_hostfile(path: StrPath, slots: int, host: str = "localhost") -> Path:
    """An Open MPI hostfile with one line, ``localhost slots=N``."""
    p = Path(path)
    p.write_text(f"{host} slots={slots}\n")
    return p


def mpirun_mpmd(
    groups: Sequence[tuple[int, Mapping[str, str], Sequence[str]]],
    *,
    hostfile: Optional[StrPath] = None,
    mpirun: str = "mpirun",
) -> list[str]:
    """An Open MPI MPMD command line: one app context per ``(nprocs, env, argv)``, joined by ':'.

    ``mpirun --oversubscribe [--hostfile F] -np 2 -x A=1 cmd : -np 3 -x A=2 cmd``: each ``-x``
    belongs to its own app context. Each process learns its global rank from
    ``OMPI_COMM_WORLD_RANK``, the world size from ``OMPI_COMM_WORLD_SIZE`` and the index of its
    app context from ``OMPI_MCA_orte_app_num``; ranks are numbered through the contexts in order,
    so the k-th process of a group has rank (sum of nprocs before it) + k. (``OMPI_FIRST_RANKS``
    is not that offset: it read "0 0" for every context here.) mpirun forwards all processes'
    output through its own stdout, where a line of one rank can be cut into by another's: have
    each process write its own file (or use ``--output-filename DIR``) when lines matter.
    When a process exits non-zero, mpirun kills the others and exits with that status.

    MPICH's hydra (not installed here; from its manual): ``mpiexec -f hostfile -n 2 -env
    DMLC_ROLE server cmd : -n 3 -env DMLC_ROLE worker cmd`` (``-env NAME VALUE``, two words;
    ``-genv`` for all groups; hostfile lines ``host:N``); rank in ``PMI_RANK``, size in
    ``PMI_SIZE``; no root check."""
    cmd = [mpirun, "--oversubscribe"]
    if hostfile is not None:
        cmd += ["--hostfile", str(hostfile)]
    for i, (n, env, argv) in enumerate(groups):
        if i:
            cmd.append(":")
        cmd += ["-np", str(n)]
        for k, v in env.items():
            cmd += ["-x", f"{k}={v}"]
        cmd += list(argv)
    return cmd


# --------------------------------------------------------------------------------------------
# Slurm


def slurm_available() -> bool:
    """slurmctld, slurmd and the client commands are installed."""
    return all(
        _which(n) for n in ("slurmctld", "slurmd", "srun", "salloc", "sbatch", "sinfo", "squeue", "scancel")
    )


def _slurm_plugin_dir() -> Optional[str]:
    for pattern in (
        "/usr/lib/*/slurm-wlm",
        "/usr/lib/slurm-wlm",
        "/usr/lib64/slurm",
        "/usr/lib/slurm",
        "/usr/local/lib/slurm",
    ):
        for d in sorted(glob.glob(pattern)):
            if glob.glob(os.path.join(d, "auth_*.so")):
                return d
    return None


class _BatchSystem:
    """What the test's Slurm cluster and Grid Engine cell share: client commands run against
    them with a hard timeout, and emptying their queue."""

    logs: tuple[Path, ...]

    def env(self, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        raise NotImplementedError

    def job_ids(self) -> list[str]:
        raise NotImplementedError

    def run(
        self, argv: Sequence[str], timeout: float = 60.0, check: bool = True, cwd: Optional[StrPath] = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command (srun, sbatch, qsub, qstat, ...) against this cluster."""
        return _run(argv, env=self.env(), timeout=timeout, check=check, cwd=cwd, logs=self.logs)

    def jobs_left(self, timeout: float = 30.0) -> list[str]:
        """The job ids still listed after up to ``timeout`` s: a job that has just ended can be
        listed a moment longer (Slurm's COMPLETING state)."""
        deadline = time.monotonic() + timeout
        while (ids := self.job_ids()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return ids

    def _empty_queue(self, cancel: Sequence[str], timeout: float) -> None:
        """Cancel every job with ``cancel`` and wait until the queue lists none."""
        ids = self.job_ids()
        if not ids:
            return
        self.run([*cancel, *dict.fromkeys(ids)], timeout=30, check=False)
        deadline = time.monotonic() + timeout
        while self.job_ids():
            if time.monotonic() > deadline:
                raise DaemonError(f"jobs still queued {timeout:.0f}s after {cancel[0]}\n{_logs_message(self.logs)}")
            time.sleep(0.2)


@dataclasses.dataclass(frozen=True)
class Slurm(_BatchSystem):
    """A one-node Slurm cluster: node ``node`` (127.0.0.1) with ``cpus`` CPUs in ``partition``."""

    conf: Path
    directory: Path
    cluster: str
    node: str
    partition: str
    cpus: int
    ctld_port: int
    slurmd_port: int
    auth: str
    ctld_pid: int
    slurmd_pid: int
    logs: tuple[Path, ...]

    def env(self, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """``base`` (default: os.environ) without inherited SLURM_* variables, plus SLURM_CONF."""
        src = os.environ if base is None else base
        env = {k: v for k, v in src.items() if not k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def job_ids(self) -> list[str]:
        """IDs of the jobs the cluster still knows as pending or running."""
        res = self.run(["squeue", "-h", "-o", "%i"], timeout=30)
        return res.stdout.split()

    def node_state(self) -> str:
        res = self.run(["sinfo", "-h", "-N", "-n", self.node, "-o", "%T"], timeout=30, check=False)
        return res.stdout.strip()

    def cancel_all(self, timeout: float = 30.0) -> None:
        """scancel every job of this cluster and wait until squeue shows none."""
        self._empty_queue(["scancel"], timeout)


def _slurm_conf(
    *,
    d: Path,
    cluster: str,
    node: str,
    partition: str,
    cpus: int,
    real_cpus: int,
    mem_mb: int,
    ctld_port: int,
    slurmd_port: int,
    user: str,
    auth: str,
    munge_socket: Optional[Path],
) -> str:
    lines = [
        f"ClusterName={cluster}",
        f"SlurmctldHost={node}({LOCALHOST})",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        f"StateSaveLocation={d / 'state'}",
        f"SlurmdSpoolDir={d / 'spool'}",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}",
        f"SlurmdPidFile={d / 'slurmd.pid'}",
        f"SlurmctldLogFile={d / 'slurmctld.log'}",
        f"SlurmdLogFile={d / 'slurmd.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        f"AuthType=auth/{auth}",
        f"CredType=cred/{auth}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=bf_interval=1",
        "ReturnToService=2",
        "KillWait=2",
        "InactiveLimit=0",
        "MinJobAge=2",
        f"TmpFS={d / 'tmp'}",
    ]
    if munge_socket is not None:
        lines.append(f"AuthInfo=socket={munge_socket}")
    if cpus != real_cpus:
        lines.append("SlurmdParameters=config_overrides")
    lines += [
        f"NodeName={node} NodeAddr={LOCALHOST} NodeHostname={node} CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN",
        f"PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8",
    ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def slurm(
    tmpdir: StrPath,
    *,
    cpus: Optional[int] = None,
    auth: Optional[str] = None,
    timeout: float = START_TIMEOUT,
) -> Iterator[Slurm]:
    """Start a one-node Slurm: ``slurmctld -D`` and ``slurmd -D`` with a slurm.conf in tmpdir.

    ``cpus``: CPUs the node declares (default: the real count; more than that is declared with
    ``SlurmdParameters=config_overrides``). With the real count on a small machine a job that
    wants more tasks than CPUs needs ``--overcommit`` (``-O``). ``auth``: ``"none"`` (Slurm
    <= 23.02 ships auth/none: no munge needed; the default when available) or ``"munge"`` (a
    private munged with its own key and socket in tmpdir). On exit every job is cancelled and
    the daemons, their slurmstepd processes and the tasks are stopped."""
    if not slurm_available():
        raise DaemonError("Slurm is not installed (scripts/install-cluster-deps.sh slurm)")
    plugin_dir = _slurm_plugin_dir()
    if auth is None:
        auth = "none" if plugin_dir and os.path.exists(os.path.join(plugin_dir, "auth_none.so")) else "munge"
    if auth not in ("none", "munge"):
        raise ValueError(f"auth must be 'none' or 'munge', not {auth!r}")
    d = Path(tmpdir, "slurm")
    d.mkdir(parents=True, exist_ok=True)
    d = d.resolve()
    for sub in ("state", "spool", "tmp"):
        (d / sub).mkdir(exist_ok=True)
    real_cpus = os.cpu_count() or 1
    ncpus = cpus if cpus is not None else real_cpus
    node = _short_hostname()
    user = _user()
    logs = [d / "slurmctld.out", d / "slurmd.out", d / "slurmctld.log", d / "slurmd.log"]
    sup = _Supervisor(d, logs)
    conf = d / "slurm.conf"
    try:
        munge_socket: Optional[Path] = None
        if auth == "munge":
            munge_socket = _start_munge(sup, d, timeout)
        ctld_port, slurmd_port = free_port(), free_port()
        while slurmd_port == ctld_port:
            slurmd_port = free_port()
        conf.write_text(
            _slurm_conf(
                d=d,
                cluster="pskv",
                node=node,
                partition="pskv",
                cpus=ncpus,
                real_cpus=real_cpus,
                mem_mb=max(256, _mem_total_mb() * 8 // 10),
                ctld_port=ctld_port,
                slurmd_port=slurmd_port,
                user=user,
                auth=auth,
                munge_socket=munge_socket,
            )
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(conf)
        ctld = sup.start(
            "slurmctld",
            [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(conf)],
            env,
            d / "slurmctld.out",
        )
        sup.wait_for(f"slurmctld on port {ctld_port}", lambda: _port_accepts(ctld_port), timeout)
        slurmd_ = sup.start(
            "slurmd", [_which("slurmd") or "slurmd", "-D", "-N", node, "-f", str(conf)], env, d / "slurmd.out"
        )
        cluster = Slurm(
            conf=conf,
            directory=d,
            cluster="pskv",
            node=node,
            partition="pskv",
            cpus=ncpus,
            ctld_port=ctld_port,
            slurmd_port=slurmd_port,
            auth=auth,
            ctld_pid=ctld.proc.pid,
            slurmd_pid=slurmd_.proc.pid,
            logs=tuple(sup.logs),
        )
        sup.wait_for(f"node {node} idle in sinfo", lambda: cluster.node_state() == "idle", timeout)
    except BaseException:
        sup.stop()
        raise
    try:
        yield cluster
    finally:
        try:
            with contextlib.suppress(DaemonError):
                cluster.cancel_all(timeout=20)
        finally:
            sup.stop()


def _start_munge(sup: _Supervisor, d: Path, timeout: float) -> Path:
    munged, mungekey = _which("munged"), _which("mungekey")
    if munged is None or mungekey is None:
        raise DaemonError("auth/munge needs munge (munged, mungekey), which is not installed")
    m = d / "munge"
    m.mkdir(mode=0o700, exist_ok=True)
    key = m / "munge.key"
    if not key.exists():
        _run([mungekey, "--create", "--keyfile", str(key)])
    key.chmod(0o600)
    sock = m / "munge.socket"
    log = m / "munged.log"
    sup.logs.append(log)
    sup.start(
        "munged",
        [
            munged,
            "--foreground",
            "--force",
            f"--socket={sock}",
            f"--key-file={key}",
            f"--log-file={log}",
            f"--pid-file={m / 'munged.pid'}",
            f"--seed-file={m / 'munged.seed'}",
        ],
        os.environ,
        m / "munged.out",
    )
    sup.wait_for("munged socket", sock.exists, timeout)
    return sock


# --------------------------------------------------------------------------------------------
# Grid Engine (Debian's gridengine-* packages: Son of Grid Engine 8.1.9)

_SGE_LIB = "/usr/lib/gridengine"
_SGE_SHARE = "/usr/share/gridengine"
_SGE_DEBIAN_ROOT = "/var/lib/gridengine"


def gridengine_available() -> bool:
    """Debian's Grid Engine master, exec daemon and client are installed."""
    needed = [
        *(
            os.path.join(_SGE_LIB, n)
            for n in ("sge_qmaster", "sge_execd", "spoolinit", "spooldefaults", "qsub", "qconf")
        ),
        os.path.join(_SGE_SHARE, "default-configuration"),
        os.path.join(_SGE_SHARE, "util", "resources", "centry"),
        *(os.path.join(_SGE_DEBIAN_ROOT, n) for n in ("bin", "lib", "utilbin", "util")),
    ]
    return all(os.path.exists(p) for p in needed) and all(
        _which(n) for n in ("qsub", "qstat", "qconf", "qdel")
    )


@dataclasses.dataclass(frozen=True)
class GridEngine(_BatchSystem):
    """A one-host Grid Engine cell: qmaster and execd on ``host``, queue ``queue`` with ``slots``
    slots, parallel environment ``pe`` (allocation_rule $pe_slots)."""

    root: Path
    cell: str
    host: str
    qmaster_port: int
    execd_port: int
    queue: str
    pe: str
    slots: int
    qmaster_pid: int
    execd_pid: int
    logs: tuple[Path, ...]

    def env(self, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """``base`` (default: os.environ) plus SGE_ROOT, SGE_CELL, SGE_QMASTER_PORT, SGE_EXECD_PORT."""
        env = {
            k: v for k, v in (os.environ if base is None else base).items() if k not in ("SGE_ND", "SGE_ARCH")
        }
        env.update(
            {
                "SGE_ROOT": str(self.root),
                "SGE_CELL": self.cell,
                "SGE_QMASTER_PORT": str(self.qmaster_port),
                "SGE_EXECD_PORT": str(self.execd_port),
            }
        )
        return env

    def job_ids(self) -> list[str]:
        res = self.run(["qstat", "-u", "*"], timeout=30)
        return [line.split()[0] for line in res.stdout.splitlines()[2:] if line.strip()]

    def delete_all(self, timeout: float = 30.0) -> None:
        """qdel every job and wait until qstat shows none."""
        self._empty_queue(["qdel", "-f"], timeout)


def _sge_conf(d: Path, spool_execd: Path) -> str:
    """Debian's default global configuration, adapted: root may run jobs, private spool dir,
    no mail, fast load reports."""
    changes = {
        "execd_spool_dir": str(spool_execd),
        "mailer": "/bin/true",
        "min_uid": "0",
        "min_gid": "0",
        "load_report_time": "00:00:05",
        "max_unheard": "00:01:00",
    }
    out = []
    for line in Path(_SGE_SHARE, "default-configuration").read_text().splitlines():
        key = line.split()[0] if line.strip() and not line.startswith("#") else None
        if key in changes:
            line = f"{key:<22} {changes[key]}"
        out.append(line)
    return "\n".join(out) + "\n"


_SGE_QUEUE = """\
qname                 {queue}
hostlist              {host}
seq_no                0
load_thresholds       NONE
suspend_thresholds    NONE
nsuspend              1
suspend_interval      00:05:00
priority              0
min_cpu_interval      00:05:00
processors            UNDEFINED
qtype                 BATCH INTERACTIVE
ckpt_list             NONE
pe_list               {pe}
rerun                 FALSE
slots                 {slots}
tmpdir                {tmp}
shell                 /bin/sh
prolog                NONE
epilog                NONE
shell_start_mode      posix_compliant
starter_method        NONE
suspend_method        NONE
resume_method         NONE
terminate_method      NONE
notify                00:00:60
owner_list            NONE
user_lists            NONE
xuser_lists           NONE
subordinate_list      NONE
complex_values        NONE
projects              NONE
xprojects             NONE
calendar              NONE
initial_state         default
""" + "".join(
    f"{k:<21} INFINITY\n"
    for k in (
        "s_rt",
        "h_rt",
        "s_cpu",
        "h_cpu",
        "s_fsize",
        "h_fsize",
        "s_data",
        "h_data",
        "s_stack",
        "h_stack",
        "s_core",
        "h_core",
        "s_rss",
        "h_rss",
        "s_vmem",
        "h_vmem",
    )
)

_SGE_PE = """\
pe_name            {pe}
slots              {slots}
user_lists         NONE
xuser_lists        NONE
start_proc_args    NONE
stop_proc_args     NONE
allocation_rule    $pe_slots
control_slaves     TRUE
job_is_first_task  TRUE
urgency_slots      min
accounting_summary FALSE
qsort_args         NONE
"""


def _sge_host_names() -> tuple[str, list[str]]:
    """Grid Engine's name for this host and the other names its address resolves back to.

    SGE compares the name a client reports with the reverse lookup of its address; with
    "127.0.0.1 localhost" first in /etc/hosts, the hostname (say ``vm``) comes back as
    ``localhost`` and qmaster refuses every client ("access denied (client IP resolved to host
    name "localhost". This is not identical to clients host name "vm")"). The cell's
    common/host_aliases file maps those names onto one."""
    name = socket.gethostname()
    aliases: list[str] = []
    with contextlib.suppress(OSError):
        infos = socket.getaddrinfo(name, None, socket.AF_INET)
        for addr in dict.fromkeys(str(i[4][0]) for i in infos):
            with contextlib.suppress(OSError):
                rev, rev_aliases, _ = socket.gethostbyaddr(addr)
                aliases += [rev, *rev_aliases]
    return name, [a for a in dict.fromkeys(aliases) if a != name]


@contextlib.contextmanager
def gridengine(
    tmpdir: StrPath,
    *,
    slots: int = 16,
    timeout: float = START_TIMEOUT,
) -> Iterator[GridEngine]:
    """Start a private Grid Engine cell (SGE_ROOT in tmpdir, classic spooling): ``sge_qmaster``
    and ``sge_execd`` in the foreground (SGE_ND=1) on free ports, with queue ``pskv.q`` (``slots``
    slots on this host) and parallel environment ``smp``; ``GridEngine.env()`` is what qsub,
    qstat, qdel and qconf need. Debian's system cell under /var/lib/gridengine is not touched.
    On exit every job is deleted and both daemons (and their shepherds) are stopped."""
    if not gridengine_available():
        raise DaemonError("Grid Engine is not installed (scripts/install-cluster-deps.sh sge)")
    d = Path(tmpdir, "sge")
    d.mkdir(parents=True, exist_ok=True)
    d = d.resolve()
    root, cell = d / "root", "default"
    common = root / cell / "common"
    common.mkdir(parents=True, exist_ok=True)
    for sub in ("bin", "lib", "utilbin", "util"):
        link = root / sub
        if not link.exists():
            link.symlink_to(os.path.join(_SGE_DEBIAN_ROOT, sub))
    spool_qmaster, spool_execd, tmp = d / "spool" / "qmaster", d / "spool" / "execd", d / "tmp"
    for p in (spool_qmaster / "job_scripts", spool_execd, tmp):
        p.mkdir(parents=True, exist_ok=True)
    user = _user()
    host, aliases = _sge_host_names()
    spooling_params = f"{root / cell / 'common'};{spool_qmaster}"
    (common / "bootstrap").write_text(
        "# Version: 6.2\n"
        f"admin_user              {user}\n"
        "default_domain          none\n"
        "ignore_fqdn             true\n"
        "spooling_method         classic\n"
        "spooling_lib            libspoolc\n"
        f"spooling_params         {spooling_params}\n"
        f"binary_path             {_SGE_LIB}\n"
        f"qmaster_spool_dir       {spool_qmaster}\n"
        "security_mode           none\n"
        "listener_threads        2\n"
        "worker_threads          2\n"
        "scheduler_threads       1\n"
    )
    (common / "act_qmaster").write_text(f"{host}\n")
    (common / "cluster_name").write_text("pskv\n")
    if aliases:
        (common / "host_aliases").write_text(" ".join([host, *aliases]) + "\n")
    conf_file = d / "global_configuration"
    conf_file.write_text(_sge_conf(d, spool_execd))

    qmaster_port, execd_port = free_port(), free_port()
    while execd_port == qmaster_port:
        execd_port = free_port()
    cluster = GridEngine(
        root=root,
        cell=cell,
        host=host,
        qmaster_port=qmaster_port,
        execd_port=execd_port,
        queue="pskv.q",
        pe="smp",
        slots=slots,
        qmaster_pid=0,
        execd_pid=0,
        logs=(d / "qmaster.out", spool_qmaster / "messages", d / "execd.out"),
    )
    env = cluster.env()
    logs = list(cluster.logs)
    sup = _Supervisor(d, logs)
    try:
        if not (spool_qmaster / "managers").exists():
            spool = os.path.join(_SGE_LIB, "spoolinit")
            defaults = os.path.join(_SGE_LIB, "spooldefaults")
            _run([spool, "classic", "libspoolc", spooling_params, "init"], env=env, cwd=d, logs=logs)
            _run([defaults, "configuration", str(conf_file)], env=env, cwd=d, logs=logs)
            _run(
                [defaults, "complexes", os.path.join(_SGE_SHARE, "util", "resources", "centry")],
                env=env,
                cwd=d,
                logs=logs,
            )
            _run(
                [defaults, "usersets", os.path.join(_SGE_SHARE, "util", "resources", "usersets")],
                env=env,
                cwd=d,
                logs=logs,
            )
            _run([defaults, "managers", user], env=env, cwd=d, logs=logs)
            _run([defaults, "adminhosts", host], env=env, cwd=d, logs=logs)
        denv = {**env, "SGE_ND": "1"}
        qmaster = sup.start("sge_qmaster", [os.path.join(_SGE_LIB, "sge_qmaster")], denv, d / "qmaster.out")

        def qmaster_up() -> bool:
            return _run(["qconf", "-sh"], env=env, timeout=30, check=False, logs=logs).returncode == 0

        sup.wait_for(f"sge_qmaster on port {qmaster_port}", qmaster_up, timeout)
        execd = sup.start("sge_execd", [os.path.join(_SGE_LIB, "sge_execd")], denv, d / "execd.out")
        cluster = dataclasses.replace(cluster, qmaster_pid=qmaster.proc.pid, execd_pid=execd.proc.pid)

        sconf = _run(["qconf", "-ssconf"], env=env, logs=logs).stdout
        fast = {
            "schedule_interval": "0:0:1",
            "flush_submit_sec": "1",
            "flush_finish_sec": "1",
            "job_load_adjustments": "NONE",
            "load_adjustment_decay_time": "0:0:0",
        }
        lines = []
        for line in sconf.splitlines():
            key = line.split()[0] if line.split() else ""
            lines.append(f"{key} {fast[key]}" if key in fast else line)
        (d / "sched_configuration").write_text("\n".join(lines) + "\n")
        (d / "pe.txt").write_text(_SGE_PE.format(pe=cluster.pe, slots=999))
        (d / "queue.txt").write_text(
            _SGE_QUEUE.format(queue=cluster.queue, host=host, pe=cluster.pe, slots=slots, tmp=tmp)
        )
        _run(["qconf", "-Msconf", str(d / "sched_configuration")], env=env, logs=logs)
        if host not in _run(["qconf", "-ss"], env=env, check=False, logs=logs).stdout.split():
            _run(["qconf", "-as", host], env=env, logs=logs)

        def execd_registered() -> bool:
            res = _run(["qconf", "-sel"], env=env, timeout=30, check=False, logs=logs)
            return res.returncode == 0 and host in res.stdout.split()

        sup.wait_for(f"sge_execd registered as {host}", execd_registered, timeout)
        _run(["qconf", "-Ap", str(d / "pe.txt")], env=env, logs=logs)
        _run(["qconf", "-Aq", str(d / "queue.txt")], env=env, logs=logs)

        def queue_ready() -> bool:
            res = _run(["qstat", "-f", "-q", cluster.queue], env=env, timeout=30, check=False, logs=logs)
            for line in res.stdout.splitlines():
                if line.startswith(f"{cluster.queue}@"):
                    fields = line.split()
                    # queuename qtype resv/used/tot. load_avg arch [states]: no state = usable
                    return len(fields) == 5 and fields[3] != "-NA-"
            return False

        sup.wait_for(f"queue {cluster.queue} available", queue_ready, timeout)
    except BaseException:
        sup.stop(grace=1.5)  # sge_qmaster takes ~10 s to honour SIGTERM; its state is disposable
        raise
    try:
        yield cluster
    finally:
        try:
            with contextlib.suppress(DaemonError):
                cluster.delete_all(timeout=20)
        finally:
            sup.stop(grace=1.5)  # sge_qmaster takes ~10 s to honour SIGTERM; its state is disposable
