"""``pskv launch``: start a job's scheduler, servers and workers.

The options are defined here (:func:`add_parser`) and :func:`run` dispatches to the launcher
module named by ``--launcher``: ``local`` (this machine), ``ssh``, ``mpi``, ``slurm``, ``sge``,
``yarn`` and ``kubernetes``. docs/launchers/ has one page per launcher.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import LaunchError

if TYPE_CHECKING:
    from .common import JobSpec

LAUNCHERS = ("local", "ssh", "mpi", "slurm", "sge", "yarn", "kubernetes")

#: option (argparse dest) -> the launchers that use it; giving it to another one is an error
_OPTION_USERS = {
    "hostfile": ("ssh", "mpi", "slurm"),
    "sync_dst_dir": ("ssh", "mpi"),
    "python": ("ssh", "mpi", "slurm", "sge", "yarn", "kubernetes"),
    "ssh_command": ("ssh", "mpi"),
    "launcher_args": ("mpi", "slurm", "sge", "yarn", "kubernetes"),
    "job_name": ("slurm", "sge", "yarn", "kubernetes"),
    "image": ("yarn", "kubernetes"),
    "port": ("yarn", "kubernetes"),
    "cpus": ("yarn", "kubernetes"),
    "memory": ("yarn", "kubernetes"),
    "output": ("yarn", "kubernetes"),
    "dry_run": ("ssh", "mpi", "slurm", "sge", "yarn", "kubernetes"),
}
_FLAGS = {
    "hostfile": "-H/--hostfile",
    "sync_dst_dir": "--sync-dst-dir",
    "python": "--python",
    "ssh_command": "--ssh-command",
    "launcher_args": "--launcher-args",
    "job_name": "--job-name",
    "image": "--image",
    "port": "--port",
    "cpus": "--cpus",
    "memory": "--memory",
    "output": "--output",
    "dry_run": "--dry-run",
}


def parse_env_specs(specs: Sequence[str]) -> dict[str, str]:
    """``NAME:VALUE`` sets NAME; a bare ``NAME`` passes this process's value of NAME."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not name or not name.replace("_", "a").isalnum() or name[0].isdigit():
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
    p.add_argument("-n", "--num-workers", type=int, required=True, help="number of workers")
    p.add_argument("-s", "--num-servers", type=int, help="number of servers (default: as many as workers)")
    p.add_argument("--launcher", default="local", choices=LAUNCHERS, help="how to start the processes (default: local)")
    p.add_argument(
        "-H",
        "--hostfile",
        help="hosts to run on (ssh, mpi; slurm: the nodes to ask for): lines 'host', 'host:port' "
        "(ssh port), 'host slots=N' (weight in the round-robin placement); '#' comments",
    )
    p.add_argument(
        "--sync-dst-dir",
        metavar="DIR",
        help="ssh, mpi: copy the working directory to DIR on every host with rsync first, and run from there",
    )
    p.add_argument("--env", action="append", default=[], metavar="NAME[:VALUE]", help="environment for every process")
    p.add_argument("--env-server", action="append", default=[], metavar="NAME[:VALUE]", help="environment for servers only")
    p.add_argument("--env-worker", action="append", default=[], metavar="NAME[:VALUE]", help="environment for workers only")
    p.add_argument("--timeout", type=float, help="stop the job after this many seconds")
    p.add_argument(
        "--python",
        help="the Python interpreter on the cluster's hosts, which must import pskv (default: python3; "
        "the local launcher always uses the one running pskv)",
    )
    p.add_argument(
        "--ssh-command",
        help="ssh client command, e.g. 'ssh -F ~/.ssh/cluster_config' (default: $PSKV_SSH, else ssh); "
        "-o BatchMode=yes -o ConnectTimeout=10 -T are always added",
    )
    p.add_argument(
        "--launcher-args",
        metavar="ARGS",
        help="extra arguments for the cluster tool, split like a shell: mpirun; srun (inside an allocation) "
        "or sbatch; qsub; yarn app -launch; kubectl apply. Write --launcher-args='--overcommit' (with =) "
        "when they start with a dash",
    )
    p.add_argument(
        "--job-name",
        metavar="NAME",
        help="name of the cluster job (sbatch -J, qsub -N, YARN service, Kubernetes objects; default: pskv-<random>)",
    )
    p.add_argument("--image", help="kubernetes (required), yarn (optional): the container image, with python and pskv")
    p.add_argument(
        "--port",
        type=int,
        help="kubernetes, yarn: the scheduler's port, where it is addressed by name (default: 9091)",
    )
    p.add_argument("--cpus", type=float, help="kubernetes, yarn: CPUs for each server and worker")
    p.add_argument("--memory", type=int, metavar="MB", help="kubernetes, yarn: memory in MiB for each server and worker")
    p.add_argument(
        "--output",
        metavar="FILE",
        help="kubernetes, yarn: write the manifests (JSON, or YAML for .yaml/.yml) / service spec to FILE "
        "instead of submitting them",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would run (commands, scripts, manifests) and start nothing",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the workers' command (after --)")


