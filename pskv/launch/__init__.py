"""``pskv launch``: its options (:func:`add_parser`), and :func:`run`, which hands the job to
:func:`~pskv.launch.job.run_job` with the backend of the ``--launcher`` module (docs/launchers/)."""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from .. import config
from ..errors import LaunchError

#: each launcher: its module, and what there makes its backend from a JobSpec (slurm: Srun or Sbatch)
LAUNCHERS = {"local": "Local", "ssh": "Ssh", "mpi": "Mpi", "slurm": "backend", "sge": "Sge", "yarn": "Yarn", "kubernetes": "Kubernetes"}
#: option (argparse dest) -> its flags and the launchers that use it; giving it to another is an error
_USED_BY: dict[str, tuple[str, tuple[str, ...]]] = {}


def parse_env_specs(specs: Sequence[str]) -> dict[str, str]:
    """``NAME:VALUE`` sets NAME; a bare ``NAME`` passes this process's value of NAME."""
    from .spec import ENV_NAME  # (the one rule for a name: the launchers' scripts check theirs with it too)
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not ENV_NAME.fullmatch(name):
            raise LaunchError(f"--env {spec!r}: expected NAME or NAME:VALUE")
        if not sep:
            if name not in os.environ:
                raise LaunchError(f"--env {name}: {name} is not set here, so there is no value to pass")
            value = os.environ[name]
        out[name] = value
    return out


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``pskv launch`` subcommand's options."""
    p = sub.add_parser(
        "launch",
        help="start a job: scheduler, servers and workers",
        description="Start a parameter-server job: one scheduler, S servers and W workers running COMMAND, "
        "on this machine (--launcher local) or a cluster (ssh, mpi, slurm, sge, yarn, kubernetes; "
        "see docs/launchers/).",
        epilog="examples:\n"
        "  pskv launch -n 2 -s 2 -- python train.py --epochs 5\n"
        "  pskv launch -n 4 -s 2 --launcher ssh -H hosts --sync-dst-dir /tmp/job -- python3 train.py\n"
        "  salloc -N 2 -n 6 pskv launch --launcher slurm -n 4 -s 2 -- python3 train.py\n"
        "  pskv launch -n 4 -s 2 --launcher kubernetes --image IMAGE --output job.yaml -- python3 train.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    def option(*flags: str, used_by: Sequence[str] = (), **kw: Any) -> None:
        action = p.add_argument(*flags, **kw)
        if used_by:  # else every launcher uses it
            _USED_BY[action.dest] = ("/".join(action.option_strings), tuple(used_by))

    cluster, yarn_k8s = tuple(LAUNCHERS)[1:], ("yarn", "kubernetes")
    option("-n", "--num-workers", type=int, required=True, help="number of workers")
    option("-s", "--num-servers", type=int, help="number of servers (default: as many as workers)")
    option("--launcher", choices=LAUNCHERS, help="how to start the processes (default: ssh with -H, as MXNet's launch.py; else local)")
    option("-H", "--hostfile", used_by=("ssh", "mpi", "slurm"), help="hosts to run on (ssh, mpi; slurm: the nodes to ask "
           "for): lines 'host', 'host:port' (ssh port), 'host slots=N' (weight in the round-robin placement); '#' comments")  # fmt: skip
    option("--sync-dst-dir", used_by=("ssh", "mpi"), metavar="DIR",
           help="ssh, mpi: copy the working directory to DIR on every host with rsync first, and run from there")  # fmt: skip
    for suffix, whom in (("", "every process"), ("-server", "servers only"), ("-worker", "workers only")):
        option(f"--env{suffix}", action="append", default=[], metavar="NAME[:VALUE]", help=f"environment for {whom} (NAME alone: this shell's value; repeatable)")
    option("--timeout", type=float, metavar="SECONDS", help="stop the job after this many seconds (exit status 124)")
    option("--replicas", type=int, metavar="R", help="every server's parts are also kept by the next R servers, and the "
           "job goes on when up to R servers are lost (PSKV_REPLICAS; docs/DESIGN.md, 'A lost server')")  # fmt: skip
    option("--min-workers", type=int, metavar="K", help="go on without a worker that fails while K others live "
           "(PSKV_MIN_WORKERS; dist_sync rounds then sum the live workers' gradients); default: a lost worker ends the job")  # fmt: skip
    option("--max-restarts", type=int, used_by=("local",), metavar="N", help="local: start a worker the job went on without "
           "(--min-workers) anew, N times in all; it rejoins at the others' next allgather (PSKV_RESTARTS=1, 2, ... tells it)")  # fmt: skip
    option("--python", used_by=cluster, help="the Python interpreter on the cluster's hosts, which must import pskv "
           "(default: python3; the local launcher always uses the one running pskv)")  # fmt: skip
    option("--ssh-command", used_by=("ssh", "mpi"), help="ssh client command, e.g. 'ssh -F ~/.ssh/cluster_config' "
           "(default: $PSKV_SSH, else ssh); -o BatchMode=yes -o ConnectTimeout=10 -T are always added")  # fmt: skip
    option("--launcher-args", used_by=cluster[1:], metavar="ARGS", help="extra arguments for the cluster tool, split "
           "like a shell: mpirun; srun (inside an allocation) or sbatch; qsub; yarn app -launch; kubectl apply. "
           "Write --launcher-args='--overcommit' (with =) when they start with a dash")  # fmt: skip
    option("--job-name", used_by=cluster[2:], metavar="NAME", help="name of the cluster job (sbatch -J, qsub -N, "
           "YARN service, Kubernetes objects; default: pskv-<random>)")  # fmt: skip
    option("--image", used_by=yarn_k8s, help="kubernetes (required), yarn (optional): the container image, with python and pskv")
    option("--port", used_by=yarn_k8s, type=int, help="kubernetes, yarn: the scheduler's port, where it is addressed by name (default: 9091)")
    option("--cpus", used_by=yarn_k8s, type=float, help="kubernetes, yarn: CPUs for each server and worker")
    option("--memory", used_by=yarn_k8s, type=int, metavar="MB", help="kubernetes, yarn: memory in MiB for each server and worker")
    option("--output", used_by=yarn_k8s, metavar="FILE", help="kubernetes, yarn: write the manifests (JSON, which is "
           "YAML too) / service spec to FILE instead of submitting them")  # fmt: skip
    option("--dry-run", used_by=cluster, action="store_true", help="print what would run (commands, scripts, manifests) and start nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the workers' command (after --)")


def run(args: argparse.Namespace) -> int:
    """Run ``pskv launch`` with parsed ``args``; the exit status. Blocks until the job ends."""
    from .job import run_job
    from .spec import DEFAULT_PORT, JobSpec, read_hostfile

    args.launcher = args.launcher or ("ssh" if args.hostfile else "local")  # MXNet's `launch.py -H hosts -n 2 CMD`
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    ssh = args.ssh_command or os.environ.get("PSKV_SSH") or "ssh"
    try:
        ssh_command = shlex.split(ssh)
        launcher_args = shlex.split(args.launcher_args or "")
    except ValueError as exc:
        raise LaunchError(f"cannot split {ssh!r} or --launcher-args: {exc}") from None
    if not ssh_command:
        raise LaunchError("--ssh-command is empty")
    env = parse_env_specs(args.env)
    servers = args.num_workers if args.num_servers is None else args.num_servers
    given = {**os.environ, **env}
    for flag, var in (("min_workers", "PSKV_MIN_WORKERS"), ("max_restarts", "PSKV_MAX_RESTARTS"), ("replicas", "PSKV_REPLICAS")):
        raw = given.get(var, "").strip()  # set so instead of the flag: checked as the flag is
        if getattr(args, flag) is None and raw not in ("", "0"):
            if not raw.lstrip("-").isdigit():
                raise LaunchError(f"{var}={raw!r} is not a whole number")
            setattr(args, flag, int(raw))
    for dest, (flags, users) in _USED_BY.items():  # (after the settings that stand for them)
        if getattr(args, dest, None) not in (None, False, "") and args.launcher not in users:
            raise LaunchError(f"{flags} is not used by the {args.launcher} launcher (it is for: {', '.join(users)})")
    for name in sorted(set(given) - config.NAMES if config.NAMES else ()):  # (none under python -OO: no docstrings)
        if name.startswith("PSKV_"):  # a misspelled setting would be ignored where it is read
            near = difflib.get_close_matches(name, config.NAMES, 1)
            print(f"pskv launch: {name} is not a pskv setting{f' (did you mean {near[0]}?)' if near else ''}; it is ignored", file=sys.stderr)
    if servers == 0 and (args.min_workers or args.max_restarts is not None):
        raise LaunchError("--min-workers and --max-restarts need servers: with -s 0 no scheduler watches the workers")
    if args.min_workers is not None and not 1 <= args.min_workers < args.num_workers:
        raise LaunchError(f"--min-workers {args.min_workers}: it must be at least 1 and less than -n {args.num_workers}")
    if args.max_restarts is not None and (args.max_restarts < 0 or args.min_workers is None):
        raise LaunchError(f"--max-restarts {args.max_restarts}: it must be >= 0, with --min-workers (a worker rejoins a job that went on without it)")
    if args.replicas and not 0 < args.replicas < servers:
        raise LaunchError(f"--replicas {args.replicas}: it must be at least 0 and less than the number of servers, {servers}")
    for var, value in (("PSKV_MIN_WORKERS", args.min_workers), ("PSKV_MAX_RESTARTS", args.max_restarts), ("PSKV_REPLICAS", args.replicas or None)):
        if value is not None:  # every process reads them (docs/DESIGN.md)
            env[var] = str(value)
    spec = JobSpec(
        args.num_workers, servers, command,
        env=env,
        role_env={"server": parse_env_specs(args.env_server), "worker": parse_env_specs(args.env_worker)},
        python=args.python or "python3", hosts=read_hostfile(args.hostfile) if args.hostfile else [],
        sync_dst_dir=args.sync_dst_dir, timeout=args.timeout, launcher_args=launcher_args, ssh_command=ssh_command,
        name=args.job_name or "", image=args.image, port=DEFAULT_PORT if args.port is None else args.port,
        cpus=args.cpus, memory_mb=args.memory, output=args.output, dry_run=args.dry_run,
    )  # fmt: skip
    module = importlib.import_module(f"{__name__}.{args.launcher}")
    return run_job(spec, getattr(module, LAUNCHERS[args.launcher])(spec))
