"""The ``pskv`` command: ``launch``, ``serve`` (and ``train``, ``bench``).

Subcommands import what they need when they run, so ``pskv serve`` as a scheduler starts
without loading torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Optional

from .errors import LaunchError, PSKVError


def parse_env_specs(specs: Sequence[str]) -> dict[str, str]:
    """``NAME:VALUE`` sets NAME; a bare ``NAME`` passes this process's value of NAME."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not name or not name.replace("_", "a").isalnum():
            raise LaunchError(f"--env {spec!r}: expected NAME or NAME:VALUE")
        if not sep:
            if name not in os.environ:
                raise LaunchError(f"--env {name}: {name} is not set here, so there is no value to pass")
            value = os.environ[name]
        out[name] = value
    return out


def _launch_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "launch",
        help="start a job: scheduler, servers and workers",
        description="Start a parameter-server job: one scheduler, S servers and W workers running COMMAND.",
        epilog="example: pskv launch -n 2 -s 2 -- python train.py --epochs 5",
    )
    p.add_argument("-n", "--num-workers", type=int, required=True, help="number of workers")
    p.add_argument("-s", "--num-servers", type=int, help="number of servers (default: as many as workers)")
    p.add_argument("-H", "--hostfile", help="hosts to run on (ssh, mpi): lines 'host', 'host:port', 'host slots=N'")
    p.add_argument("--launcher", default="local", choices=["local"], help="how to start the processes (default: local)")
    p.add_argument("--sync-dst-dir", help="copy the working directory to this directory on every host first")
    p.add_argument("--env", action="append", default=[], metavar="NAME[:VALUE]", help="environment for every process")
    p.add_argument("--env-server", action="append", default=[], metavar="NAME[:VALUE]", help="environment for servers only")
    p.add_argument("--env-worker", action="append", default=[], metavar="NAME[:VALUE]", help="environment for workers only")
    p.add_argument("--timeout", type=float, help="stop the job after this many seconds")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the workers' command (after --)")


def _launch(args: argparse.Namespace) -> int:
    from .launch.local import launch_local

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


def _serve(args: argparse.Namespace) -> int:
    from .ps import serve

    return serve()


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":  # its own argument parser (it re-runs itself as the workers)
        from .train import main as train_main

        return train_main(argv[1:])
    parser = argparse.ArgumentParser(prog="pskv", description="Parameter-server training for PyTorch.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _launch_parser(sub)
    sub.add_parser("train", help="train ResNet-18 with several workers and servers (see pskv train --help)", add_help=False)
    sub.add_parser(
        "serve",
        help="run the scheduler or a server as DMLC_ROLE says",
        description="Run this process's role (DMLC_ROLE=scheduler or server) until the job ends.",
    )
    args = parser.parse_args(argv)
    try:
        if args.cmd == "launch":
            return _launch(args)
        return _serve(args)
    except PSKVError as exc:
        print(f"pskv {args.cmd}: {exc}", file=sys.stderr)
        return 2