def _check_options(args: argparse.Namespace) -> None:
    for dest, users in _OPTION_USERS.items():
        value = getattr(args, dest, None)
        if value not in (None, False, "") and args.launcher not in users:
            raise LaunchError(
                f"{_FLAGS[dest]} is not used by the {args.launcher} launcher (it is for: {', '.join(users)})"
            )


def job_spec(args: argparse.Namespace) -> JobSpec:
    """The :class:`~pskv.launch.common.JobSpec` of parsed ``pskv launch`` options."""
    from .common import DEFAULT_PORT, JobSpec, read_hostfile

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    servers = args.num_workers if args.num_servers is None else args.num_servers
    ssh = args.ssh_command or os.environ.get("PSKV_SSH") or "ssh"
    try:
        ssh_command = shlex.split(ssh)
        launcher_args = shlex.split(args.launcher_args or "")
    except ValueError as exc:
        raise LaunchError(f"cannot split {ssh!r} or --launcher-args: {exc}") from None
    if not ssh_command:
        raise LaunchError("--ssh-command is empty")
    return JobSpec(
        num_workers=args.num_workers,
        num_servers=servers,
        command=command,
        env=parse_env_specs(args.env),
        role_env={"server": parse_env_specs(args.env_server), "worker": parse_env_specs(args.env_worker)},
        python=args.python or "python3",
        hosts=read_hostfile(args.hostfile) if args.hostfile else [],
        sync_dst_dir=args.sync_dst_dir,
        timeout=args.timeout,
        launcher_args=launcher_args,
        ssh_command=ssh_command,
        name=args.job_name or "",
        image=args.image,
        port=DEFAULT_PORT if args.port is None else args.port,
        cpus=args.cpus,
        memory_mb=args.memory,
        output=args.output,
        dry_run=args.dry_run,
    )


def run(args: argparse.Namespace) -> int:
    """Run ``pskv launch`` with parsed ``args``; the exit status."""
    _check_options(args)
    if args.launcher == "local":
        from .local import launch_local

        command = list(args.command)
        if command and command[0] == "--":
            command = command[1:]
        servers = args.num_workers if args.num_servers is None else args.num_servers
        return launch_local(
            args.num_workers,
            servers,
            command,
            extra_env=parse_env_specs(args.env),
            role_extra={"server": parse_env_specs(args.env_server), "worker": parse_env_specs(args.env_worker)},
            timeout=args.timeout,
        )
    spec = job_spec(args)
    if args.launcher == "ssh":
        from .ssh import launch_ssh

        return launch_ssh(spec)
    if args.launcher == "mpi":
        from .mpi import launch_mpi

        return launch_mpi(spec)
    if args.launcher == "slurm":
        from .slurm import launch_slurm

        return launch_slurm(spec)
    if args.launcher == "sge":
        from .sge import launch_sge

        return launch_sge(spec)
    if args.launcher == "yarn":
        from .yarn import launch_yarn

        return launch_yarn(spec)
    from .kubernetes import launch_kubernetes

    return launch_kubernetes(spec)
