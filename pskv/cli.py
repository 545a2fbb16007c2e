"""The ``pskv`` command: ``launch``, ``serve``, ``train``, ``bench``.

Subcommands import what they need when they run, so ``pskv serve`` as a scheduler starts
without loading torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

from .errors import PSKVError


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # train and bench are the training application's (pskv/app): the one place the core reaches it
    if argv and argv[0] == "train":  # its own parser (it re-runs itself as the workers)
        from .app.train import main as train_main

        return train_main(argv[1:])
    if argv and argv[0] == "bench":
        from .app.bench import main as bench_main

        return bench_main(argv[1:])
    from . import launch

    parser = argparse.ArgumentParser(prog="pskv", description="Parameter-server training for PyTorch.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    launch.add_parser(sub)
    sub.add_parser("train", help="train ResNet-18 with several workers and servers (see pskv train --help)", add_help=False)
    sub.add_parser("bench", help="time push/pull rounds against gloo all-reduce (see pskv bench --help)", add_help=False)
    sub.add_parser(
        "serve",
        help="run the scheduler or a server as DMLC_ROLE says",
        description="Run this process's role (DMLC_ROLE=scheduler or server) until the job ends.",
    )
    args = parser.parse_args(argv)
    try:
        if args.cmd == "launch":
            return launch.run(args)
        from .ps import serve

        return serve()
    except PSKVError as exc:
        print(f"pskv {args.cmd}: {exc}", file=sys.stderr)
        return 2
